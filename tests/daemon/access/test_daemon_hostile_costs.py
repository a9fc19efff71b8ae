"""Cost amplification (issue 47): what one request makes the daemon hold or compute is
bounded by a setting and charged before the work starts.

A hostile tenant sends requests small in bytes that a daemon once expanded far past
them: a pack spec of a few bytes listing one run per element, a malformed spec that
ended in a bare 500. Each test is one rule, named as that rule, against a real
daemon on 127.0.0.1:0 with two token tenants: ``a`` publishes model ``am`` (v1 and
v2 of one bfloat16 tensor, so the daemon holds v2's delta against v1), ``b`` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import FakeClock, GatedCopier, daemon_config, served, token_file
from support.mirrorhosts import TOKENS as MIRROR_TOKENS
from support.tenants import (
    SAFETY_S,
    TOKENS,
    headers,
    publish_bytes,
    pull_request,
    two_tenants,
    until,
)

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.waits import MAX_WAIT_S, MAX_WAITS_PER_PRINCIPAL, WAITS
from refitd.daemon.experts.pools import POOL_KEY_BYTES, POOL_LAYER_BYTES, POOL_SLOT_BYTES
from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.routes import MIRRORS
from refitd.daemon.pull.core import SUSPECT_KEPT
from refitd.daemon.pull.pulls import PLAN_RUN_BYTES, PULLS
from refitd.daemon.state.manifestcheck import MANIFEST_SHARD_BYTES, MANIFEST_TENSOR_BYTES
from refitd.daemon.state.registry import Registry
from refitd.errors import ConflictError, NotFoundError, ProtocolError, QuotaExceeded
from refitd.wire import (
    DeltaPackRequest,
    DescriptorTable,
    ManifestIn,
    PackSpec,
    PullRequest,
    PullState,
    ShardEntry,
    TensorEntry,
    VersionState,
)
from refitd.wire import routes as api
from refitd.wire.mirrors import MirrorLease
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

ELEMS = 2048
"""bfloat16 elements of ``am``'s one tensor (4 KiB)."""
NBYTES = 2 * ELEMS
RUNS = 1000
"""``limits.max_plan_runs`` of the daemon under attack."""


@dataclass
class Env:
    daemon: Daemon
    url: str
    a: RefitClient
    b: RefitClient
    region: int  # v2's region


def manifest(version: int, region: int) -> ManifestIn:
    shard = ShardEntry((0,), (ELEMS,), region, 0)
    return ManifestIn("am", version, 0, 1, [TensorEntry("w", (ELEMS,), "bfloat16", [shard])])


@contextlib.asynccontextmanager
async def two_versions(tmp: Path, **options: Any) -> AsyncIterator[Env]:
    """``a`` publishes v1 and v2 of ``am`` (64 elements differ); v2's delta is ready."""
    settings: dict[str, Any] = {"deltas": True, "max_plan_runs": RUNS, **options}
    async with two_tenants(tmp, node_id="hostile-costs", **settings) as t:
        v1 = np.random.default_rng(1).integers(0, 1 << 16, ELEMS, dtype=np.uint16)
        v2 = v1.copy()
        v2[:64] += 1
        region = 0
        for version, words in ((1, v1), (2, v2)):
            info = await t.a.create_region(NBYTES, label=f"v{version}")
            with SharedSegment.attach(info.handle, NBYTES) as seg:
                seg.numpy(np.uint16)[:] = words
            await t.a.publish(manifest(version, info.region_id))
            region = info.region_id
        rec = await t.a.delta_info("am", 2, wait_s=60.0)
        assert rec.state == "ready", rec
        yield Env(t.served.daemon, t.served.url, t.a, t.b, region)


async def post(env: Env, path: str, value: Any) -> tuple[int, Any]:
    """``POST path`` of msgpack ``value`` as tenant b: the status and the answer."""
    headers = {"Authorization": f"Bearer {TOKENS['b']}", "Content-Type": "application/msgpack"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(env.url + path, data=msgspec.msgpack.encode(value), headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


def refused(status: int, res: Any, expected: int, *named: str) -> None:
    """``expected`` in the error shape, its detail naming each of ``named``."""
    assert status == expected, (status, res)
    assert isinstance(res, dict) and set(res) == {"error", "detail"}, res
    for word in named:
        assert word in res["detail"], (word, res)


def no_rows() -> DescriptorTable:
    return DescriptorTable(b"")


async def delta_request(env: Env, specs: list[PackSpec]) -> tuple[str, DeltaPackRequest]:
    lease = await env.b.acquire_lease("am", 2, ttl_s=600)
    rec = await env.b.delta_info("am", 2)
    req = DeltaPackRequest("am", 2, lease.lease_id, 1, rec.base_digest, no_rows(), specs)
    return lease.lease_id, req


# ---------------------------------------------------------------- class 2: specs expanded per run


async def test_a_stride_zero_delta_pack_spec_is_refused_before_it_is_expanded_run_by_run(
    tmp_path: Path,
) -> None:
    """A stride-0 spec at exactly the stream bound (4 times the version's bytes) of
    one bfloat16 element a run: 8,192 runs, more than ``limits.max_plan_runs``. It is
    refused (413 naming the setting) before the daemon lists a run; nothing is
    staged. Before, the daemon listed (and selected changes for) every run."""
    async with two_versions(tmp_path) as env:
        spec = PackSpec(env.region, 0, (4 * ELEMS,), (0,), 2, 0, 0)
        lease, req = await delta_request(env, [spec])
        status, res = await post(env, "/v1/deltas/pack", req)
        refused(status, res, 413, "limits.max_plan_runs", str(4 * ELEMS))
        assert env.daemon.staging.packed_for(lease) == {}


async def test_a_stride_zero_pack_spec_of_a_pull_or_a_peer_pack_is_refused_before_it_is_expanded(
    tmp_path: Path,
) -> None:
    """The same spec in a pull and in a peer pack: refused (413) before any run is
    listed or any byte moves, on every path that expands a spec."""
    async with two_versions(tmp_path) as env:
        dst = await env.b.create_region(4 * NBYTES, label="dst")
        lease = await env.b.acquire_lease("am", 2, ttl_s=600)
        spec = PackSpec(env.region, 0, (4 * ELEMS,), (0,), 2, dst.region_id, 0)
        pull = PullRequest("am", 2, lease.lease_id, no_rows(), [spec], "")
        status, res = await post(env, "/v1/pulls", pull)
        refused(status, res, 413, "limits.max_plan_runs")
        pack = {"model": "am", "version": 2, "lease_id": lease.lease_id, "specs": [spec]}
        status, res = await post(env, "/v1/peer/pack", pack)
        refused(status, res, 413, "limits.max_plan_runs")
        assert env.daemon.staging.packed_for(lease.lease_id) == {}


# ---------------------------------------------------------------- class 7: bare 500s


async def test_a_delta_pack_spec_whose_strides_and_shape_differ_in_length_is_a_400(
    tmp_path: Path,
) -> None:
    """As the pull and peer-pack paths answer: 400 naming the spec, nothing staged
    (it was a bare 500)."""
    async with two_versions(tmp_path) as env:
        lease, req = await delta_request(env, [PackSpec(env.region, 0, (4,), (1, 1), 2, 0, 0)])
        status, res = await post(env, "/v1/deltas/pack", req)
        refused(status, res, 400, "pack spec 0", "strides")
        assert env.daemon.staging.packed_for(lease) == {}


async def test_a_relay_whose_upstream_mirror_is_not_made_in_time_gets_a_named_refusal(
    tmp_path: Path,
) -> None:
    """A downstream relay asks the mirror host for a lease on a mirror whose regions
    are not made within the wait (its fill has not got that far: the mirror is put in
    the host's store as its first step puts it, and goes no further). The answer is a
    409 naming the mirror, which the relay treats as any failed holder; it was a bare
    500 from the wait's ``TimeoutError``."""
    secret = b"hostile-costs-secret-0123456789ab"
    access = ServerConfig(port=0, token_file=token_file(tmp_path, MIRROR_TOKENS))
    source = Daemon(daemon_config(node_id="source", transport="tcp"), secret=secret)
    host = Daemon(daemon_config(node_id="host", transport="tcp", policy="always"), secret=secret)
    async with (
        served(source, access=access) as s,
        served(host, access=access, token=MIRROR_TOKENS["peer"]) as h,
        RefitClient(s.url, token=MIRROR_TOKENS["peer"]) as at_source,
        RefitClient(h.url, token=MIRROR_TOKENS["a"]) as a,
    ):
        host.peers.replace("test", [s.url])
        info = await at_source.create_region(NBYTES, label="w")
        await at_source.publish(manifest(1, info.region_id))
        lease = await at_source.acquire_lease("am", 1, 600.0)
        h.app[MIRRORS].by_key[(s.url, "am", 1)] = Mirror(s.url, "am", 1)
        ask = MirrorLease.fresh("am", 1, lease.lease_id, "relay-b", 60.0).signed(secret)
        with pytest.raises(ConflictError, match="has not made its regions"):
            await a._send(api.MIRROR_LEASE, ask)


# ---------------------------------------------------------------- class 6: a wait outside the cap


async def test_mirror_state_long_polls_count_against_the_cap_and_give_their_places_back(
    tmp_path: Path,
) -> None:
    """``GET /v1/mirrors/{model}/{version}?after=`` on a mirror still filling is a long
    poll: tenant a holds at most the cap open (the one past it is 429 naming the cap,
    holding nothing), and each dropped by its client gives its place back; b's long
    polls are its own. Before, none was counted, and a dropped one waited out its
    timeout."""
    async with two_tenants(tmp_path, node_id="hostile-costs-mirror") as t:
        m = Mirror("http://127.0.0.1:9", "am", 1)
        m.chunks = np.array([[1, 0, NBYTES]], dtype=np.int64)
        m.done = np.zeros(1, dtype=bool)
        t.served.app[MIRRORS].by_key[(m.source, "am", 1)] = m
        waits = t.served.app[WAITS]
        url = f"{t.served.url}/v1/mirrors/am/1?after=0&timeout={MAX_WAIT_S:g}"
        dropped = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        polls = [
            asyncio.ensure_future(dropped.get(url, headers=headers("a")))
            for _ in range(MAX_WAITS_PER_PRINCIPAL)
        ]
        await until(lambda: waits.open("a") == MAX_WAITS_PER_PRINCIPAL)
        async with aiohttp.ClientSession() as http, http.get(url, headers=headers("a")) as r:
            refused(r.status, await r.json(content_type=None), 429, "long polls")
        async with aiohttp.ClientSession() as http:
            b = asyncio.ensure_future(http.get(url, headers=headers("b")))
            await until(lambda: waits.open("b") == 1)
            b.cancel()
            await asyncio.gather(b, return_exceptions=True)
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        await dropped.close()
        await until(lambda: waits.open("a") == 0 and waits.open("b") == 0)


async def test_a_drain_its_client_left_gives_its_place_back_and_its_retire_stays(
    tmp_path: Path,
) -> None:
    """A drain waits for the version's leases for the timeout it asks (an hour
    here): a long poll of the model's owner. Dropped by its client, it gives its
    place back as the other long polls do; what it asked (``retire=1``) stays done.
    Before, it held its place (a connection, a task) until its own timeout."""
    async with two_tenants(tmp_path, node_id="hostile-costs-drain") as t:
        region = await t.a.create_region(NBYTES, label="w")
        await publish_bytes(t.a, "am", 1, region.region_id, NBYTES)
        await t.b.acquire_lease("am", 1, 3600.0)  # the drain waits for it
        waits = t.served.app[WAITS]
        url = f"{t.served.url}/v1/sources/am/versions/1/drain?retire=1&timeout=3600"
        async with aiohttp.ClientSession() as http:
            drain = asyncio.ensure_future(http.post(url, headers=headers("a")))
            await until(lambda: waits.open("a") == 1)
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
        await until(lambda: waits.open("a") == 0)
        assert (await t.a.version("am", 1)).state is VersionState.RETIRED


# ---------------------------------------------------------------- class 8: expiry on a clock


async def test_a_pending_version_is_forgotten_at_its_ttl_with_no_other_request(
    tmp_path: Path,
) -> None:
    """a publishes part 0 of 2 and nothing else happens on the daemon: at its TTL the
    version and its manifest are gone (the daemon holds none of its shards, a's
    charge ends), by the daemon's own timer. Before, they stayed until some request
    looked."""
    async with two_tenants(tmp_path, node_id="hostile-costs-ttl", pending_ttl_s=0.5) as t:
        info = await t.a.create_region(NBYTES, label="v1")
        await t.a.publish(ManifestIn("am", 1, 0, 2, manifest(1, info.region_id).tensors))
        registry = t.served.daemon.registry
        assert registry.held_shards() == 1
        await until(lambda: registry.held_shards() == 0 and registry.next_pending_s() is None)
        with pytest.raises(NotFoundError):
            await t.b.version("am", 1)


async def test_a_pending_version_past_its_ttl_is_neither_listed_nor_read_before_its_timer(
    tmp_path: Path,
) -> None:
    """On the daemon's clock, past the TTL and before its timer fires (the clock is
    the test's): the version is gone for every reader, its state and its manifest
    alike. Before, it was readable as pending until another publish."""
    clock = FakeClock()
    opts = daemon_config(node_id="hostile-costs-ttl-clock", pending_ttl_s=60.0)
    async with two_tenants(tmp_path, Daemon(opts, clock=clock)) as t:
        info = await t.a.create_region(NBYTES, label="v1")
        await t.a.publish(ManifestIn("am", 1, 0, 2, manifest(1, info.region_id).tensors))
        assert (await t.a.version("am", 1)).state == "pending"
        clock.now += 61.0
        with pytest.raises(NotFoundError):
            await t.a.version("am", 1)
        with pytest.raises(NotFoundError):
            await t.a.manifest("am", 1)


# ---------------------------------------------------------------- class 5: memory backed for a client


async def test_a_sparse_segment_is_refused_at_attach_and_the_daemon_backs_none_of_it(
    tmp_path: Path,
) -> None:
    """a attaches a 64 MiB segment it made sparse (no byte backed): refused, 400
    naming it, no region held, and the file still has no byte backed. Before, the
    daemon mapped every page for writing and so backed all 64 MiB itself, past any
    cap of a's."""
    size = 64 << 20
    async with two_tenants(tmp_path, node_id="hostile-costs-sparse") as t:
        with SharedSegment.create(size, "sparse", reserve=False) as seg:
            with pytest.raises(ProtocolError, match="sparse") as refusal:
                await t.a.attach_region(seg.name, size, label="sparse")
            assert seg.name in str(refusal.value)
            assert [r for r in await t.a.regions() if r.label == "sparse"] == []
            assert seg.backed_bytes() == 0
            seg.numpy()[:] = 1  # backed whole by its maker: attached as before
            info = await t.a.attach_region(seg.name, size, label="backed")
            await t.a.delete_region(info.region_id)


# ---------------------------------------------------------------- class 4: memory no cap counted

ONE_MANIFEST = MANIFEST_SHARD_BYTES + MANIFEST_TENSOR_BYTES + len("w")
"""What :func:`manifest` is charged (one tensor ``w`` of one shard)."""


async def test_ready_manifests_are_charged_to_their_publisher_until_retired(
    tmp_path: Path,
) -> None:
    """a publishes a READY version into each of three models, its cap's worth: the
    fourth is refused (429 naming the setting), b is not affected, and once a retires
    one version nobody reads, it publishes again. Before, only pending manifests were
    charged: READY ones were held, uncounted, for as long as nobody republished."""
    cap = 3 * ONE_MANIFEST
    async with two_tenants(
        tmp_path, node_id="hostile-costs-ready", max_manifest_bytes_per_principal=cap
    ) as t:
        info = await t.a.create_region(NBYTES, label="w")
        for model in ("m0", "m1", "m2"):
            await t.a.publish(msgspec.structs.replace(manifest(1, info.region_id), model=model))
        registry = t.served.daemon.registry
        assert registry.manifest_bytes("a") == cap
        with pytest.raises(QuotaExceeded, match="max_manifest_bytes_per_principal"):
            await t.a.publish(msgspec.structs.replace(manifest(1, info.region_id), model="m3"))
        theirs = await t.b.create_region(NBYTES, label="w")
        await t.b.publish(msgspec.structs.replace(manifest(1, theirs.region_id), model="b0"))
        await t.a.wait_drain("m0", 1, 30.0, retire=True)
        assert registry.manifest_bytes("a") == 2 * ONE_MANIFEST
        await t.a.publish(msgspec.structs.replace(manifest(1, info.region_id), model="m3"))


async def test_the_models_one_principal_publishes_into_are_capped(tmp_path: Path) -> None:
    """Each model keeps its records in the daemon for its life: a publishes into its
    cap of models, the next new model is refused (429 naming the setting), a new
    version of one of its models is not, and b has a cap of its own. Before, a
    principal made models without bound."""
    async with two_tenants(
        tmp_path, node_id="hostile-costs-models", max_models_per_principal=4
    ) as t:
        info = await t.a.create_region(NBYTES, label="w")
        for i in range(4):
            await t.a.publish(msgspec.structs.replace(manifest(1, info.region_id), model=f"m{i}"))
        with pytest.raises(QuotaExceeded, match="max_models_per_principal"):
            await t.a.publish(msgspec.structs.replace(manifest(1, info.region_id), model="m4"))
        await t.a.publish(msgspec.structs.replace(manifest(2, info.region_id), model="m0"))
        theirs = await t.b.create_region(NBYTES, label="w")
        await t.b.publish(msgspec.structs.replace(manifest(1, theirs.region_id), model="b0"))


@pytest.mark.parametrize(("tensors", "per_tensor"), [(20_000, 1), (20, 1000)])
def test_a_manifests_charge_covers_what_the_daemon_holds_for_it(
    tensors: int, per_tensor: int
) -> None:
    """The memory a READY manifest keeps in the registry (decoded, merged, encoded for
    readers, its read scope), measured, is at most its charge and at least a quarter
    of it: the charge is what the daemon holds, not a guess far off either way."""
    ts = [
        TensorEntry(
            f"model.layers.{i}.mlp.experts.w13_weight",
            (per_tensor * 16,),
            "bfloat16",
            [ShardEntry((j * 16,), (16,), 1, (i * per_tensor + j) * 32) for j in range(per_tensor)],
        )
        for i in range(tensors)
    ]
    body = msgspec.msgpack.encode(ManifestIn("m", 1, 0, 1, ts))
    del ts
    gc.collect()
    tracemalloc.start()
    try:
        m = msgspec.msgpack.decode(body, type=ManifestIn)
        registry = Registry("n", 1)
        registry.publish(m, "a")
        registry.merged("m", 1)
        registry.merged_bytes("m", 1)
        registry.scope("m", 1)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    charged = registry.manifest_bytes("a")
    print(f"manifest of {tensors} x {per_tensor} shards: held {held} B, charged {charged} B")
    assert charged / 4 <= held <= charged


async def test_one_tenants_ended_pulls_never_push_out_anothers_results(tmp_path: Path) -> None:
    """b's pull ends; a then ends more pulls than its cap keeps: b's result is still
    there, and a keeps its newest (its oldest are forgotten, 404). Before, the last
    1,024 ended pulls daemon-wide were kept, so a's pulls pushed b's out."""
    async with two_tenants(
        tmp_path, node_id="hostile-costs-ended", max_ended_pulls_per_principal=4
    ) as t:
        info = await t.a.create_region(NBYTES, label="w")
        await t.a.publish(manifest(1, info.region_id))
        ids = {}
        for who, client in (("b", t.b), ("a", t.a)):
            dst = await client.create_region(NBYTES, label="dst")
            lease = await client.acquire_lease("am", 1, 600.0)
            rows = [(info.region_id, 0, dst.region_id, 0, NBYTES)]
            n = 1 if who == "b" else 10
            ids[who] = [(await client.pull(pull_request(lease, rows))).pull_id for _ in range(n)]
        assert (await t.b.pull_status(ids["b"][0])).state is PullState.DONE
        for old in ids["a"][:6]:
            with pytest.raises(NotFoundError):
                await t.a.pull_status(old)
        for kept in ids["a"][6:]:
            assert (await t.a.pull_status(kept)).state is PullState.DONE


async def test_an_ended_pull_keeps_its_result_not_its_plan(tmp_path: Path) -> None:
    """a submits a pull of 5,000 separate one-byte reads and cancels it mid-copy:
    every read is suspect. Its record keeps no descriptor table, and at most 1,024
    suspect ranges, which still cover every byte it may have written. Before, an
    ended pull kept its whole request and a range per read."""
    copier = GatedCopier()
    daemon = Daemon(daemon_config(node_id="hostile-costs-plan", transport="shm"), copier=copier)
    async with two_tenants(tmp_path, daemon) as t:
        n = 5000
        src = await t.a.create_region(2 * n, label="src")
        t_ = TensorEntry("w", (2 * n,), "uint8", [ShardEntry((0,), (2 * n,), src.region_id, 0)])
        await t.a.publish(ManifestIn("am", 1, 0, 1, [t_]))
        dst = await t.a.create_region(2 * n, label="dst")
        lease = await t.a.acquire_lease("am", 1, 600.0)
        rows = [(src.region_id, 2 * i, dst.region_id, 2 * i, 1) for i in range(n)]
        job = await t.a.submit_pull(pull_request(lease, rows))
        async with asyncio.timeout(SAFETY_S):
            await copier.entered.wait()
        ended = await t.a.cancel_pull(job.pull_id)
        copier.gate.set()
        assert ended.state is PullState.CANCELLED
        record = t.served.app[PULLS].jobs[job.pull_id]
        assert len(record.req.descriptors) == 0 and record.req.pack_specs == []
        suspect = (await t.a.pull_status(job.pull_id)).suspect
        assert 0 < len(suspect) <= SUSPECT_KEPT
        covered = np.zeros(2 * n, dtype=bool)
        for region, offset, nbytes in suspect:
            assert region == dst.region_id
            covered[offset : offset + nbytes] = True
        assert covered[0::2].all()


# ---------------------------------------------------------------- class 3: quadratic in a count


async def test_an_expert_pool_of_many_layers_keeps_nothing_quadratic_in_them(
    tmp_path: Path,
) -> None:
    """A pool of 12,000 layers of one one-byte expert (12 KB of regions): the daemon's
    memory while it makes the pool stays within its charge. Before, its eviction
    policy built a 12,000 x 12,000 table of float64 (1.15 GB) in a Python loop on the
    event loop."""
    layers = 12_000
    async with two_tenants(tmp_path, node_id="hostile-costs-pool") as t:
        gc.collect()
        tracemalloc.start()
        try:
            await t.a.create_pool("wide", layers=layers, experts=1, slots=1, row_bytes=[1])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        charge = POOL_KEY_BYTES * layers + POOL_SLOT_BYTES + POOL_LAYER_BYTES * layers
        print(f"pool of {layers} layers: peak {peak} B traced, charged {charge} B")
        assert peak <= 4 * charge + (4 << 20)


async def test_an_expert_pools_bookkeeping_is_charged_to_its_creator(tmp_path: Path) -> None:
    """Each pool's per-expert, per-slot and per-layer bookkeeping counts against its
    creator's cap: a's pool past it is refused (429 naming the setting) before any
    region is made, a pool within it is made, b's cap is its own, and deleting a's
    pool gives its bytes back. Before, those lists were counted by no cap."""
    geometry: dict[str, Any] = {"layers": 64, "experts": 64, "slots": 64, "row_bytes": [8]}
    keep = POOL_KEY_BYTES * 64 * 64 + POOL_SLOT_BYTES * 64 + POOL_LAYER_BYTES * 64
    async with two_tenants(
        tmp_path, node_id="hostile-costs-pools", max_pool_bookkeeping_bytes_per_principal=keep
    ) as t:
        await t.a.create_pool("a0", **geometry)
        regions = len(await t.a.regions())
        with pytest.raises(QuotaExceeded, match="max_pool_bookkeeping_bytes_per_principal"):
            await t.a.create_pool("a1", **geometry)
        assert len(await t.a.regions()) == regions
        await t.b.create_pool("b0", **geometry)
        await t.a.delete_pool("a0")
        await t.a.create_pool("a1", **geometry)


async def test_the_plans_of_a_principals_running_pulls_are_charged_until_they_end(
    tmp_path: Path,
) -> None:
    """a's pull of 1,000 descriptors is held mid-copy: its plan is charged (256 bytes
    a run) against a cap of 1,500 runs' worth, so a's next pull of 1,000 is refused
    (429 naming the setting) before anything is read, b's is not, and once a's first
    pull ends, a pulls again. Before, running pulls' plans were counted by no cap,
    only by their number."""
    copier = GatedCopier()
    cap = PLAN_RUN_BYTES * 1500
    opts = daemon_config(
        node_id="hostile-costs-plans", transport="shm", max_plan_bytes_per_principal=cap
    )
    async with two_tenants(tmp_path, Daemon(opts, copier=copier)) as t:
        src = await t.a.create_region(4096, label="src")
        shard = ShardEntry((0,), (4096,), src.region_id, 0)
        await t.a.publish(ManifestIn("am", 1, 0, 1, [TensorEntry("w", (4096,), "uint8", [shard])]))
        rows = {}
        for who, client in (("a", t.a), ("b", t.b)):
            dst = await client.create_region(4096, label="dst")
            lease = await client.acquire_lease("am", 1, 600.0)
            rows[who] = pull_request(
                lease, [(src.region_id, 2 * i, dst.region_id, 2 * i, 1) for i in range(1000)]
            )
        first = await t.a.submit_pull(rows["a"])
        async with asyncio.timeout(SAFETY_S):
            await copier.entered.wait()
        with pytest.raises(QuotaExceeded, match="max_plan_bytes_per_principal"):
            await t.a.submit_pull(rows["a"])
        theirs = await t.b.submit_pull(rows["b"])
        copier.gate.set()
        async with asyncio.timeout(SAFETY_S):
            assert (await t.a.wait_pull(first.pull_id)).state is PullState.DONE
            assert (await t.b.wait_pull(theirs.pull_id)).state is PullState.DONE
        assert (await t.a.pull(rows["a"])).state is PullState.DONE
