"""Host mirrors and relay between real daemons on loopback, reading over ``tcp``
(``--transport tcp`` keeps daemons of one machine off the shared-memory path, as if
on separate hosts): a version crosses the source's data plane once per host, a
second host reads it from the first host's mirror, and a relay that is stopped or
killed is replaced by another holder without a torn byte."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import daemon_config, serving_daemons

from refitd.client.http import RefitClient
from refitd.client.spawn import SpawnedDaemon, spawn_daemon
from refitd.config import MirrorsConfig
from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.judge import LATE_FLOOR_S
from refitd.errors import ConflictError, NotFoundError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PackSpec,
    PullRequest,
    PullState,
    RegionCreate,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from refitd.wire import routes as api
from refitd.wire.mirrors import MirrorState
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(180)

NBYTES = 24 << 20  # 24 chunks of 1 MiB (mirror.chunk_bytes)
MODEL = "m"
TRUST = "peers.allow=http://127.0.0.1:*"
SAFETY_S = 60.0
"""Safety net for what a test waits on (a lease released at a relay)."""


def pattern(n: int, version: int) -> np.ndarray:
    words = np.arange((n + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words + np.uint64(version)).view(np.uint8)[:n]


@contextlib.asynccontextmanager
async def daemon(secret_file: str, name: str, *extra: str) -> AsyncIterator[SpawnedDaemon]:
    async with spawn_daemon(
        secret_file=secret_file,
        transport="tcp",
        node_id=name,
        extra_args=["--set", TRUST, *extra],
    ) as d:
        yield d


MIRROR = ("--set", "mirrors.policy=always")


@dataclass(frozen=True)
class Chain:
    """A source and two mirror hosts, each a daemon of its own, and a client of each."""

    t: SpawnedDaemon
    a: SpawnedDaemon
    b: SpawnedDaemon
    tc: RefitClient
    ac: RefitClient
    bc: RefitClient


@contextlib.asynccontextmanager
async def chain(
    secret_file: str, *b_extra: str, a_timeout_s: float = 300.0
) -> AsyncIterator[Chain]:
    """``trainer`` and mirror hosts ``host-a`` and ``host-b`` (``b_extra``: more
    arguments of the second); ``a_timeout_s`` is the client of ``host-a``'s."""
    async with (
        daemon(secret_file, "trainer") as t,
        daemon(secret_file, "host-a", *MIRROR) as a,
        daemon(secret_file, "host-b", *MIRROR, *b_extra) as b,
        RefitClient(t.url) as tc,
        RefitClient(a.url, timeout_s=a_timeout_s) as ac,
        RefitClient(b.url) as bc,
    ):
        yield Chain(t, a, b, tc, ac, bc)


async def publish(c: RefitClient, version: int) -> None:
    """Version ``version`` of one uint8 tensor in a new region of the source."""
    region = await c.create_region(NBYTES, label=f"src-{version}")
    seg = SharedSegment.attach(region.handle, NBYTES)
    seg.numpy()[:] = pattern(NBYTES, version)
    seg.close()
    t = TensorEntry("blob", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), region.region_id, 0)])
    await c.publish(ManifestIn(MODEL, version, 0, 1, [t]))


async def refit(local: RefitClient, source: RefitClient, version: int) -> str:
    """One engine: lease at the source, pull every byte through ``local``, check them.
    Returns the path the pull took."""
    lease = await source.acquire_lease(MODEL, version, 60.0)
    manifest = await source.manifest(MODEL, version)
    src_region = manifest.tensors[0].shards[0].region
    dst = await local.create_region(NBYTES, label="engine")
    try:
        rows = np.array([[src_region, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
        req = PullRequest(
            MODEL, version, lease.lease_id, DescriptorTable.pack(rows), [], source.base_url
        )
        done = await local.pull(req)
        seg = SharedSegment.attach(dst.handle, NBYTES)
        try:
            assert np.array_equal(seg.numpy(), pattern(NBYTES, version))
        finally:
            seg.close()
        return done.path
    finally:
        await source.release_lease(lease.lease_id)
        await local.delete_region(dst.region_id)


async def state(c: RefitClient, version: int) -> MirrorState:
    return await c._send(api.MIRROR_STATE, model=MODEL, version=version)


async def test_two_replicas_on_a_host_share_one_mirror_that_a_second_host_relays(
    secret_file: str,
) -> None:
    async with chain(secret_file) as h:
        t, a, tc, ac, bc = h.t, h.a, h.tc, h.ac, h.bc
        await publish(tc, 1)
        paths = await asyncio.gather(refit(ac, tc, 1), refit(ac, tc, 1))
        assert paths == ["shm", "shm"]  # both replicas read the host's mirror
        sa = await state(ac, 1)
        assert sa.complete and sa.tried == [t.url]
        assert await refit(bc, tc, 1) == "shm"
        sb = await state(bc, 1)
        assert sb.complete and sb.tried == [a.url]  # host b read host a, not the trainer


async def test_a_pull_without_a_live_lease_at_the_source_is_refused_by_a_complete_mirror(
    secret_file: str,
) -> None:
    """The engine's lease at the source is what entitles it to the version: a mirror
    served pulls without checking it, so any local tenant could read a version the
    source would refuse it (or make the daemon mirror one) with a made-up lease id."""
    async with (
        daemon(secret_file, "trainer") as t,
        daemon(secret_file, "host-a", *MIRROR) as a,
        RefitClient(t.url) as tc,
        RefitClient(a.url) as ac,
    ):
        await publish(tc, 1)
        assert await refit(ac, tc, 1) == "shm"  # the mirror is complete
        manifest = await tc.manifest(MODEL, 1)
        src_region = manifest.tensors[0].shards[0].region
        dst = await ac.create_region(NBYTES, label="thief")
        rows = np.array([[src_region, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
        for lease_id in ("made-up", (await tc.acquire_lease(MODEL, 1, 60.0)).lease_id):
            if lease_id != "made-up":
                await tc.release_lease(lease_id)  # a lease that ended is no better
            req = PullRequest(MODEL, 1, lease_id, DescriptorTable.pack(rows), [], tc.base_url)
            with pytest.raises(ConflictError):
                await ac.pull(req)
        seg = SharedSegment.attach(dst.handle, NBYTES)
        try:
            assert not seg.numpy().any()  # nothing was transferred
        finally:
            seg.close()


async def test_the_never_policy_reads_the_source_directly(secret_file: str) -> None:
    async with (
        daemon(secret_file, "trainer") as t,
        daemon(secret_file, "host-a") as a,
        RefitClient(t.url) as tc,
        RefitClient(a.url) as ac,
    ):
        await publish(tc, 1)
        assert await refit(ac, tc, 1) == "tcp"


async def test_the_shared_policy_mirrors_once_a_second_lease_reads_the_version(
    secret_file: str,
) -> None:
    async with (
        daemon(secret_file, "trainer") as t,
        daemon(secret_file, "host-a", "--set", "mirrors.policy=shared") as a,
        RefitClient(t.url) as tc,
        RefitClient(a.url) as ac,
    ):
        await publish(tc, 1)
        assert await refit(ac, tc, 1) == "tcp"  # one reader so far: direct
        assert await refit(ac, tc, 1) == "shm"  # a second lease: mirrored
        await publish(tc, 2)
        assert await refit(ac, tc, 2) == "shm"  # the model has two readers: mirrored at once
        # the retired version's mirror went once nothing leased it
        regions = [r for r in await ac.regions() if r.label == f"mirror-{MODEL}-1"]
        assert regions == []


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
async def test_a_relay_that_stops_or_dies_is_replaced_by_another_holder_and_the_bytes_are_exact(
    secret_file: str, fault: str
) -> None:
    fast = ("--set", "data_plane.pull_timeout_s=3")
    async with chain(secret_file, *fast, a_timeout_s=10) as h:
        t, a, tc, ac, bc = h.t, h.a, h.tc, h.ac, h.bc
        await publish(tc, 1)
        assert await refit(ac, tc, 1) == "shm"
        os.kill(a.pid, getattr(signal, fault))
        try:
            assert await refit(bc, tc, 1) == "shm"
            sb = await state(bc, 1)
            assert sb.complete and sb.tried == [a.url, t.url]
        finally:
            if fault == "SIGSTOP":
                os.kill(a.pid, signal.SIGCONT)


def _counter(text: str, name: str, label: str) -> float:
    """The value of counter ``name`` with label ``label`` in a Prometheus scrape."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_mirror_fills_and_relays_show_in_the_pulls_list_and_the_metrics(
    secret_file: str,
) -> None:
    """A mirror's fill from the source and a relay's from its upstream move through the
    pull path's one byte loop: each is a pull of its daemon, listed and counted by the
    path it took, like an engine's."""
    async with chain(secret_file) as h, aiohttp.ClientSession() as http:
        a, b, tc, ac, bc = h.a, h.b, h.tc, h.ac, h.bc
        await publish(tc, 1)
        assert await refit(ac, tc, 1) == "shm"
        assert await refit(bc, tc, 1) == "shm"
        assert (await state(bc, 1)).tried == [a.url]  # b's mirror was relayed by a
        for c, url in ((ac, a.url), (bc, b.url)):
            pulls = await c._send(api.LIST_PULLS)
            fills = [p for p in pulls if p.path == "tcp"]
            engines = [p for p in pulls if p.path == "shm"]
            assert engines and all(p.state == PullState.DONE for p in engines)
            assert fills, f"no mirror fill listed at {url}: {pulls}"
            assert all(p.state == PullState.DONE for p in fills)
            assert sum(p.bytes_done for p in fills) == NBYTES
            async with http.get(f"{url}/metrics") as resp:
                scrape = await resp.text()
            assert _counter(scrape, "refitd_pulled_bytes_total{", 'transport="tcp"') == NBYTES


async def test_the_next_version_is_mirrored_into_the_regions_of_the_one_before_it(
    secret_file: str,
) -> None:
    """A refit loop: version 2 of the model, laid out as version 1, is mirrored on
    both hosts (one reading the other) into the regions version 1's mirrors held,
    none made anew, and every replica of version 2 is exact: bytes of version 1
    left in those regions are never read. Version 1's mirrors are gone."""
    async with chain(secret_file) as h:
        await publish(h.tc, 1)
        assert await refit(h.ac, h.tc, 1) == "shm"
        assert await refit(h.bc, h.tc, 1) == "shm"
        before = {c: (await state(c, 1)).regions for c in (h.ac, h.bc)}
        await publish(h.tc, 2)
        assert await asyncio.gather(refit(h.ac, h.tc, 2), refit(h.bc, h.tc, 2)) == ["shm"] * 2
        for c in (h.ac, h.bc):
            now = await state(c, 2)
            assert now.complete
            assert set(now.regions.values()) == set(before[c].values())
            with pytest.raises(NotFoundError):
                await state(c, 1)
            assert {r.region_id for r in await c.regions() if r.label == "mirror"} == set(
                now.regions.values()
            )


async def test_a_host_that_cannot_hold_the_mirror_leaves_no_lease_at_its_relay_and_reads_the_source(
    secret_file: str,
) -> None:
    """Host b's mirror opens its relay (host a) while its regions are made; its budget
    then refuses the version. Its pull reads the source, exact; nothing of b is left
    at a: no lease on a's mirror stays live, and a later host reads a as before."""
    async with chain(secret_file, "--set", "mirrors.max_bytes=1") as h:
        await publish(h.tc, 1)
        assert await refit(h.ac, h.tc, 1) == "shm"
        assert await refit(h.bc, h.tc, 1) == "tcp"  # b has no room: it reads the source
        with pytest.raises(NotFoundError):
            await state(h.bc, 1)
        async with asyncio.timeout(SAFETY_S):
            while (await h.ac.versions(MODEL))[-1].leases:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert await refit(h.ac, h.tc, 1) == "shm"


async def test_strided_reads_of_a_mirror_still_filling_are_exact_packed_or_read_directly(
    secret_file: str,
) -> None:
    """A pull's pack specs served from a mirror still filling: one of 64-byte runs
    (packed by this daemon from the mirror, then read from its staging region, no
    chunk of the mirror) and one of 512-byte runs (read straight from the mirror's
    chunks), each across a chunk's edge. Both land exactly as the source holds them.
    Found under issue 46: the packed one failed with "a read lies outside every
    chunk of the mirror it reads"."""
    async with (
        daemon(secret_file, "trainer") as t,
        daemon(secret_file, "host-a", *MIRROR) as a,
        RefitClient(t.url) as tc,
        RefitClient(a.url) as ac,
    ):
        await publish(tc, 1)
        lease = await tc.acquire_lease(MODEL, 1, 60.0)
        src = (await tc.manifest(MODEL, 1)).tensors[0].shards[0].region
        edge = 1 << 20  # the first chunk's end (24 MiB cut in 1 MiB chunks)
        short = PackSpec(src, edge - 4096, (128, 64), (128, 1), 1, 0, 0)
        long = PackSpec(src, 3 * edge - 8192, (64, 512), (1024, 1), 1, 0, 8192)
        dst = await ac.create_region(8192 + 64 * 512, label="engine")
        specs = [msgspec.structs.replace(s, dst_region=dst.region_id) for s in (short, long)]
        req = PullRequest(
            MODEL, 1, lease.lease_id, DescriptorTable.pack(_no_rows()), specs, tc.base_url
        )
        done = await ac.pull(req)
        assert done.path == "shm"  # read from the mirror
        whole = pattern(NBYTES, 1)
        want = np.concatenate(
            [
                np.lib.stride_tricks.as_strided(whole[s.src_offset :], s.shape, s.strides).ravel()
                for s in specs
            ]
        )
        seg = SharedSegment.attach(dst.handle, dst.nbytes)
        try:
            assert np.array_equal(seg.numpy()[: want.size], want)
        finally:
            seg.close()
        assert (await state(ac, 1)).tried == [t.url]
        await tc.release_lease(lease.lease_id)


def _no_rows() -> np.ndarray:
    return np.zeros((0, 5), dtype=np.int64)


def _slow_mirror_regions(d: Daemon, delay_s: float) -> None:
    """Hold back each region ``d`` makes for a mirror by ``delay_s`` (a host whose
    shared memory is slow to make: the real part, late, as a loaded machine has it)."""
    make = d.store.create_region  # what the mirrors make their regions with

    async def slowly(req: RegionCreate, principal: str | None = None) -> RegionInfo:
        if req.label == "mirror":
            await asyncio.sleep(delay_s)
        return await make(req, principal)

    d.store.create_region = slowly  # type: ignore[method-assign]


async def _publish_halves(c: RefitClient, version: int) -> None:
    """Version ``version`` of one uint8 tensor whose two halves lie in two regions of
    the source (so a mirror of it makes two regions, one after the other)."""
    half = NBYTES // 2
    data = pattern(NBYTES, version)
    shards = []
    for k in range(2):
        region = await c.create_region(half, label=f"src-{version}-{k}")
        seg = SharedSegment.attach(region.handle, half)
        seg.numpy()[:] = data[k * half : (k + 1) * half]
        seg.close()
        shards.append(ShardEntry((k * half,), (half,), region.region_id, 0))
    await c.publish(
        ManifestIn(MODEL, version, 0, 1, [TensorEntry("blob", (NBYTES,), "uint8", shards)])
    )


async def _refit_halves(local: RefitClient, source: RefitClient, version: int) -> None:
    """:func:`refit` of a version :func:`_publish_halves` published."""
    lease = await source.acquire_lease(MODEL, version, 60.0)
    manifest = await source.manifest(MODEL, version)
    dst = await local.create_region(NBYTES, label="engine")
    try:
        half = NBYTES // 2
        rows = np.array(
            [
                [s.region, 0, dst.region_id, k * half, half]
                for k, s in enumerate(manifest.tensors[0].shards)
            ],
            dtype=np.int64,
        )
        req = PullRequest(
            MODEL, version, lease.lease_id, DescriptorTable.pack(rows), [], source.base_url
        )
        assert (await local.pull(req)).path == "shm"  # through this host's mirror
        seg = SharedSegment.attach(dst.handle, NBYTES)
        try:
            assert np.array_equal(seg.numpy(), pattern(NBYTES, version))
        finally:
            seg.close()
    finally:
        await source.release_lease(lease.lease_id)
        await local.delete_region(dst.region_id)


async def _until_some_regions_made(c: RefitClient) -> None:
    """Return once ``c``'s daemon has made a region of its mirror of version 1 (and
    not yet all of them: it is not complete)."""
    deadline = asyncio.get_running_loop().time() + SAFETY_S
    while asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(NotFoundError):
            st = await state(c, 1)
            assert not st.complete, "the relay made its regions before the test looked"
            if st.regions:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no region of the mirror made in {SAFETY_S} s")


@pytest.mark.parametrize("slow", ["downstream", "relay"])
async def test_a_relays_feed_read_while_either_side_still_makes_its_regions_is_read_exactly(
    slow: str,
) -> None:
    """A downstream mirror opens its relay's lease and feed while it makes its own
    regions, and a relay may be joined while it still makes its own. Here one side's
    region creation is held back (a second per region, two regions): ``downstream``,
    the relay's first frame lands before ``host-b`` made any region; ``relay``,
    ``host-b`` joins ``host-a`` while ``host-a`` made one region of two. Either way
    ``host-b`` reads ``host-a``, not the source: a relay's frame is checked against
    the layout planned here, not the part of it made so far (CI once saw a relay left
    for "another source or layout", the ``downstream`` race). In ``relay``, ``host-a``'s
    second region alone takes longer than a holder's late floor: ``host-b`` must not
    find ``host-a`` late for chunks it does not hold yet (CI saw ``host-b`` leave it
    for the trainer)."""
    secret = os.urandom(32)

    def node(name: str, *, mirrored: bool) -> Daemon:
        policy = "always" if mirrored else "never"
        cfg = daemon_config(node_id=name, transport="tcp", mirrors=MirrorsConfig(policy=policy))
        return Daemon(cfg, secret=secret)

    t = node("trainer", mirrored=False)
    a, b = node("host-a", mirrored=True), node("host-b", mirrored=True)
    if slow == "downstream":
        _slow_mirror_regions(b, 1.0)
    else:
        _slow_mirror_regions(a, LATE_FLOOR_S + 0.5)
    async with serving_daemons(t, a, b) as (tc, ac, bc):
        await _publish_halves(tc, 1)
        first = asyncio.create_task(_refit_halves(ac, tc, 1))
        if slow == "relay":  # host-b joins while host-a makes its regions
            await _until_some_regions_made(ac)
        else:
            await first
        await _refit_halves(bc, tc, 1)
        await first
        sb = await state(bc, 1)
        assert sb.complete
        assert sb.tried == [ac.base_url.rstrip("/")]  # host a's mirror, not the trainer


async def test_a_holder_that_serves_wrong_bytes_is_caught_by_the_digest_and_read_elsewhere(
    secret_file: str,
) -> None:
    """``host-a`` holds the version (the book dealt it every chunk); one byte of its
    mirror's chunk 5 is then altered in its shared memory. ``host-b`` reads from it:
    the chunk's digest at the source catches it before the chunk is marked complete,
    ``host-b`` leaves ``host-a`` and reads what it lacks from the source, and its
    engine's bytes are exact (they would hold the altered byte without the check)."""
    async with chain(secret_file) as h:
        await publish(h.tc, 1)
        assert await refit(h.ac, h.tc, 1) == "shm"
        sa = await state(h.ac, 1)
        assert sa.complete
        [rid] = sa.regions.values()
        [region] = [r for r in await h.ac.regions() if r.region_id == rid]
        seg = SharedSegment.attach(region.handle, NBYTES)
        try:
            seg.numpy()[5 * (1 << 20) + 17] ^= 0x5A
        finally:
            seg.close()
        assert await refit(h.bc, h.tc, 1) == "shm"  # exact: checked inside
        sb = await state(h.bc, 1)
        assert sb.complete and sb.reasked >= 1
        assert [u.rstrip("/") for u in sb.tried] == [h.a.url.rstrip("/"), h.t.url.rstrip("/")]
        assert sb.reads.get(h.t.url.rstrip("/"), 0) >= 1  # the rest came from the source
