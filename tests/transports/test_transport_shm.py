"""The ``shm`` transport refuses, before mapping anything, a peer it cannot prove is
on this host reading these very files."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from refitd.errors import ProtocolError, TransportError
from transports.interface import LeaseScope, PeerInfo, ReadRefused
from transports.local import copy_addresses
from transports.segments import SHM_DIR, SharedSegment
from transports.shm import SegmentKey, ShmTransport

SECRET = b"samehost-secret-0123456789"


@contextlib.asynccontextmanager
async def _source_of(src: SharedSegment) -> AsyncIterator[tuple[ShmTransport, PeerInfo]]:
    """A started puller, and the record of a started source that registered ``src``."""
    async with (
        ShmTransport(secret=SECRET) as puller,
        ShmTransport(secret=SECRET) as source,
    ):
        await source.register(1, src)
        yield puller, source.advertise()


async def test_a_record_from_another_kernel_boot_is_refused_at_connect() -> None:
    with SharedSegment.create(4096, "src") as src:
        async with _source_of(src) as (puller, info):
            other = msgspec.structs.replace(
                info, address=b"00000000-another-boot:" + info.address.split(b":")[1]
            ).signed(SECRET)
            with pytest.raises(TransportError, match="another kernel"):
                await puller.connect(other)


async def test_a_segment_name_that_now_maps_another_file_is_refused_at_connect() -> None:
    with SharedSegment.create(4096, "src") as src:
        async with _source_of(src) as (puller, info):
            # Same name, another file (what a separate /dev/shm would show).
            os.unlink(SHM_DIR / src.name)
            fd = os.open(SHM_DIR / src.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
            try:
                with pytest.raises(TransportError, match=r"region 1 .*another file"):
                    await puller.connect(info)
            finally:
                os.unlink(SHM_DIR / src.name)


def _record(source_info: PeerInfo, keep: set[int]) -> PeerInfo:
    """``source_info`` listing only the regions in ``keep``, signed again."""
    regions = tuple(r for r in source_info.regions if r.region_id in keep)
    return msgspec.structs.replace(source_info, regions=regions).signed(SECRET)


@contextlib.asynccontextmanager
async def _two_regions(sizes: tuple[int, int]) -> AsyncIterator[tuple[ShmTransport, ShmTransport]]:
    """A started puller with region 9 (4096 bytes), and a started source of this
    host's life 7 with regions 1 and 2 of ``sizes`` bytes, filled with 1 and 2."""
    with contextlib.ExitStack() as stack:
        segs = [stack.enter_context(SharedSegment.create(n, f"r{i}")) for i, n in enumerate(sizes)]
        dst = stack.enter_context(SharedSegment.create(4096, "dst"))
        async with (
            ShmTransport(secret=SECRET) as puller,
            ShmTransport(secret=SECRET, incarnation=7) as source,
        ):
            for rid, seg in enumerate(segs, start=1):
                seg.numpy()[:] = rid
                await source.register(rid, seg)
            await puller.register(9, dst)
            yield puller, source


async def test_a_grant_lists_the_scoped_regions_keyed_to_the_lease_and_reads_only_their_ranges() -> (
    None
):
    """The source makes a lease's grant itself: the scope's regions as it registered
    them, each keyed to the lease and its byte ranges, signed. A connection made with
    it maps the region whole but reads nothing outside those ranges (before, a
    same-host record named whole regions, and the ranges were the daemon's alone)."""
    async with _two_regions((4096, 2048)) as (puller, source):
        advert = source.advertise()
        assert advert.address.endswith(b":7")  # the source's life, not its pid
        grant = source.grant(LeaseScope("lease", {2: [(0, 1024), (1536, 2048)]}))
        grant.verify(SECRET)
        (listed,) = grant.regions
        (whole,) = (r for r in advert.regions if r.region_id == 2)
        assert (listed.region_id, listed.generation, listed.size) == (2, whole.generation, 2048)
        key = SegmentKey.decode(listed.key)
        assert key[:3] == SegmentKey.decode(whole.key)[:3]  # the very file advertised
        assert (key.lease, key.extents) == ("lease", [(0, 1024), (1536, 2048)])
        assert grant.address == advert.address
        async with await puller.connect(grant) as peer:
            await peer.get([(9, 0, 2, 0, 1024), (9, 1536, 2, 1536, 512)])
            dst = puller.regions[9].segment.numpy()
            assert (dst[:1024] == 2).all() and (dst[1536:2048] == 2).all()
            with pytest.raises(ReadRefused, match="remote region 1 is not in"):
                await peer.get([(9, 0, 1, 0, 16)])  # region 1 is not in the lease's scope
            dst[:] = 0
            for outside in ((1023, 2), (1024, 512), (1535, 2)):
                with pytest.raises(ReadRefused, match="outside what lease 'lease' was granted"):
                    await peer.get([(9, 0, 2, 0, 16), (9, 16, 2, *outside)])
            assert not dst.any()  # a refused batch reads nothing, not even its good reads
            await peer.get([(9, 0, 2, 1200, 0)])  # no byte: the daemon's rule, too


async def test_a_grant_names_only_regions_mapped_here_and_a_reader_refuses_one_short_of_its_scope() -> (
    None
):
    """A region with no segment here (not registered, or no host memory) is in no
    grant; a reader checks the grant it is given names every region its pull reads
    (``check_grant``: it makes nothing), refusing, naming them, one that does not."""
    async with _two_regions((4096, 4096)) as (puller, source):
        grant = source.grant(LeaseScope("lease", {1: [(0, 4096)], 5: [(0, 16)]}))
        assert [r.region_id for r in grant.regions] == [1]
        puller.check_grant(grant, LeaseScope("lease", {1: [(0, 4096)]}))
        with pytest.raises(TransportError, match=r"region\(s\) \[2\] .* do not map here"):
            puller.check_grant(grant, LeaseScope("lease", {1: [], 2: []}))
        tcp_grant = msgspec.structs.replace(grant, scheme="tcp")
        with pytest.raises(ProtocolError, match=r"record of .* is for scheme 'tcp'"):
            puller.check_grant(tcp_grant, LeaseScope("lease", {1: []}))
        # the advertisement is no lease's grant
        with pytest.raises(ProtocolError, match="granted to lease '', not 'lease'"):
            puller.check_grant(source.advertise(), LeaseScope("lease", {1: []}))


async def test_an_update_keeps_the_mappings_of_unchanged_regions_and_maps_only_new_ones() -> None:
    with (
        SharedSegment.create(4096, "a") as a,
        SharedSegment.create(4096, "b") as b,
        SharedSegment.create(4096, "dst") as dst,
    ):
        async with (
            ShmTransport(secret=SECRET) as puller,
            ShmTransport(secret=SECRET) as source,
        ):
            await source.register(1, a)
            await source.register(2, b)
            await puller.register(9, dst)
            full = source.advertise()
            async with await puller.connect(_record(full, {1})) as peer:
                assert puller.maps_made == 1
                await peer.update(_record(full, {1}))
                await peer.update(full)
                assert puller.maps_made == 2  # only region 2 was mapped anew
                b.numpy()[:] = 6
                await peer.get([(9, 0, 2, 0, 4096)])
                assert (dst.numpy() == 6).all()
            # A later connection (the next pull) maps nothing again.
            async with await puller.connect(full) as again:
                await again.get([(9, 0, 1, 0, 16)])
            assert puller.maps_made == 2 and puller.mapped == 2


async def test_unused_mappings_are_kept_up_to_the_bound_and_held_ones_never_unmapped() -> None:
    with contextlib.ExitStack() as stack:
        segs = [stack.enter_context(SharedSegment.create(4096, f"s{i}")) for i in range(3)]
        dst = stack.enter_context(SharedSegment.create(4096, "dst"))
        async with (
            ShmTransport(secret=SECRET, max_mappings=1) as puller,
            ShmTransport(secret=SECRET) as source,
        ):
            for i, seg in enumerate(segs):
                seg.numpy()[:] = i + 1
                await source.register(i, seg)
            await puller.register(9, dst)
            async with await puller.connect(source.advertise()) as peer:
                assert puller.mapped == 3  # all held by the open peer, past the bound
                for i in range(3):
                    await peer.get([(9, 0, i, 0, 4096)])
                    assert (dst.numpy() == i + 1).all()
            assert puller.mapped == 1  # unused now: the bound applies


async def test_a_mapping_an_update_drops_stays_mapped_until_the_read_in_flight_lands() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    class Gated:
        async def copy(
            self,
            dst: npt.NDArray[np.int64],
            src: npt.NDArray[np.int64],
            nbytes: npt.NDArray[np.int64],
        ) -> None:
            entered.set()
            await gate.wait()
            await copy_addresses(dst, src, nbytes, threads=1, pool=None)

    with (
        SharedSegment.create(1 << 20, "a") as a,
        SharedSegment.create(4096, "b") as b,
        SharedSegment.create(1 << 20, "dst") as dst,
    ):
        a.numpy()[:] = 3
        async with (
            ShmTransport(secret=SECRET, copier=Gated(), max_mappings=0) as puller,
            ShmTransport(secret=SECRET) as source,
        ):
            await source.register(1, a)
            await source.register(2, b)
            await puller.register(9, dst)
            full = source.advertise()
            async with await puller.connect(full) as peer:
                read = asyncio.create_task(peer.get([(9, 0, 1, 0, 1 << 20)]))
                await entered.wait()
                await peer.update(_record(full, {2}))  # region 1 no longer listed
                assert puller.mapped == 2  # ... but the read in flight still holds it
                gate.set()
                await read
                assert (dst.numpy() == 3).all()
                assert puller.mapped == 1  # let go once the read landed (bound 0)


async def test_a_loopback_connection_reads_between_the_transports_own_regions() -> None:
    with SharedSegment.create(4096, "a") as a, SharedSegment.create(4096, "dst") as dst:
        a.numpy()[:] = 8
        async with ShmTransport(secret=SECRET) as t:
            await t.register(1, a)
            peer = t.loopback()
            # A region registered after the connection was made is readable too.
            await t.register(2, dst)
            await peer.get([(2, 0, 1, 0, 4096)])
            assert (dst.numpy() == 8).all() and t.maps_made == 0
            with pytest.raises(ReadRefused, match="remote region 3"):
                await peer.get([(2, 0, 3, 0, 16)])


async def test_a_cancelled_threaded_copy_returns_only_once_its_threads_finished() -> None:
    n = 256 << 20
    src = np.full(n, 5, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    with ThreadPoolExecutor(2) as pool:
        task = asyncio.create_task(
            copy_addresses(
                np.array([dst.ctypes.data], np.int64),
                np.array([src.ctypes.data], np.int64),
                np.array([n], np.int64),
                threads=2,
                pool=pool,
            )
        )
        await asyncio.sleep(0)  # the shares are in the threads now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Nothing writes any more once the cancelled copy returned: the memory may go.
        assert (dst == 5).all()
