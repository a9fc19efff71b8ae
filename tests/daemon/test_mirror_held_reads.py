"""Reads of a mirror's chunks still filling, held by the ``tcp`` data server until the
chunks are complete (`transports.tcp.held`, :mod:`refitd.daemon.mirrorhold`).

Real ``tcp`` transports on loopback: the source serves a region that a real
:class:`~refitd.daemon.mirror.Mirror` is "filling" (the test writes a chunk's bytes,
then marks it complete, as a fill does after its read returned), and the daemon's own
:class:`~refitd.daemon.mirrorhold.FillingMirrors` tells the data server which bytes
are complete.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from refitd.daemon.mirror import Mirror, cut_chunks
from refitd.daemon.mirrorhold import FillingMirrors
from refitd.wire import RegionInfo, RegionKind
from transports.interface import PeerInfo, PullFailed, ReadRefused
from transports.segments import SharedSegment
from transports.tcp import TcpPeer, TcpTransport
from transports.tcp.frames import READ_ROW, scope_key
from transports.tcp.held import MAX_HELD_PER_ADDRESS

pytestmark = pytest.mark.timeout(120)

SECRET = b"held-reads-secret-0123456789abcdef"
MIB = 1 << 20
SIZE = 4 * MIB  # four chunks of 1 MiB
SOURCE_REGION, SERVED, LOCAL = 7, 1, 2
LEASE = "lease-1"
SHORT_HOLD_S = 0.5
"""The data server's hold in the test of a chunk that never completes."""
SAFETY_S = 30.0
"""How long a test waits for a read to be held before it fails."""


@dataclass
class Filling:
    source: TcpTransport
    peer: TcpPeer
    mirror: Mirror
    filling: FillingMirrors
    src: SharedSegment
    dst: SharedSegment
    live: set[str]

    def complete(self, chunk: int, fill: int) -> None:
        """Write chunk ``chunk``'s bytes, then mark it complete (as a fill does)."""
        self.src.numpy()[chunk * MIB : (chunk + 1) * MIB] = fill
        self.mirror.mark(np.array([chunk]))
        self.filling.changed()

    async def held(self, n: int = 1) -> None:
        """Return once ``n`` reads are held (a count the server's threads keep)."""
        async with asyncio.timeout(SAFETY_S):
            while self.source.server.holds.held < n:  # noqa: ASYNC110
                await asyncio.sleep(0.01)


def grant(info: PeerInfo, extents: list[tuple[int, int]]) -> PeerInfo:
    regions = tuple(msgspec.structs.replace(r, key=scope_key(LEASE, extents)) for r in info.regions)
    return msgspec.structs.replace(info, regions=regions, mac=b"").signed(SECRET)


@pytest.fixture
async def filling() -> AsyncIterator[Filling]:
    live = {LEASE}
    m = Mirror("http://source", "m", 1)
    m.regions = {SOURCE_REGION: RegionInfo(SERVED, RegionKind.SHM, "", SIZE, 0)}
    m.chunks = cut_chunks({SOURCE_REGION: [(0, SIZE)]}, MIB)
    m.done = np.zeros(len(m.chunks), dtype=bool)
    f = FillingMirrors()
    f.add(m)
    with SharedSegment.create(SIZE, "src") as src, SharedSegment.create(SIZE, "dst") as dst:
        async with (
            TcpTransport(secret=SECRET, authorize=live.__contains__, require_lease=True) as source,
            TcpTransport(secret=SECRET) as puller,
        ):
            source.hold_reads(f)
            await source.register(SERVED, src)
            await puller.register(LOCAL, dst)
            peer = await puller.connect(grant(source.advertise(), [(0, SIZE)]))
            yield Filling(source, peer, m, f, src, dst, live)
            await peer.close()


def chunk_read(chunk: int) -> list[tuple[int, int, int, int, int]]:
    return [(LOCAL, chunk * MIB, SERVED, chunk * MIB, MIB)]


async def test_a_read_of_a_chunk_still_filling_is_held_and_answered_with_its_bytes_once_complete(
    filling: Filling,
) -> None:
    read = asyncio.create_task(filling.peer.get(chunk_read(1)))
    await filling.held()
    assert not read.done()
    filling.complete(1, 0x5A)
    await read
    assert (filling.dst.numpy()[MIB : 2 * MIB] == 0x5A).all()
    # a complete chunk is answered at once, nothing held
    filling.complete(0, 0x33)
    await filling.peer.get(chunk_read(0))
    assert (filling.dst.numpy()[:MIB] == 0x33).all()
    assert filling.source.server.holds.held == 0


async def test_a_held_read_whose_chunk_never_completes_is_refused_after_the_hold_and_the_connection_serves_on(
    filling: Filling,
) -> None:
    filling.source.server.holds.hold_s = SHORT_HOLD_S
    filling.dst.numpy()[:] = 0xA5
    with pytest.raises(PullFailed, match="still filling"):
        await filling.peer.get(chunk_read(2))
    assert (filling.dst.numpy() == 0xA5).all()  # not a byte of it landed
    filling.complete(2, 0x11)
    await filling.peer.get(chunk_read(2))
    assert (filling.dst.numpy()[2 * MIB : 3 * MIB] == 0x11).all()


async def test_a_held_read_of_a_mirror_that_fails_is_refused_with_its_error(
    filling: Filling,
) -> None:
    read = asyncio.create_task(filling.peer.get(chunk_read(3)))
    await filling.held()
    filling.mirror.error = "its source died"
    filling.filling.changed()
    with pytest.raises(PullFailed, match="failed: its source died"):
        await read
    filling.mirror.mark(np.arange(4))  # a failed mirror's bytes are never served
    with pytest.raises(PullFailed, match="failed: its source died"):
        await filling.peer.get(chunk_read(0))


async def test_a_read_held_while_its_lease_ended_is_refused_when_its_chunk_completes(
    filling: Filling,
) -> None:
    read = asyncio.create_task(filling.peer.get(chunk_read(1)))
    await filling.held()
    filling.live.clear()  # the lease ended at the source while the read waited
    filling.complete(1, 0x77)
    with pytest.raises(PullFailed, match=f"lease '{LEASE}' is no longer live"):
        await read


async def test_a_read_outside_its_grant_is_refused_at_once_not_held(filling: Filling) -> None:
    narrow = await filling.peer.scoped(grant(filling.source.advertise(), [(0, MIB)]))
    with pytest.raises(ReadRefused, match="outside what the record's lease may read"):
        await narrow.get(chunk_read(1))
    assert filling.source.server.holds.held == 0


async def test_one_peer_address_holds_a_bounded_number_of_reads_the_next_is_refused(
    filling: Filling,
) -> None:
    holds = filling.source.server.holds
    rows = np.array([(SERVED, MIB, MIB)], dtype=READ_ROW)
    answers: list[str | None] = []
    threads = [
        threading.Thread(target=lambda: answers.append(holds.wait(rows, "peer")))
        for _ in range(MAX_HELD_PER_ADDRESS)
    ]
    for t in threads:
        t.start()
    await filling.held(MAX_HELD_PER_ADDRESS)
    why = holds.wait(rows, "peer")
    assert why is not None and f"at most {MAX_HELD_PER_ADDRESS}" in why
    filling.complete(1, 0x01)
    for t in threads:
        await asyncio.to_thread(t.join, SAFETY_S)
    assert answers == [None] * MAX_HELD_PER_ADDRESS
