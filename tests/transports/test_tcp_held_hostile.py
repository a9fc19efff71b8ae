"""Held reads of the ``tcp`` data server, attacked by a misbehaving peer (issue 36's
standard: fail closed).

A read of a mirror's chunk still filling is held until the chunk is complete
(`transports.tcp.held`). Here a peer that proved the deployment secret holds reads on
many connections at once, and the memory a held read names is deleted, or replaced
under the same region id, while it waits. Nothing a held read answers may come from
memory other than what its grant named when it was checked.

Who can reach the data server at all (only trusted peers' hosts, and of this host
only the daemon's uid and root) is pinned in ``tests/transports/test_tcp_admission.py``.

Real ``tcp`` transports on loopback, a real :class:`~refitd.daemon.mirror.chunks.Mirror`
whose chunks the test completes, and the daemon's own
:class:`~refitd.daemon.mirror.hold.FillingMirrors` (:func:`support.heldreads.held_reads`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from support.heldreads import MIB, SERVED, HeldReads, chunk_read, held_reads

from transports.interface import PullFailed
from transports.segments import SharedSegment
from transports.tcp.held import MAX_HELD_PER_ADDRESS

pytestmark = pytest.mark.timeout(180)

SIZE = 2 * MIB  # two chunks of 1 MiB
SAFETY_S = 60.0
"""How long a test waits for reads to be held (or answered) before it fails."""
LONG_HOLD_S = 600.0
"""A hold longer than any test runs: a read refused must be refused by a check, not
by its hold running out."""


@pytest.fixture
async def source() -> AsyncIterator[HeldReads]:
    """The data server, holding a read for :data:`LONG_HOLD_S` at most, and a puller
    whose every connection is one lane."""
    async with held_reads(SIZE, lanes=1, hold_s=LONG_HOLD_S, safety_s=SAFETY_S) as reads:
        yield reads


async def test_one_peer_holds_at_most_the_bound_whatever_number_of_connections_it_opens(
    source: HeldReads,
) -> None:
    """A peer opens one connection more than the per-address bound and sends a read of
    a chunk still filling on each: the bound's worth are held, the one past it is
    refused at once, naming the bound; once the chunk completes every held read gets
    its bytes, and nothing stays held."""
    peers = [await source.connect() for _ in range(MAX_HELD_PER_ADDRESS + 1)]
    try:
        reads = [asyncio.ensure_future(p.get(chunk_read(1))) for p in peers[:-1]]
        await source.held(MAX_HELD_PER_ADDRESS)
        with pytest.raises(PullFailed, match=f"at most {MAX_HELD_PER_ADDRESS}"):
            await peers[-1].get(chunk_read(1))
        assert not any(r.done() for r in reads)
        source.complete(1, 0x3C)
        async with asyncio.timeout(SAFETY_S):
            await asyncio.gather(*reads)
        assert (source.dst.numpy()[MIB:] == 0x3C).all()
        assert source.server.server.holds.held == 0
    finally:
        for p in peers:
            with contextlib.suppress(Exception):
                await p.close()


async def test_a_read_held_while_its_region_is_deleted_is_refused_when_its_chunk_completes(
    source: HeldReads,
) -> None:
    """The mirror's region is deleted here while a read of it waits (its mirror
    released): the read is refused by the check after the hold, not sent from memory
    the server no longer serves."""
    source.dst.numpy()[:] = 0xA5
    peer = await source.connect()
    read = asyncio.ensure_future(peer.get(chunk_read(0)))
    await source.held(1)
    await source.server.deregister(SERVED)
    source.complete(0, 0x42)
    with pytest.raises(PullFailed, match="refused by the source"):
        async with asyncio.timeout(SAFETY_S):
            await read
    assert (source.dst.numpy() == 0xA5).all()


async def test_a_read_held_while_its_region_id_is_given_to_other_memory_gets_none_of_its_bytes(
    source: HeldReads,
) -> None:
    """The region id a held read names is registered again over another segment (the
    memory a new version, or another tenant's region, could be) while it waits: the
    grant names the old registration's generation, so the read is refused after the
    hold, and not a byte of the new memory reaches the reader."""
    source.dst.numpy()[:] = 0xA5
    peer = await source.connect()
    read = asyncio.ensure_future(peer.get(chunk_read(1)))
    await source.held(1)
    with SharedSegment.create(SIZE, "other") as other:
        other.numpy()[:] = 0xEE  # another version's (or tenant's) bytes
        await source.server.deregister(SERVED)
        await source.server.register(SERVED, other)
        source.complete(1, 0x42)
        with pytest.raises(PullFailed, match="refused by the source"):
            async with asyncio.timeout(SAFETY_S):
                await read
        assert (source.dst.numpy() == 0xA5).all()
        await source.server.deregister(SERVED)
