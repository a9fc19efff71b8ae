"""Delta refit (issue 37) attacked by a hostile tenant (issue 36).

Tenant ``a`` owns model ``am`` and publishes it double-buffered (v1 in one region,
v2 in another), so the daemon holds a delta of v2 against v1. Tenant ``b`` holds a
lease on v2, as any reader may, and asks ``POST /v1/deltas/pack`` for what no
receiver should get: a delta whose changes the daemon dropped, reads outside the
version, a stream that would make the daemon hold unbounded memory, more staging
regions than its cap allows. Each refusal is a 4xx ``{error, detail}`` naming what was
refused, and nothing is staged; each test is one rule, named as that rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import Served, daemon_config, served, token_file

from refitd.client.http import RefitClient
from refitd.config import LimitsConfig, ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.wire import (
    DeltaPackRequest,
    DeltaStreamRequest,
    DescriptorTable,
    ManifestIn,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

ELEMS = 2048
"""bfloat16 elements of ``am``'s one tensor (4 KiB)."""
NBYTES = 2 * ELEMS
REGION = 2 * NBYTES
"""Each version's region: twice the tensor, so half of it is outside the version."""
CHANGED = 64
"""Elements of v2 that differ from v1."""
TOKENS = {"a": "token-of-a", "b": "token-of-b"}


@dataclass
class Tenants:
    daemon: Daemon
    url: str
    a: RefitClient
    b: RefitClient
    regions: list[int]  # the region of v1, then of v2
    segs: list[SharedSegment]


def manifest(version: int, region: int) -> ManifestIn:
    shard = ShardEntry((0,), (ELEMS,), region, 0)
    return ManifestIn("am", version, 0, 1, [TensorEntry("w", (ELEMS,), "bfloat16", [shard])])


@contextlib.asynccontextmanager
async def tenants(
    tmp: Path, node_id: str, **options: Any
) -> AsyncIterator[tuple[Served, RefitClient, RefitClient]]:
    """A daemon that requires a token (``TOKENS``: tenants a and b), served for the
    block: it, and a client of a and one of b."""
    tokens = token_file(tmp, TOKENS)
    d = Daemon(daemon_config(node_id=node_id, **options))
    async with (
        served(d, access=ServerConfig(port=0, token_file=tokens)) as s,
        RefitClient(s.url, token=TOKENS["a"]) as a,
        RefitClient(s.url, token=TOKENS["b"]) as b,
    ):
        yield s, a, b


async def refused_alike_to_b(url: str, paths: list[str]) -> None:
    """b's GET of each of ``paths`` is the same 403 in the error shape, naming ``am``:
    the answers tell b nothing of which versions exist."""
    headers = {"Authorization": f"Bearer {TOKENS['b']}", "Accept": "application/json"}
    answers = []
    async with aiohttp.ClientSession() as http:
        for path in paths:
            async with http.get(url + path, headers=headers) as r:
                answers.append((r.status, await r.json(content_type=None)))
    for status, res in answers:
        refused(status, res, 403, "'am'")
    assert answers[0] == answers[1], answers


@contextlib.asynccontextmanager
async def two_versions(tmp: Path, **options: Any) -> AsyncIterator[Tenants]:
    """``a`` publishes v1 and v2 of ``am`` in two regions; v2's delta is ready."""
    async with tenants(tmp, "hostile-deltas", deltas=True, **options) as (s, a, b):
        d = s.daemon
        v1 = np.random.default_rng(1).integers(0, 1 << 16, ELEMS, dtype=np.uint16)
        v2 = v1.copy()
        v2[np.random.default_rng(2).choice(ELEMS, CHANGED, replace=False)] += 1
        regions, segs = [], []
        for version, words in ((1, v1), (2, v2)):
            info = await a.create_region(REGION, label=f"v{version}")
            seg = SharedSegment.attach(info.handle, REGION)
            seg.numpy(np.uint16)[:ELEMS] = words
            regions.append(info.region_id)
            segs.append(seg)
            await a.publish(manifest(version, info.region_id))
        try:
            rec = await a.delta_info("am", 2, wait_s=60.0)
            assert (rec.state, rec.base_version, rec.changed) == ("ready", 1, CHANGED), rec
            yield Tenants(d, s.url, a, b, regions, segs)
        finally:
            for seg in segs:
                seg.close()


def table(*rows: tuple[int, int, int, int, int]) -> DescriptorTable:
    return DescriptorTable(np.array(rows, dtype="<i8").reshape(-1, 5).tobytes())


async def pack_raw(
    t: Tenants, token: str, req: DeltaPackRequest, route: str = "pack"
) -> tuple[int, Any]:
    """``POST /v1/deltas/{route}`` as ``token`` (``stream``: the same request,
    streamed): the status and the decoded answer."""
    import msgspec

    if route == "stream":
        req = DeltaStreamRequest(**msgspec.structs.asdict(req))
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/msgpack"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{t.url}/v1/deltas/{route}", data=msgspec.msgpack.encode(req), headers=headers
        ) as r,
    ):
        if route == "stream" and r.status == 200:  # frames, not JSON: read to the end
            return r.status, await r.read()
        return r.status, await r.json(content_type=None)


#: a delta is selected under the same checks whether it is staged or streamed
ROUTES = pytest.mark.parametrize("route", ["pack", "stream"])


def refused(status: int, res: Any, status_is: int, *named: str) -> None:
    """A 4xx in the error shape whose detail names each of ``named``."""
    assert status == status_is, (status, res)
    assert isinstance(res, dict) and set(res) == {"error", "detail"}, res
    for word in named:
        assert word in res["detail"], (word, res)


def staged_for(t: Tenants, lease_id: str) -> dict[int, Any]:
    return t.daemon.staging.packed_for(lease_id)


async def b_lease_and_request(t: Tenants, **kw: Any) -> tuple[str, DeltaPackRequest]:
    lease = await t.b.acquire_lease("am", 2, ttl_s=600)
    rec = await t.b.delta_info("am", 2)
    req = DeltaPackRequest(
        "am",
        2,
        lease.lease_id,
        1,
        rec.base_digest,
        kw.pop("descriptors", table((t.regions[1], 0, 0, 0, NBYTES))),
        **kw,
    )
    return lease.lease_id, req


async def test_the_whole_delta_of_a_version_is_staged_for_a_readers_lease(
    tmp_path: Path,
) -> None:
    """The baseline every refusal below is measured against: b's plan reads v2 whole,
    and every changed unit is staged."""
    async with two_versions(tmp_path) as t:
        lease, req = await b_lease_and_request(t)
        staged = await t.b.delta_pack(req)
        assert (staged.changed, staged.base_version) == (CHANGED, 1)
        assert list(staged_for(t, lease)) == [staged.region.region_id]


@ROUTES
async def test_a_delta_whose_changes_were_dropped_at_retirement_is_refused_not_staged_empty(
    tmp_path: Path, route: str
) -> None:
    """A newer version retires v2 and the daemon drops v2's changed units; a lease on
    v2 taken before still lives. Staging "no changes" for it would tell the engine that
    its v1 bytes are v2's: the engine would serve v1 as v2. It is refused (409)."""
    async with two_versions(tmp_path) as t:
        lease, req = await b_lease_and_request(t)
        # a rewrites v1's buffer as v3 (v1 is retired and unleased) and publishes it
        await t.a.wait_drain("am", 1, 30.0, retire=True)
        t.segs[0].numpy(np.uint16)[:ELEMS] += 3
        await t.a.publish(manifest(3, t.regions[0]))
        assert (await t.a.version("am", 2)).state == "retired"
        status, res = await pack_raw(t, TOKENS["b"], req, route)
        refused(status, res, 409, "v2", "retired")
        assert staged_for(t, lease) == {}
        info = await t.b.delta_info("am", 2)
        assert info.state == "none" and "retired" in info.reason, info


@ROUTES
async def test_a_delta_pack_reads_only_the_bytes_of_its_leases_version(
    tmp_path: Path, route: str
) -> None:
    """A read past the version's shards (in one of its regions) or past any region's
    end is refused, 403, before anything is selected or staged: a delta is served
    under the lease's scope, as every read is."""
    async with two_versions(tmp_path) as t:
        r2 = t.regions[1]
        for row in (
            (r2, NBYTES, 0, 0, NBYTES),  # the half of v2's region no version publishes
            (r2, 0, 0, 0, 1 << 62),  # far past the region's end
            (r2, -2, 0, 0, 2),  # before its start
        ):
            lease, req = await b_lease_and_request(t, descriptors=table(row))
            status, res = await pack_raw(t, TOKENS["b"], req, route)
            refused(status, res, 403, "descriptor 0", f"region {r2}")
            assert staged_for(t, lease) == {}


@ROUTES
async def test_a_delta_packs_stream_is_bounded_by_the_version_it_reads(
    tmp_path: Path, route: str
) -> None:
    """A plan that reads the same changed bytes over and over would make the daemon
    select and stage each change again per read: memory without bound for one
    request. A stream longer than a few times the version's bytes is refused, 413."""
    async with two_versions(tmp_path) as t:
        r2 = t.regions[1]
        rows = [(r2, 0, 0, 0, NBYTES)] * 20_000
        lease, req = await b_lease_and_request(t, descriptors=table(*rows))
        status, res = await pack_raw(t, TOKENS["b"], req, route)
        refused(status, res, 413, "stream", f"{20_000 * NBYTES} bytes")
        assert staged_for(t, lease) == {}


async def test_concurrent_delta_packs_stage_no_more_regions_than_the_principals_cap(
    tmp_path: Path,
) -> None:
    """Each delta pack admits one staging region against the lease principal's cap;
    sixteen at once must not all pass the check before any is counted."""
    limits = LimitsConfig(max_regions_per_principal=4)
    async with two_versions(tmp_path, limits=limits) as t:
        lease, req = await b_lease_and_request(t)
        answers = await asyncio.gather(*(pack_raw(t, TOKENS["b"], req) for _ in range(16)))
        ok = [res for status, res in answers if status == 201]
        for status, res in answers:
            if status != 201:
                refused(status, res, 429, "max_regions_per_principal")
        assert 1 <= len(ok) <= 4, [s for s, _ in answers]
        assert len(staged_for(t, lease)) == len(ok)


# ---------------------------------------------------------------- long polls (issue 38)


async def test_one_principal_holds_a_bounded_number_of_long_polls_and_others_still_wait(
    tmp_path: Path,
) -> None:
    """b opens many ``/ready`` long polls on a's pending version (each a connection and a
    task of the daemon): past the cap they are refused (429, naming it), before they
    hold anything; a's own long poll is still accepted and answered when its version is
    READY, and so are b's held ones."""
    from refitd.daemon.app.waits import MAX_WAITS_PER_PRINCIPAL

    async with (
        tenants(tmp_path, "hostile-waits") as (s, a, _),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):
        region = (await a.create_region(REGION, label="am")).region_id
        shard = ShardEntry((0,), (ELEMS,), region, 0)
        part = [TensorEntry("w", (ELEMS,), "bfloat16", [shard])]
        await a.publish(ManifestIn("am", 1, 0, 2, part))  # one part of two: pending
        url = s.url + "/v1/sources/am/versions/1/ready?timeout=60"

        async def wait(token: str) -> tuple[int, Any]:
            headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
            async with http.get(url, headers=headers) as r:
                return r.status, await r.json(content_type=None)

        extra = 8
        polls = [asyncio.ensure_future(wait(TOKENS["b"])) for _ in range(MAX_WAITS_PER_PRINCIPAL)]
        polls += [asyncio.ensure_future(wait(TOKENS["b"])) for _ in range(extra)]
        refusals = []
        for done in asyncio.as_completed(polls):  # the held ones answer only once READY
            refusals.append(await done)
            if len(refusals) == extra:
                break
        for status, res in refusals:
            refused(status, res, 429, "'b'", "long polls", str(MAX_WAITS_PER_PRINCIPAL))
        mine = asyncio.ensure_future(wait(TOKENS["a"]))
        await a.publish(ManifestIn("am", 1, 1, 2, part))  # the last part: READY
        status, res = await mine
        assert (status, res["state"]) == (200, "ready"), res
        answers = [p.result() if p.done() else await p for p in polls]
        ready = [res for status, res in answers if status == 200]
        assert len(ready) == MAX_WAITS_PER_PRINCIPAL
        assert all(res["state"] == "ready" for res in ready)


async def test_a_ready_long_poll_on_a_model_one_may_not_read_is_refused_alike_whether_or_not_it_exists(
    tmp_path: Path,
) -> None:
    """``[models] readers`` lists only a for ``am``: b's ``/ready`` and ``/delta`` on
    ``am`` are 403 before any wait, and say the same for a version that exists and one
    that does not, so they tell b nothing of a's versions."""
    async with tenants(tmp_path, "hostile-readers", readers=("am=a",)) as (s, a, _):
        region = (await a.create_region(REGION, label="am")).region_id
        await a.publish(manifest(1, region))
        for tail in ("ready?timeout=60", "delta?wait=60"):
            paths = [f"/v1/sources/am/versions/{version}/{tail}" for version in (1, 7)]
            await refused_alike_to_b(s.url, paths)


async def test_concurrent_peer_packs_stage_no_more_regions_than_the_principals_cap(
    tmp_path: Path,
) -> None:
    """The same rule for ``POST /v1/peer/pack`` (a strided block packed into staging
    for a lease): sixteen at once, under b's lease, hold at most b's cap."""
    from refitd.wire import PackRequest, PackSpec

    limits = LimitsConfig(max_regions_per_principal=4)
    async with two_versions(tmp_path, limits=limits) as t:
        lease = (await t.b.acquire_lease("am", 2, ttl_s=600)).lease_id
        spec = PackSpec(t.regions[1], 0, (ELEMS // 2,), (2,), 2, 0, 0)
        req = PackRequest("am", 2, lease, [spec])
        headers = {"Authorization": f"Bearer {TOKENS['b']}", "Content-Type": "application/json"}

        async def pack(http: aiohttp.ClientSession) -> tuple[int, Any]:
            import msgspec

            url = t.url + "/v1/peer/pack"
            async with http.post(url, data=msgspec.json.encode(req), headers=headers) as r:
                return r.status, await r.json(content_type=None)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            answers = await asyncio.gather(*(pack(http) for _ in range(16)))
        ok = [res for status, res in answers if status == 201]
        for status, res in answers:
            if status != 201:
                refused(status, res, 429, "max_regions_per_principal")
        assert 1 <= len(ok) <= 4, [s for s, _ in answers]
        assert len(staged_for(t, lease)) == len(ok)


@contextlib.asynccontextmanager
async def computing(tmp: Path) -> AsyncIterator[tuple[Tenants, threading.Event]]:
    """v1 and v2 of ``am`` published, v2's comparison held from running: every thread
    of the daemon's comparison pool (a real one) is kept busy until the test sets the
    event it yields. b then leases v2 and asks for its delta as a receiver would."""
    from refitd.daemon.delta.routes import DELTAS

    gate = threading.Event()
    async with tenants(tmp, "hostile-computing", deltas=True) as (s, a, b):
        d = s.daemon
        book = s.app[DELTAS]
        regions, segs = [], []
        try:
            for version in (1, 2):
                info = await a.create_region(REGION, label=f"v{version}")
                segs.append(SharedSegment.attach(info.handle, REGION))
                segs[-1].numpy(np.uint16)[:ELEMS] = version
                regions.append(info.region_id)
                if version == 2:  # v1's digest is taken; v2's comparison waits
                    assert (await a.delta_info("am", 1, wait_s=60.0)).state == "none"
                    for _ in range(book.threads):
                        book._pool.submit(gate.wait, 60.0)
                await a.publish(manifest(version, info.region_id))
            assert (await b.delta_info("am", 2)).state == "computing"
            yield Tenants(d, s.url, a, b, regions, segs), gate
        finally:
            gate.set()
            for seg in segs:
                seg.close()


async def test_delta_packs_waiting_for_a_comparison_count_as_long_polls(tmp_path: Path) -> None:
    """A delta pack asked while its version is still compared waits for the comparison:
    a long poll like ``/ready``. b's past the cap are refused (429) before they wait;
    those that waited are answered once the comparison ends."""
    from refitd.daemon.app.waits import MAX_WAITS_PER_PRINCIPAL

    async with computing(tmp_path) as (t, gate):
        lease = (await t.b.acquire_lease("am", 2, ttl_s=600)).lease_id
        extra = 4
        # the base digest is unknown until the comparison ends: any will do here
        req = DeltaPackRequest("am", 2, lease, 1, "", table((t.regions[1], 0, 0, 0, NBYTES)))
        packs = [
            asyncio.ensure_future(pack_raw(t, TOKENS["b"], req))
            for _ in range(MAX_WAITS_PER_PRINCIPAL + extra)
        ]
        refusals = []
        for done in asyncio.as_completed(packs):
            refusals.append(await done)
            if len(refusals) == extra:
                break
        for status, res in refusals:
            refused(status, res, 429, "'b'", "long polls")
        gate.set()  # the comparison runs and ends
        answers = [p.result() if p.done() else await p for p in packs]
        waited = [(s, r) for s, r in answers if s != 429]
        assert len(waited) == MAX_WAITS_PER_PRINCIPAL
        for status, res in waited:  # the base it stated is not v2's: refused after waiting
            refused(status, res, 409, "digest")


async def test_a_delta_stream_counts_as_one_of_its_principals_long_polls(tmp_path: Path) -> None:
    """A streamed delta stays open as long as its reader reads, holding its selection
    and two encoded chunks: b, already holding its one allowed long poll (a ``/ready``
    on a pending version), has its stream refused (429, naming the cap) before any
    selection; once the poll is answered the cap no longer refuses it."""
    limits = LimitsConfig(max_long_polls_per_principal=1)
    async with two_versions(tmp_path, limits=limits) as t:
        _, req = await b_lease_and_request(t)
        region = (await t.a.create_region(REGION, label="v3")).region_id
        pending = msgspec.structs.replace(manifest(3, region), expected_parts=2)
        await t.a.publish(pending)  # one part of two: pending
        url = f"{t.url}/v1/sources/am/versions/3/ready?timeout=60"
        headers = {"Authorization": f"Bearer {TOKENS['b']}", "Accept": "application/json"}
        async with aiohttp.ClientSession() as http:

            async def ready() -> int:
                async with http.get(url, headers=headers) as r:
                    return r.status

            poll = asyncio.ensure_future(ready())
            for _ in range(1200):  # until the daemon counts b's poll (a safety net: 60 s)
                if poll.done():  # it came while a stream held b's one place: again
                    assert poll.result() == 429, poll.result()
                    poll = asyncio.ensure_future(ready())
                await asyncio.sleep(0.05)
                status, res = await pack_raw(t, TOKENS["b"], req, "stream")
                if status == 429:
                    break
            assert not poll.done(), poll.result()
            refused(status, res, 429, "'b'", "long polls", "max_long_polls_per_principal")
            await t.a.publish(msgspec.structs.replace(pending, part=1))
            assert await poll == 200
        # The place is given back (v3 READY now answers the stream on its own terms).
        status, _ = await pack_raw(t, TOKENS["b"], req, "stream")
        assert status != 429


async def test_a_delta_pack_whose_lease_ended_while_it_waited_stages_nothing(
    tmp_path: Path,
) -> None:
    """b's packs wait for v2's comparison; b releases its lease meanwhile. Once the
    comparison ends, none is staged for the lease that ended (409, naming it): a
    staging region held for no live lease would be memory nobody may read."""
    from refitd.daemon.app.waits import MAX_WAITS_PER_PRINCIPAL

    async with computing(tmp_path) as (t, gate):
        lease = (await t.b.acquire_lease("am", 2, ttl_s=600)).lease_id
        base = (await t.b.delta_info("am", 1)).digest  # v2's base is v1 as published
        req = DeltaPackRequest("am", 2, lease, 1, base, table((t.regions[1], 0, 0, 0, NBYTES)))
        packs = [
            asyncio.ensure_future(pack_raw(t, TOKENS["b"], req))
            for _ in range(MAX_WAITS_PER_PRINCIPAL + 1)
        ]
        status, res = await next(asyncio.as_completed(packs))  # every other one waits now
        refused(status, res, 429, "long polls")
        await t.b.release_lease(lease)
        gate.set()
        answers = [p.result() if p.done() else await p for p in packs]
        for status, res in answers:
            if status != 429:
                refused(status, res, 409, lease)
        assert staged_for(t, lease) == {}
        assert [r for r in await t.b.regions() if r.label == "staging"] == []


# ---------------------------------------------------------------- the daemon's memory


async def test_deltas_hold_no_more_memory_than_the_daemon_keeps_for_them(tmp_path: Path) -> None:
    """A delta record is daemon memory, (8 + 2 x unit) bytes a change, that no region
    cap counts: a tenant publishing large versions that change everywhere (in its own
    attached memory, which no byte cap counts either) would grow the daemon without
    bound. Past ``[pulls] delta_max_bytes`` a version's changes are not kept: its
    record says why, nothing is held, and its delta is refused (409), so its engines
    refit in full. a's ``am`` fits the budget; b's ``bm``, compared next, does not."""
    per_change = 8 + 2 * 2
    budget = CHANGED * per_change + CHANGED * per_change // 2  # one delta and a half
    async with two_versions(tmp_path, delta_max_bytes=budget) as t:
        assert (await t.a.delta_info("am", 2)).delta_bytes == CHANGED * per_change
        for version, fill in ((1, 1), (2, 2)):
            info = await t.b.create_region(REGION, label=f"bm-v{version}")
            with SharedSegment.attach(info.handle, REGION) as seg:
                seg.numpy(np.uint16)[:ELEMS] = fill  # every unit of v2 differs from v1
            shard = ShardEntry((0,), (ELEMS,), info.region_id, 0)
            tensor = TensorEntry("w", (ELEMS,), "bfloat16", [shard])
            await t.b.publish(ManifestIn("bm", version, 0, 1, [tensor]))
        rec = await t.b.delta_info("bm", 2, wait_s=60.0)
        assert rec.state == "none" and "delta_max_bytes" in rec.reason, rec
        assert rec.delta_bytes == 0 and rec.digest, rec
        lease = await t.b.acquire_lease("bm", 2, ttl_s=600)
        req = DeltaPackRequest(
            "bm", 2, lease.lease_id, 1, rec.base_digest, table((info.region_id, 0, 0, 0, NBYTES))
        )
        status, res = await pack_raw(t, TOKENS["b"], req)
        refused(status, res, 409, "delta_max_bytes")
        assert staged_for(t, lease.lease_id) == {}
        assert (await t.a.delta_info("am", 2)).state == "ready"  # a's delta is untouched


async def test_a_lease_stages_only_its_own_versions_delta(tmp_path: Path) -> None:
    """b's lease on v2 of ``am`` asks for another version, another model, and a base it
    does not hold: each a 409 naming what was refused, nothing staged."""
    async with two_versions(tmp_path) as t:
        lease, req = await b_lease_and_request(t)
        base = req.base_digest
        for other, named in (
            (msgspec.structs.replace(req, version=1), lease),  # a version it did not lease
            (msgspec.structs.replace(req, model="bm"), lease),  # a model it did not lease
            # v2's own digest stated as its base, and v1's digest under another number
            (
                msgspec.structs.replace(req, base_digest=(await t.b.delta_info("am", 2)).digest),
                "v1",
            ),
            (msgspec.structs.replace(req, base_version=0, base_digest=base), "v1"),
        ):
            status, res = await pack_raw(t, TOKENS["b"], other)
            refused(status, res, 409, named)
        assert staged_for(t, lease) == {}


async def test_malformed_delta_packs_are_4xx_in_the_error_shape_and_stage_nothing(
    tmp_path: Path,
) -> None:
    from refitd.wire import PackSpec

    async with two_versions(tmp_path) as t:
        r2 = t.regions[1]
        lease, req = await b_lease_and_request(t)
        bad: list[Any] = [
            msgspec.structs.replace(req, descriptors=DescriptorTable(b"\\0" * 39)),
            msgspec.structs.replace(req, descriptors=table((r2, 1, 0, 0, 2))),  # mid-unit
            msgspec.structs.replace(req, pack_specs=[PackSpec(r2, 0, (-4,), (1,), 2, 0, 0)]),
            msgspec.structs.replace(req, pack_specs=[PackSpec(r2, 8, (4,), (-8,), 2, 0, 0)]),
            msgspec.structs.replace(
                req, pack_specs=[PackSpec(r2, 0, (1 << 31, 1 << 31), (0, 0), 2, 0, 0)]
            ),
            msgspec.structs.replace(req, pack_specs=[PackSpec(r2, 1, (8,), (2,), 1, 0, 0)]),
        ]
        for body in bad:
            status, res = await pack_raw(t, TOKENS["b"], body)
            assert 400 <= status < 500, (body, status, res)
            assert set(res) == {"error", "detail"} and res["detail"], res
        assert staged_for(t, lease) == {}


async def test_the_cluster_routes_tell_a_non_reader_nothing_of_a_models_versions(
    tmp_path: Path,
) -> None:
    """``[models] readers`` lists only a for ``am``: which daemons hold a version of it,
    and the long poll for its next one, are refused to b (403) before any wait, alike
    whether the version exists or not."""
    async with tenants(tmp_path, "hostile-cluster", readers=("am=a",)) as (s, a, _):
        region = (await a.create_region(REGION, label="am")).region_id
        await a.publish(manifest(1, region))
        assert (await a.cluster_version("am", 1)).version == 1  # a, a reader, sees it
        for paths in (
            ["/v1/cluster/sources/am/versions/1", "/v1/cluster/sources/am/versions/7"],
            [
                "/v1/cluster/sources/am/next?after=0&timeout=60",
                "/v1/cluster/sources/am/next?after=5&timeout=60",
            ],
        ):
            await refused_alike_to_b(s.url, paths)
