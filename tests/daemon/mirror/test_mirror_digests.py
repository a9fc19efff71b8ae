"""Chunk digests: a source states the digest of each chunk of a version, once, under a
lease; a mirror finds exactly the chunks whose bytes differ from the source's.

Real daemons in this process on 127.0.0.1:0 (a source, and a mirror host reading it
over ``tcp`` as another host would), real shared memory; the expected digests are
computed here from the bytes the test published, with BLAKE3 directly, and the chunks
are cut here by the rule every mirror follows (``docs/fanout.md``, chunk size).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import blake3
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.daemons import Served, daemon_config, served, trusting_each_other

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.chunks import CHUNK_BYTES, cut_chunks
from refitd.daemon.mirror.digest import (
    KEEP_VERSIONS,
    check_cut,
    chunk_digests,
    local_rows,
    verify,
    verify_mirror,
)
from refitd.daemon.mirror.digestroutes import DIGESTS
from refitd.daemon.mirror.routes import MIRRORS
from refitd.daemon.pull.peerclient import PeerClient
from refitd.errors import AccessDenied, ConflictError, ProtocolError
from refitd.wire import DescriptorTable, ManifestIn, PullRequest, ShardEntry, TensorEntry
from refitd.wire import routes as api
from refitd.wire.digests import DIGEST_BYTES, ChunkDigests
from refitd.wire.mirrors import MirrorLease
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"mirror-digest-secret-0123456789ab"
MODEL = "m"
MIB = 1 << 20


def digest(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest(DIGEST_BYTES)


# ---------------------------------------------------------------- a published version


@dataclass
class Version:
    """A version published at the source: its bytes per source region, and the byte
    ranges its shards occupy (its scope)."""

    number: int
    memory: dict[int, np.ndarray]
    scope: dict[int, list[tuple[int, int]]]

    def expected(self, chunk: int = CHUNK_BYTES) -> bytes:
        """BLAKE3 of each chunk: ranges in region then offset order, cut every
        ``chunk`` bytes from each range's start."""
        out = b""
        for rid in sorted(self.scope):
            for start, end in self.scope[rid]:
                for off in range(start, end, chunk):
                    out += digest(self.memory[rid][off : min(off + chunk, end)].tobytes())
        return out


async def publish(c: RefitClient, number: int, tail: int = 777) -> Version:
    """Two regions: the first holds tensor ``a`` and, past a gap, tensor ``b`` (two
    ranges, each ending in a short chunk); the second holds tensor ``c`` whole."""
    rng = np.random.default_rng(number)
    a_len, b_len, c_len = 2 * MIB + tail, MIB + 3 * tail, MIB // 2
    a_off, b_off = 4096, 2 * MIB + tail + 3 * 4096
    sizes = (b_off + b_len + 100, c_len)
    memory: dict[int, np.ndarray] = {}
    ids = []
    for i, size in enumerate(sizes):
        info = await c.create_region(size, label=f"v{number}-{i}")
        data = rng.integers(0, 256, size, dtype=np.uint8)
        with SharedSegment.attach(info.handle, size) as seg:
            seg.numpy()[:] = data
        memory[info.region_id] = data
        ids.append(info.region_id)
    r0, r1 = ids
    tensors = [
        TensorEntry("a", (a_len,), "uint8", [ShardEntry((0,), (a_len,), r0, a_off)]),
        TensorEntry("b", (b_len,), "uint8", [ShardEntry((0,), (b_len,), r0, b_off)]),
        TensorEntry("c", (c_len,), "uint8", [ShardEntry((0,), (c_len,), r1, 0)]),
    ]
    await c.publish(ManifestIn(MODEL, number, 0, 1, tensors))
    scope = {r0: [(a_off, a_off + a_len), (b_off, b_off + b_len)], r1: [(0, c_len)]}
    return Version(number, memory, scope)


@contextlib.asynccontextmanager
async def peer_of(url: str) -> AsyncIterator[PeerClient]:
    """A peer daemon's client of the daemon at ``url``."""
    peer = PeerClient(url)
    try:
        yield peer
    finally:
        await peer.close()


@contextlib.asynccontextmanager
async def source() -> AsyncIterator[tuple[Served, PeerClient]]:
    """A source daemon, and a peer daemon's client of it."""
    async with (
        served(Daemon(daemon_config(node_id="trainer"), secret=SECRET)) as s,
        peer_of(s.url) as peer,
    ):
        yield s, peer


# ---------------------------------------------------------------- the source


async def test_the_digests_a_source_serves_are_blake3_of_each_chunk_of_the_published_bytes() -> (
    None
):
    async with source() as (s, peer):
        v = await publish(s.client, 1)
        lease = await s.client.acquire_lease(MODEL, 1, 60.0)
        got = await peer.chunk_digests(MODEL, 1, lease.lease_id)
        want = v.expected()
        nbytes = sum(e - b for ext in v.scope.values() for b, e in ext)
        assert (got.chunk_bytes, got.nbytes, got.chunks) == (
            CHUNK_BYTES,
            nbytes,
            len(want) // DIGEST_BYTES,
        )
        assert got.chunks == 6  # 3 + 2 chunks in the first region, 1 in the second
        assert got.digests == want
        # JSON carries the same digests (base64) as msgpack does
        url = f"{s.url}{api.MIRROR_DIGESTS.url(model=MODEL, version=1)}?lease={lease.lease_id}"
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            assert r.status == 200
            assert msgspec.json.decode(await r.read(), type=ChunkDigests) == got


async def test_a_caller_without_a_live_lease_on_the_version_is_refused_and_nothing_is_computed() -> (
    None
):
    async with source() as (s, peer):
        await publish(s.client, 1)
        on_1 = await s.client.acquire_lease(MODEL, 1, 60.0)
        await publish(s.client, 2)  # version 1 retired, still leased
        ended = await s.client.acquire_lease(MODEL, 2, 60.0)
        await s.client.release_lease(ended.lease_id)
        with pytest.raises(AccessDenied, match="lease"):
            await peer.chunk_digests(MODEL, 2, "")
        for lease in ("made-up-lease", on_1.lease_id, ended.lease_id):
            with pytest.raises(
                ConflictError, match=f"chunk digests of 'm' version 2 refused.*{lease}"
            ):
                await peer.chunk_digests(MODEL, 2, lease)
        # the same refusal whether or not the version exists
        with pytest.raises(ConflictError, match="made-up-lease"):
            await peer.chunk_digests(MODEL, 99, "made-up-lease")
        # in the error shape, with the status the route documents
        url = f"{s.url}{api.MIRROR_DIGESTS.url(model=MODEL, version=2)}"
        async with aiohttp.ClientSession() as http:
            for query, status in (("", 403), ("?lease=made-up-lease", 409)):
                async with http.get(url + query) as r:
                    body = await r.json(content_type=None)
                    assert r.status == status, body
                    assert set(body) == {"error", "detail"}
        assert s.app[DIGESTS].computed == 0


async def test_many_concurrent_requests_of_a_version_compute_its_digests_once() -> None:
    async with source() as (s, peer):
        v = await publish(s.client, 1, tail=24 * MIB)  # about 27 MiB: a computation that lasts
        leases = [await s.client.acquire_lease(MODEL, 1, 60.0) for _ in range(4)]
        answers = await asyncio.gather(
            *(peer.chunk_digests(MODEL, 1, leases[i % 4].lease_id) for i in range(32))
        )
        assert {a.digests for a in answers} == {v.expected()}
        assert s.app[DIGESTS].computed == 1
        again = await peer.chunk_digests(MODEL, 1, leases[0].lease_id)
        assert again == answers[0]
        assert s.app[DIGESTS].computed == 1


async def test_digests_are_kept_for_a_models_newest_versions_and_dropped_once_a_retired_one_is_unleased() -> (
    None
):
    async with source() as (s, peer):
        digests = s.app[DIGESTS]
        leases = {}
        for n in (1, 2):
            await publish(s.client, n)
            leases[n] = (await s.client.acquire_lease(MODEL, n, 600.0)).lease_id
            await peer.chunk_digests(MODEL, n, leases[n])
        assert digests.kept() == [(MODEL, 1), (MODEL, 2)]  # 1 is retired, still leased
        v3 = await publish(s.client, 3)
        leases[3] = (await s.client.acquire_lease(MODEL, 3, 600.0)).lease_id
        await s.client.release_lease(leases[1])  # nobody can ask for version 1 again
        assert (await peer.chunk_digests(MODEL, 3, leases[3])).digests == v3.expected()
        assert digests.kept() == [(MODEL, 2), (MODEL, 3)]
        for n in range(4, 4 + KEEP_VERSIONS):
            await publish(s.client, n)
        newest = 3 + KEEP_VERSIONS
        on_newest = await s.client.acquire_lease(MODEL, newest, 600.0)
        await peer.chunk_digests(MODEL, newest, on_newest.lease_id)
        # versions 2 and 3 left the window of the newest versions: forgotten, and
        # refused (never computed again), though their leases are live
        assert digests.kept() == [(MODEL, newest)]
        for n in (2, 3):
            with pytest.raises(ConflictError, match=f"newest {KEEP_VERSIONS} versions"):
                await peer.chunk_digests(MODEL, n, leases[n])
        assert digests.computed == 4  # versions 1, 2, 3 and the newest, each once


# ---------------------------------------------------------------- a mirror's check


@dataclass
class Hosts:
    source: Served
    mirror: Served


@contextlib.asynccontextmanager
async def hosts() -> AsyncIterator[Hosts]:
    """A source and a mirror host (``policy = always``) reading it over ``tcp``."""
    src = Daemon(daemon_config(node_id="trainer", transport="tcp"), secret=SECRET)
    mopts = daemon_config(node_id="host-a", transport="tcp", policy="always")
    async with served(src) as s, served(Daemon(mopts, secret=SECRET)) as m:
        trusting_each_other(s, m)
        yield Hosts(s, m)


async def test_a_mirror_finds_exactly_the_chunk_whose_bytes_were_altered_in_its_shared_memory() -> (
    None
):
    async with hosts() as h:
        v = await publish(h.source.client, 1)
        lease = await h.source.client.acquire_lease(MODEL, 1, 60.0)
        ranges = [(r, b, e) for r in sorted(v.scope) for b, e in v.scope[r]]
        size = sum(e - b for _, b, e in ranges)
        dst = await h.mirror.client.create_region(size, label="engine")
        lands = np.cumsum([0] + [e - b for _, b, e in ranges])
        rows = np.array(
            [[r, b, dst.region_id, lands[i], e - b] for i, (r, b, e) in enumerate(ranges)],
            dtype=np.int64,
        )
        req = PullRequest(MODEL, 1, lease.lease_id, DescriptorTable.pack(rows), [], h.source.url)
        assert (await h.mirror.client.pull(req)).path == "shm"  # read from the mirror
        m = h.mirror.app[MIRRORS].find(MODEL, 1)
        assert m.complete
        async with peer_of(h.source.url) as peer:
            expected = await peer.chunk_digests(MODEL, 1, lease.lease_id)
        everything = np.arange(len(m.chunks))
        assert list(await verify_mirror(h.mirror.daemon.store, m, expected, everything)) == []
        # one byte of chunk 4 (the second range's second chunk), altered in the shm
        src, off, n = (int(x) for x in m.chunks[4])
        region = m.regions[src]
        with SharedSegment.attach(region.handle) as seg:
            at = off + n - 1
            seg.numpy()[at] ^= 0x5A
            assert list(await verify_mirror(h.mirror.daemon.store, m, expected, everything)) == [4]
            assert list(await verify_mirror(h.mirror.daemon.store, m, expected, [3, 5])) == []
            seg.numpy()[at] ^= 0x5A
        assert list(await verify_mirror(h.mirror.daemon.store, m, expected, everything)) == []


async def test_a_daemon_holding_the_version_as_a_mirror_refuses_its_digests() -> None:
    async with hosts() as h:
        v = await publish(h.source.client, 1)
        lease = await h.source.client.acquire_lease(MODEL, 1, 60.0)
        r0 = min(v.scope)
        dst = await h.mirror.client.create_region(MIB, label="engine")
        rows = np.array([[r0, v.scope[r0][0][0], dst.region_id, 0, MIB]], dtype=np.int64)
        req = PullRequest(MODEL, 1, lease.lease_id, DescriptorTable.pack(rows), [], h.source.url)
        await h.mirror.client.pull(req)
        ask = MirrorLease.fresh(MODEL, 1, lease.lease_id, "relay-b", 60.0).signed(SECRET)
        relay = await h.mirror.client._send(api.MIRROR_LEASE, ask)
        async with peer_of(h.mirror.url) as at_mirror:
            with pytest.raises(ConflictError, match="host mirror"):
                await at_mirror.chunk_digests(MODEL, 1, relay.lease_id)
        assert h.mirror.app[DIGESTS].computed == 0


# ---------------------------------------------------------------- verify, pure and on shm


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], dict[int, list[tuple[int, int]]], int]:
    """Region sizes, a scope over them (sorted, disjoint ranges), a chunk size."""
    sizes = draw(st.lists(st.integers(1, 40_000), min_size=1, max_size=3))
    scope: dict[int, list[tuple[int, int]]] = {}
    for i, size in enumerate(sizes):
        cuts = sorted(draw(st.sets(st.integers(0, size), min_size=0, max_size=6)))
        pairs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
        if pairs:
            scope[i] = pairs
    chunk = draw(st.sampled_from([1, 5, 64, 1000, 4096, 1 << 20]))
    return sizes, scope, chunk


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), data=st.data())
def test_verify_finds_exactly_the_chunks_with_an_altered_byte_and_none_otherwise(
    layout: tuple[list[int], dict[int, list[tuple[int, int]]], int], data: st.DataObject
) -> None:
    sizes, scope, chunk = layout
    source_ids = [7, 3, 11][: len(sizes)]  # source region ids, mapped to others here
    local = {source_ids[i]: 100 + i for i in range(len(sizes))}
    src_scope = {source_ids[i]: ext for i, ext in scope.items()}
    chunks = cut_chunks(src_scope, chunk)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    segs = [SharedSegment.create(size, "digest-test") for size in sizes]
    try:
        for seg in segs:
            seg.numpy()[:] = rng.integers(0, 256, seg.size, dtype=np.uint8)
        views = {100 + i: seg.numpy().data for i, seg in enumerate(segs)}
        want = b"".join(
            digest(views[local[int(r)]][int(o) : int(o) + int(n)]) for r, o, n in chunks.tolist()
        )
        expected = ChunkDigests(chunk, len(chunks), int(chunks[:, 2].sum()), want)
        flips = data.draw(
            st.lists(
                st.tuples(st.integers(0, len(sizes) - 1), st.floats(0, 1, exclude_max=True)),
                max_size=5,
            )
        )
        hit: set[int] = set()
        flipped: set[tuple[int, int]] = set()
        for i, where in flips:
            at = int(where * sizes[i])
            if (i, at) in flipped:
                continue  # flipped twice, a byte could come back
            flipped.add((i, at))
            segs[i].numpy()[at] ^= 0xA5
            for k, (r, o, n) in enumerate(chunks.tolist()):
                if r == source_ids[i] and o <= at < o + n:
                    hit.add(k)
        bad = asyncio.run(verify(views, chunks, local, expected))
        assert bad.tolist() == sorted(hit)
        some = data.draw(st.sets(st.integers(0, max(len(chunks) - 1, 0)), max_size=4))
        some = {k for k in some if k < len(chunks)}
        part = asyncio.run(verify(views, chunks, local, expected, sorted(some)))
        assert part.tolist() == sorted(hit & some)
    finally:
        for seg in segs:
            seg.close()


async def test_digests_of_another_cut_are_refused_before_any_chunk_is_checked() -> None:
    chunks = cut_chunks({1: [(0, 3 * MIB)]}, MIB)
    memory = np.zeros(3 * MIB, dtype=np.uint8)
    views = {5: memory.data}
    good = ChunkDigests(MIB, 3, 3 * MIB, await chunk_digests(views, local_rows(chunks, {1: 5})))
    check_cut(good, chunks)
    for wrong in (
        ChunkDigests(MIB, 2, 3 * MIB, good.digests[:32]),  # another count
        ChunkDigests(MIB, 3, 3 * MIB, good.digests[:40]),  # digests cut short
        ChunkDigests(MIB, 3, 3 * MIB - 1, good.digests),  # other bytes
        ChunkDigests(MIB // 2, 3, 3 * MIB, good.digests),  # a smaller chunk size
    ):
        with pytest.raises(ProtocolError, match="do not fit this mirror's chunks"):
            await verify(views, chunks, {1: 5}, wrong)
    with pytest.raises(ProtocolError, match="source region 1"):
        await verify(views, chunks, {2: 5}, good)
    with pytest.raises(ProtocolError, match="outside"):
        await verify(views, chunks, {1: 5}, good, [3])


async def test_a_chunk_row_outside_its_region_is_refused_before_any_byte_is_hashed() -> None:
    views = {1: np.zeros(MIB, dtype=np.uint8).data}
    for row, why in (([1, MIB - 10, 11], "outside its"), ([2, 0, 1], "names no region")):
        with pytest.raises(ProtocolError, match=why):
            await chunk_digests(views, np.array([row], dtype=np.int64))


# ---------------------------------------------------------------- its cost


@pytest.mark.parametrize("chunk", [MIB, 4 * MIB, 16 * MIB])
async def test_verify_of_a_batch_of_two_chunks_prints_its_rate_beside_memcpy(chunk: int) -> None:
    """Not a pass/fail on time: prints the rate of :func:`verify` on a batch of two
    chunks (what a mirror checks as they land) beside a copy of the same bytes."""
    with SharedSegment.create(2 * chunk, "digest-bench") as seg:
        seg.numpy()[:] = np.random.default_rng(0).integers(0, 256, 2 * chunk, dtype=np.uint8)
        views = {9: seg.numpy().data}
        chunks = cut_chunks({1: [(0, 2 * chunk)]}, chunk)
        got = await chunk_digests(views, local_rows(chunks, {1: 9}))
        expected = ChunkDigests(chunk, 2, 2 * chunk, got)
        runs, began = 0, time.perf_counter()
        while time.perf_counter() - began < 0.5:
            assert len(await verify(views, chunks, {1: 9}, expected, [0, 1])) == 0
            runs += 1
        verify_gbs = runs * 2 * chunk / (time.perf_counter() - began) / 1e9
        dst = np.empty(2 * chunk, dtype=np.uint8)
        copies, began = 0, time.perf_counter()
        while time.perf_counter() - began < 0.5:
            np.copyto(dst, seg.numpy())
            copies += 1
        copy_gbs = copies * 2 * chunk / (time.perf_counter() - began) / 1e9
        print(
            f"verify of 2 x {chunk >> 20} MiB: {verify_gbs:.2f} GB/s, "
            f"{1e3 * 2 * chunk / verify_gbs / 1e9:.2f} ms a batch; memcpy {copy_gbs:.2f} GB/s; "
            f"verify/memcpy={verify_gbs / copy_gbs:.3f}"
        )
