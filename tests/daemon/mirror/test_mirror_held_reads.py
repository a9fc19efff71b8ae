"""Reads of a mirror's chunks still filling, held by the ``tcp`` data server until the
chunks are complete (`transports.tcp.held`, :mod:`refitd.daemon.mirror.hold`).

Real ``tcp`` transports on loopback (:func:`support.heldreads.held_reads`): the source
serves a region that a real :class:`~refitd.daemon.mirror.chunks.Mirror` is "filling" (the
test writes a chunk's bytes, then marks it complete, as a fill does after its read
returned), and the daemon's own :class:`~refitd.daemon.mirror.hold.FillingMirrors`
tells the data server which bytes are complete.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest
from support.heldreads import LEASE, MIB, SERVED, HeldReads, chunk_read, held_reads

from transports.interface import PullFailed, ReadRefused
from transports.tcp import TcpPeer
from transports.tcp.frames import READ_ROW
from transports.tcp.held import MAX_HELD_PER_ADDRESS

pytestmark = pytest.mark.timeout(120)

SIZE = 4 * MIB  # four chunks of 1 MiB
SHORT_HOLD_S = 0.5
"""The data server's hold in the test of a chunk that never completes."""


@pytest.fixture
async def filling() -> AsyncIterator[HeldReads]:
    async with held_reads(SIZE) as reads:
        yield reads


@pytest.fixture
async def peer(filling: HeldReads) -> AsyncIterator[TcpPeer]:
    """One connection of the puller to the data server, under a grant of it all."""
    p = await filling.connect()
    yield p
    await p.close()


async def test_a_read_of_a_chunk_still_filling_is_held_and_answered_with_its_bytes_once_complete(
    filling: HeldReads, peer: TcpPeer
) -> None:
    read = asyncio.create_task(peer.get(chunk_read(1)))
    await filling.held()
    assert not read.done()
    filling.complete(1, 0x5A)
    await read
    assert (filling.dst.numpy()[MIB : 2 * MIB] == 0x5A).all()
    # a complete chunk is answered at once, nothing held
    filling.complete(0, 0x33)
    await peer.get(chunk_read(0))
    assert (filling.dst.numpy()[:MIB] == 0x33).all()
    assert filling.server.server.holds.held == 0


async def test_a_held_read_whose_chunk_never_completes_is_refused_after_the_hold_and_the_connection_serves_on(
    filling: HeldReads, peer: TcpPeer
) -> None:
    filling.server.server.holds.hold_s = SHORT_HOLD_S
    filling.dst.numpy()[:] = 0xA5
    with pytest.raises(PullFailed, match="still filling"):
        await peer.get(chunk_read(2))
    assert (filling.dst.numpy() == 0xA5).all()  # not a byte of it landed
    filling.complete(2, 0x11)
    await peer.get(chunk_read(2))
    assert (filling.dst.numpy()[2 * MIB : 3 * MIB] == 0x11).all()


async def test_a_held_read_of_a_mirror_that_fails_is_refused_with_its_error(
    filling: HeldReads, peer: TcpPeer
) -> None:
    read = asyncio.create_task(peer.get(chunk_read(3)))
    await filling.held()
    filling.mirror.error = "its source died"
    filling.filling.changed()
    with pytest.raises(PullFailed, match="failed: its source died"):
        await read
    filling.mirror.mark(np.arange(4))  # a failed mirror's bytes are never served
    with pytest.raises(PullFailed, match="failed: its source died"):
        await peer.get(chunk_read(0))


async def test_a_read_held_while_its_lease_ended_is_refused_when_its_chunk_completes(
    filling: HeldReads, peer: TcpPeer
) -> None:
    read = asyncio.create_task(peer.get(chunk_read(1)))
    await filling.held()
    filling.live.clear()  # the lease ended at the source while the read waited
    filling.complete(1, 0x77)
    with pytest.raises(PullFailed, match=f"lease '{LEASE}' is no longer live"):
        await read


async def test_a_read_outside_its_grant_is_refused_at_once_not_held(
    filling: HeldReads, peer: TcpPeer
) -> None:
    narrow = await peer.scoped(filling.grant([(0, MIB)]))
    with pytest.raises(ReadRefused, match="outside what the record's lease may read"):
        await narrow.get(chunk_read(1))
    assert filling.server.server.holds.held == 0


async def test_one_peer_address_holds_a_bounded_number_of_reads_the_next_is_refused(
    filling: HeldReads,
) -> None:
    holds = filling.server.server.holds
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
        await asyncio.to_thread(t.join, filling.safety_s)
    assert answers == [None] * MAX_HELD_PER_ADDRESS
