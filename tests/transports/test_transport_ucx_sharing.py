"""What pulls over ``ucx`` share, and what they must not.

Concurrent pulls sharing one ``ucx`` connection each read under their own record. A
daemon keeps one UCX connection per peer life, and every pull from that peer reads
through it under the record its own lease was given (:meth:`UcxPeer.scoped`). Two
engine ranks refitting at once each lease the version and have staging packed at the
source for their lease, so their records differ: the one fetched first lacks the
other's staging region. Real UCX and real processes; the second record is made by
registering a region at the source between two advertisements, as a pack does.

Two lives of one peer (a daemon restarted under the same node id) never share a
pulling process: closing the earlier life's connection stops its process, instead of
closing endpoints to a dead peer inside a process the new life's reads queue behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import numpy as np
import pytest

from refitd.errors import TransportError
from transports.batch import READ_DTYPE, ReadRefused
from transports.checks import LOCAL, REMOTE, fill, open_pair
from transports.segments import SharedSegment
from transports.ucx import UcxPeer, UcxTransport

pytestmark = pytest.mark.timeout(120)

SIZE = 1 << 20
STAGED = 12  # the region staged at the source for the later lease


async def test_a_pull_scoped_after_another_does_not_shrink_what_the_other_may_read() -> None:
    async with open_pair("ucx", SIZE, SIZE) as pair:
        staged = SharedSegment.create(SIZE, "staged")
        try:
            want = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
            fill(staged, want)
            first = pair.source.advertise()  # records of pull A: no staging yet
            await pair.source.register(STAGED, staged)
            second = pair.source.advertise()  # records of pull B: its staging too
            # B scopes first, then A (its records were fetched earlier, it is slower).
            b = await pair.peer.scoped(second)
            a = await pair.peer.scoped(first)
            read_staged = np.array([(LOCAL, 0, STAGED, 0, SIZE)], READ_DTYPE)
            await b.get(read_staged)
            assert np.array_equal(pair.local.numpy(), want)  # type: ignore[union-attr]
            # A reads what its own record grants, and only that.
            await a.get(np.array([(LOCAL, 0, REMOTE, 0, SIZE)], READ_DTYPE))
            assert np.array_equal(pair.local.numpy(), pair.remote.numpy())  # type: ignore[union-attr]
            with pytest.raises(ReadRefused, match=f"remote region {STAGED} is not"):
                await a.get(read_staged)
            # B, again after A's scope: still its own record.
            fill(pair.local, 0)
            await b.get(read_staged)
            assert np.array_equal(pair.local.numpy(), want)  # type: ignore[union-attr]
        finally:
            staged.close()


@contextlib.asynccontextmanager
async def two_lives() -> AsyncIterator[
    tuple[UcxTransport, UcxTransport, UcxTransport, SharedSegment]
]:
    """A puller, and two serving processes of one peer id ("trainer": its earlier
    life and its next), whose region ``REMOTE`` holds all 1s and all 2s; with the
    puller's destination region ``LOCAL``."""
    secret = b"sharing-secret-0123456789abcdef"
    async with (
        UcxTransport(secret=secret) as puller,
        UcxTransport(secret=secret, peer_id="trainer") as earlier,
        UcxTransport(secret=secret, peer_id="trainer") as later,
    ):
        dst = SharedSegment.create(SIZE, "dst")
        srcs = [SharedSegment.create(SIZE, f"src-{i}") for i in range(2)]
        try:
            await puller.register(LOCAL, dst)
            for i, (t, seg) in enumerate(zip((earlier, later), srcs, strict=True)):
                fill(seg, i + 1)
                await t.register(REMOTE, seg)
            yield puller, earlier, later, dst
        finally:
            dst.close()
            for seg in srcs:
                seg.close()


async def test_a_peer_restarted_under_its_id_is_read_by_a_new_process_and_the_old_one_stops() -> (
    None
):
    async with two_lives() as (puller, before, after, dst):
        read = np.array([(LOCAL, 0, REMOTE, 0, SIZE)], READ_DTYPE)
        old = await puller.connect(before.advertise())
        await old.get(read)
        new = await puller.connect(after.advertise())
        assert isinstance(old, UcxPeer) and isinstance(new, UcxPeer)
        old_pid = old.pid
        assert old_pid is not None and new.pid != old_pid
        await old.close()
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)
        await new.get(read)
        assert (dst.numpy() == 2).all()


async def test_a_stale_record_of_a_peers_earlier_process_does_not_repoint_the_shared_connection() -> (
    None
):
    """A pull whose record was fetched before the peer's serving process restarted
    scopes the shared connection after one with the new process's record. The
    stale record must not point the pulling child back at the earlier process: the
    other pull's reads, checked against its own record, would land there (reading
    that process's bytes, or hanging on a dead one). Both processes stay up here, so
    a read pointed wrong shows as the earlier process's bytes."""
    async with two_lives() as (puller, earlier, later, dst):
        stale, fresh = earlier.advertise(), later.advertise()
        read = np.array([(LOCAL, 0, REMOTE, 0, SIZE)], READ_DTYPE)
        conn = await puller.connect(fresh)
        b = await conn.scoped(fresh)
        a = await conn.scoped(stale)  # fetched before the restart, scoped after
        await b.get(read)
        assert (dst.numpy() == 2).all()  # the later process's bytes, as b's record says
        fill(dst, 0)
        with contextlib.suppress(TransportError):
            await a.get(read)  # its keys are void: refused, or the later process's region
        assert not (dst.numpy() == 1).any()
        await b.get(read)
        assert (dst.numpy() == 2).all()
