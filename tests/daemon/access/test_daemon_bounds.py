"""Bounded work and loose edges: what one request may cost the daemon, and the
refusals at its edges (issue 20, class 4)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import pytest
from aiohttp import web
from support.daemons import FakeClock, GatedCopier, daemon_config, serving_app, serving_daemons
from support.hostile import Env, rows, toy_manifest

from refitd.client.http import RefitClient
from refitd.config import LimitsConfig
from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.state.registry import Registry
from refitd.errors import AccessDenied, NotFoundError, ProtocolError, QuotaExceeded
from refitd.wire import (
    MAX_RANK,
    MAX_TENSOR_SHARDS,
    MSGPACK,
    DescriptorTable,
    ManifestIn,
    PackSpec,
    PullRequest,
    PullState,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(120)


def _symlink(p: Path) -> None:
    p.symlink_to("/etc/hostname")


def _directory(p: Path) -> None:
    p.mkdir()


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def _fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


@pytest.mark.parametrize("make", [_symlink, _directory, _socket, _fifo])
async def test_attaching_a_name_that_is_not_a_regular_file_is_a_400_in_the_error_shape(
    env: Env, make: Callable[[Path], None]
) -> None:
    name = f"refitd-test-{make.__name__[1:]}-{os.getpid()}"
    path = SHM_DIR / name
    make(path)
    try:
        detail = await env.refused(
            "POST", "/v1/regions/attach", {"handle": name, "nbytes": 64}, status=400
        )
        assert "not a regular file" in detail, detail
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


async def test_the_peer_client_never_follows_a_redirect_and_names_the_peer() -> None:
    """A peer (here a fake: a real daemon never redirects) answers 307 to a host no
    one listed; the client refuses, naming the peer, and the other host sees nothing."""
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path_qs} {request.headers.get('Authorization')}")
        return web.Response(status=200)

    async with _serve(web.route("*", "/{tail:.*}", record)) as unlisted:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(unlisted + request.path_qs)

        async with (
            _serve(web.route("*", "/{tail:.*}", redirect)) as peer,
            RefitClient(peer, token="secret-token") as c,
        ):
            with pytest.raises(ProtocolError, match=rf"daemon at {peer} answered a redirect"):
                await c.peer_regions(lease_id="lease-1", model="m", version=3)
    assert seen == []


@contextlib.asynccontextmanager
async def _serve(route: web.RouteDef) -> AsyncIterator[str]:
    app = web.Application()
    app.add_routes([route])
    async with serving_app(app) as url:
        yield url


# ---------------------------------------------------------------- leases: O(1) amortised


class _Now(float):
    """A clock reading that counts how often the registry compares a time with it:
    the work an acquire does over the leases it holds."""

    compared = 0

    def _count(self, other: object, op: Callable[[float, float], bool]) -> bool:
        _Now.compared += 1
        return op(float(self), float(other))  # type: ignore[arg-type]

    def __ge__(self, other: object) -> bool:
        return self._count(other, float.__ge__)

    def __gt__(self, other: object) -> bool:
        return self._count(other, float.__gt__)

    def __le__(self, other: object) -> bool:
        return self._count(other, float.__le__)

    def __lt__(self, other: object) -> bool:
        return self._count(other, float.__lt__)


def _toy_registry(clock: Callable[[], float]) -> Registry:
    reg = Registry("n", 1, clock)
    reg.publish(toy_manifest(1))
    return reg


def test_acquiring_a_lease_does_not_scan_every_lease_held() -> None:
    now = [1000.0]
    reg = _toy_registry(lambda: _Now(now[0]))
    n = 3000
    _Now.compared = 0
    for _ in range(n):
        reg.acquire("toy", 1, ttl_s=600)
    # A scan of every lease compares each with the clock: n * n / 2 in all.
    assert _Now.compared <= 4 * n, _Now.compared


def test_a_renewed_lease_outlives_its_first_expiry_and_an_expired_one_is_dropped() -> None:
    clock = FakeClock()
    reg = _toy_registry(clock)
    renewed = reg.acquire("toy", 1, ttl_s=10).lease_id
    lapsed = reg.acquire("toy", 1, ttl_s=10).lease_id
    clock.now += 5
    reg.renew(renewed, ttl_s=100)
    clock.now += 10
    reg.acquire("toy", 1, ttl_s=10)
    assert reg.is_live(renewed)
    assert not reg.is_live(lapsed)
    with pytest.raises(NotFoundError):
        reg.release(lapsed)  # dropped by the sweep, not kept forever


# ---------------------------------------------------------------- pending versions expire


def test_a_version_pending_past_its_ttl_is_forgotten_and_frees_its_regions() -> None:
    clock = FakeClock()
    reg = Registry("n", 1, clock, pending_ttl_s=60)
    reg.publish(toy_manifest(7, version=1, part=0, parts=2))
    assert 7 in reg.protected_regions()
    clock.now += 61
    reg.publish(toy_manifest(8, version=2))  # any publish sweeps
    with pytest.raises(NotFoundError):
        reg.version("toy", 1)
    assert 7 not in reg.protected_regions()
    # The missing part arrives too late: it starts a new pending version, not READY.
    assert reg.publish(toy_manifest(7, version=3, part=1, parts=2)).state.value == "pending"


def test_a_pending_version_within_its_ttl_stays() -> None:
    clock = FakeClock()
    reg = Registry("n", 1, clock, pending_ttl_s=60)
    reg.publish(toy_manifest(7, version=1, part=0, parts=2))
    clock.now += 59
    assert reg.publish(toy_manifest(7, version=1, part=1, parts=2)).state.value == "ready"


# ---------------------------------------------------------------- per-principal caps


@contextlib.asynccontextmanager
async def _capped(**limits: int) -> AsyncIterator[tuple[Daemon, RefitClient, GatedCopier]]:
    gate = GatedCopier()
    gate.gate.set()
    opts = daemon_config(
        node_id="capped", transport="shm", shutdown_grace_s=0.5, limits=LimitsConfig(**limits)
    )
    d = Daemon(opts, copier=gate)
    async with serving_daemons(d) as (c,):
        yield d, c, gate


def _filling(d: Daemon, region: RegionInfo, complete: int) -> None:
    """Make ``region`` (all of ``toy`` version 1) a host mirror's of ``d`` still filling,
    its first ``complete`` bytes complete: as a mirror of that version stands midway, in
    the daemon's table of mirrors still filling, which the mirrors alone change."""
    m = Mirror("http://source", "toy", 1, regions={region.region_id: region})
    rid, rest = region.region_id, region.nbytes - complete
    m.chunks = np.array([[rid, 0, complete], [rid, complete, rest]], dtype=np.int64)
    m.done = np.array([True, False])
    d.filling.add(m)


async def test_regions_past_the_principals_cap_are_refused_with_429_naming_the_cap() -> None:
    async with _capped(max_regions_per_principal=3) as (_d, c, _g):
        made = [await c.create_region(64) for _ in range(3)]
        with pytest.raises(QuotaExceeded, match=r"limits\.max_regions_per_principal = 3"):
            await c.create_region(64)
        with SharedSegment.create(64, "cap") as seg:
            with pytest.raises(QuotaExceeded, match="region refused"):
                await c.attach_region(seg.name, 64)
            await c.delete_region(made[0].region_id)
            await c.attach_region(seg.name, 64)  # room again once one is gone


async def test_leases_past_the_principals_cap_are_refused_until_one_is_released() -> None:
    async with _capped(max_leases_per_principal=2) as (_d, c, _g):
        src = await c.create_region(128)
        await c.publish(toy_manifest(src.region_id))
        first = await c.acquire_lease("toy", 1)
        await c.acquire_lease("toy", 1)
        with pytest.raises(QuotaExceeded, match=r"limits\.max_leases_per_principal = 2"):
            await c.acquire_lease("toy", 1)
        await c.release_lease(first.lease_id)
        await c.acquire_lease("toy", 1)


async def test_pulls_past_the_principals_cap_are_refused_while_the_others_run() -> None:
    async with _capped(max_pulls_per_principal=1) as (_d, c, gate):
        src = await c.create_region(128)
        dst = await c.create_region(128)
        await c.publish(toy_manifest(src.region_id))
        lease = await c.acquire_lease("toy", 1)
        req = PullRequest(
            "toy",
            1,
            lease.lease_id,
            DescriptorTable(rows([src.region_id, 0, dst.region_id, 0, 128])),
        )
        gate.gate.clear()
        held = await c.submit_pull(req)
        await gate.entered.wait()
        with pytest.raises(QuotaExceeded, match=r"limits\.max_pulls_per_principal = 1"):
            await c.submit_pull(req)
        gate.gate.set()
        await c.wait_pull(held.pull_id)
        assert (await c.pull(req)).bytes_done == 128  # the first ended: room again


# ---------------------------------------------------------------- manifests


def _wide_manifest(region: int, tensors: int, shards: int, last_region: int) -> bytes:
    """``tensors`` tensors of ``shards`` one-element uint8 shards each in ``region``;
    the very last shard names ``last_region`` (an unknown one: found only by checking
    every shard)."""
    out = []
    for k in range(tensors):
        entries = [[[i], [1], region, i] for i in range(shards)]
        if k == tensors - 1:
            entries[-1][2] = last_region
        out.append([f"t{k}", [shards], "uint8", entries])
    return msgspec.msgpack.encode(
        {"model": "wide", "version": 1, "part": 0, "expected_parts": 1, "tensors": out}
    )


async def _publish_raw(http: aiohttp.ClientSession, url: str, raw: bytes) -> int:
    """POST the msgpack manifest ``raw`` to the daemon at ``url``: its status."""
    async with http.post(url + "/v1/sources", data=raw, headers={"Content-Type": MSGPACK}) as r:
        return r.status


async def test_a_tensor_of_rank_past_the_wire_limit_is_refused_with_400(env: Env) -> None:
    rank = MAX_RANK + 1
    m = {
        "model": "deep",
        "version": 1,
        "part": 0,
        "expected_parts": 1,
        "tensors": [["t", [1] * rank, "uint8", [[[0] * rank, [1] * rank, env.src, 0]]]],
    }
    detail = await env.refused("POST", "/v1/sources", m, status=400)
    assert f"length <= {MAX_RANK}" in detail, detail


async def test_a_tensor_listing_more_shards_than_the_wire_limit_is_refused_with_400(
    env: Env,
) -> None:
    raw = _wide_manifest(env.src, 1, MAX_TENSOR_SHARDS + 1, env.src)
    detail = await env.refused("POST", "/v1/sources", raw=raw, status=400)
    assert f"length <= {MAX_TENSOR_SHARDS}" in detail, detail


async def test_a_manifest_past_max_manifest_shards_is_refused_naming_the_cap() -> None:
    async with _capped(max_manifest_shards=10) as (_d, c, _g):
        src = await c.create_region(128)
        raw = _wide_manifest(src.region_id, 3, 4, src.region_id)
        async with (
            aiohttp.ClientSession() as http,
            http.post(c.base_url + "/v1/sources", data=raw, headers={"Content-Type": MSGPACK}) as r,
        ):
            assert r.status == 400
            body = msgspec.json.decode(await r.read())
        assert "limits.max_manifest_shards" in body["detail"], body


async def test_health_is_answered_while_a_maximum_size_manifest_is_checked() -> None:
    """The daemon and this test share one event loop. Once the daemon reports that
    it is checking a manifest at the size limits (16 x 65,536 shards, the last one
    naming an unknown region), five health requests are sent one after another:
    each is answered while that manifest is still being checked. A check on the
    loop would hold every one of them until the manifest's answer."""
    async with _capped() as (d, c, _g):
        src = await c.create_region(1 << 20)
        raw = _wide_manifest(src.region_id, 16, MAX_TENSOR_SHARDS, 999_999)
        async with aiohttp.ClientSession() as http:
            big = asyncio.ensure_future(_publish_raw(http, c.base_url, raw))
            while not d.manifests_checking and not big.done():
                await c.health()  # the body is still on its way
            assert d.manifests_checking == 1, "the daemon never reported the manifest checked"
            answered_during = 0
            for _ in range(5):
                assert (await c.health())["status"] == "ok"
                answered_during += d.manifests_checking == 1 and not big.done()
            assert await big == 404  # every shard was checked, to the last
        assert answered_during == 5


async def test_staging_regions_packed_for_a_lease_count_against_its_principals_region_cap() -> None:
    """Packing again and again under one lease made a new staging region each time,
    held until the lease ended: one tenant could fill /dev/shm for all."""
    async with _capped(max_regions_per_principal=3) as (_d, c, _g):
        src = await c.create_region(128)
        await c.publish(toy_manifest(src.region_id))
        lease = await c.acquire_lease("toy", 1)
        spec = PackSpec(src.region_id, 0, (32,), (1,), 4, 0, 0)
        staged = [await c.peer_pack("toy", 1, lease.lease_id, [spec]) for _ in range(2)]
        with pytest.raises(QuotaExceeded, match=r"limits\.max_regions_per_principal = 3"):
            await c.peer_pack("toy", 1, lease.lease_id, [spec])
        await c.peer_drop(staged[0].region.region_id, lease.lease_id)
        await c.peer_pack("toy", 1, lease.lease_id, [spec])  # a released one is free again


async def test_an_expert_pools_two_regions_count_against_its_creators_region_cap() -> None:
    async with _capped(max_regions_per_principal=3) as (_d, c, _g):
        await c.create_pool("p1", layers=1, experts=2, slots=2, row_bytes=[16])
        with pytest.raises(QuotaExceeded, match=r"leaves no room for 2 more"):
            await c.create_pool("p2", layers=1, experts=2, slots=2, row_bytes=[16])
        await c.delete_pool("p1")
        await c.create_pool("p2", layers=1, experts=2, slots=2, row_bytes=[16])


async def test_at_most_two_manifests_are_decoded_and_checked_at_once() -> None:
    """Each manifest under check holds its body, its decoded objects and a worker
    thread: four sent at once are checked two at a time, the others wait unread."""
    async with _capped() as (d, c, _g):
        src = await c.create_region(1 << 20)
        raw = _wide_manifest(src.region_id, 2, MAX_TENSOR_SHARDS, 999_999)
        async with aiohttp.ClientSession() as http:
            sent = [asyncio.ensure_future(_publish_raw(http, c.base_url, raw)) for _ in range(4)]
            most = 0
            while not all(s.done() for s in sent):
                await c.health()
                most = max(most, d.manifests_checking)
            assert [await s for s in sent] == [404] * 4
        assert most == 2, most


@pytest.mark.parametrize("ctype", [MSGPACK, "application/json"])
async def test_a_manifest_of_many_tensors_publishes_whole_in_either_encoding(
    env: Env, ctype: str
) -> None:
    """Decoded a batch of tensors at a time: every tensor arrives, in order."""
    n = 60_000  # over 1 MiB encoded: several batches
    tensors = [[f"t{i}", [1], "uint8", [[[0], [1], env.src, i % 64]]] for i in range(n)]
    m = {"model": f"many-{ctype[-4:]}", "version": 1, "part": 0, "expected_parts": 1}
    m["tensors"] = tensors
    data = msgspec.msgpack.encode(m) if ctype == MSGPACK else msgspec.json.encode(m)
    code, body = await env.send("POST", "/v1/sources", data, ctype)
    assert code == 201, body
    merged = await env.client.manifest(str(m["model"]), 1)
    assert [t.name for t in merged.tensors] == [f"t{i}" for i in range(n)]


async def test_memory_the_daemon_makes_for_a_principal_is_capped_in_bytes() -> None:
    """Regions, staging and pools a principal makes count against
    limits.max_region_bytes_per_principal: one tenant cannot take all of /dev/shm."""
    async with _capped(max_region_bytes_per_principal=8192) as (_d, c, _g):
        src = await c.create_region(4096)
        await c.publish(toy_manifest(src.region_id))
        lease = await c.acquire_lease("toy", 1)
        big = await c.create_region(3968)
        with pytest.raises(QuotaExceeded, match=r"limits\.max_region_bytes_per_principal"):
            await c.create_region(4096)
        spec = PackSpec(src.region_id, 0, (32,), (1,), 4, 0, 0)  # 128 bytes: 8192 in all
        staged = await c.peer_pack("toy", 1, lease.lease_id, [spec])
        with pytest.raises(QuotaExceeded, match=r"limits\.max_region_bytes_per_principal"):
            await c.peer_pack("toy", 1, lease.lease_id, [spec])
        with pytest.raises(QuotaExceeded, match=r"limits\.max_region_bytes_per_principal"):
            await c.create_pool("p", layers=1, experts=2, slots=2, row_bytes=[512])
        await c.delete_region(big.region_id)
        await c.peer_drop(staged.region.region_id, lease.lease_id)
        await c.create_pool("p", layers=1, experts=2, slots=2, row_bytes=[512])  # 2048 bytes


async def test_a_pack_read_directly_from_a_version_still_filling_reads_only_its_complete_bytes() -> (
    None
):
    """Over shm a pack spec of long runs is gathered by the puller itself, never packed
    by the source: the scope the source's records give (a filling mirror's complete
    chunks) bounds it all the same, and nothing is staged."""
    async with _capped() as (d, c, _g):
        src = await c.create_region(2048)
        entry = ShardEntry((0, 0), (4, 128), src.region_id, 0)
        await c.publish(
            ManifestIn("toy", 1, 0, 1, [TensorEntry("w", (4, 128), "float32", [entry])])
        )
        dst = await c.create_region(2048)
        lease = await c.acquire_lease("toy", 1)
        _filling(d, src, 1024)
        none = DescriptorTable(b"")
        # the first 64 columns (256-byte runs) of rows 0-1, then of all four rows
        inside = PackSpec(src.region_id, 0, (2, 64), (128, 1), 4, dst.region_id, 0)
        outside = PackSpec(src.region_id, 0, (4, 64), (128, 1), 4, dst.region_id, 0)
        with pytest.raises(AccessDenied, match=r"pack spec 0 refused: .*\[0, 1792\)"):
            await c.submit_pull(PullRequest("toy", 1, lease.lease_id, none, [outside]))
        res = await c.pull(PullRequest("toy", 1, lease.lease_id, none, [inside]))
        assert res.state is PullState.DONE and res.bytes_done == 512
        assert "staging" not in [r.label for r in await c.regions()]


async def test_a_pack_from_a_version_still_filling_reads_only_its_complete_bytes() -> None:
    """A mirror still filling serves only its complete chunks: its daemon's table of
    mirrors still filling (``Daemon.filling``) cuts what a lease may read. Reads over
    the data plane obeyed it, but a source-side pack checked the version's whole shard
    ranges, so a reader could have packed (and then read) bytes not yet arrived."""
    async with _capped() as (d, c, _g):
        src = await c.create_region(128)
        await c.publish(toy_manifest(src.region_id))
        lease = await c.acquire_lease("toy", 1)
        # as a mirror whose first 64 bytes are complete would limit it
        _filling(d, src, 64)
        inside = PackSpec(src.region_id, 0, (16,), (1,), 4, 0, 0)
        outside = PackSpec(src.region_id, 64, (16,), (1,), 4, 0, 0)
        with pytest.raises(AccessDenied, match=r"bytes \[64, 128\) of region .* not part of"):
            await c.peer_pack("toy", 1, lease.lease_id, [outside])
        staged = await c.peer_pack("toy", 1, lease.lease_id, [inside])
        assert staged.region.nbytes == 64  # 16 elements of 4 bytes, packed
