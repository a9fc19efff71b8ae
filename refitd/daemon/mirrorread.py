"""Reading a host mirror's chunks from a holder, the deadlines a holder has, and the
source an engine's pull served from a mirror reads (:class:`MirroredSource`).

The source (the last holder a mirror reads from) has the whole pull deadline
(``data_plane.pull_timeout_s``). A relay, a holder that is not the source, has
``RELAY_ANSWER_S`` to answer a request and a batch of chunks that time plus its bytes
at ``RELAY_FLOOR_BYTES_S``: a holder that does not answer is skipped in time
proportional to a piece, not a pull's deadline, and its lanes are cut so no late byte
of the batch lands. A chunk is marked complete only once the read that filled it
returned (:meth:`refitd.daemon.mirror.Mirror.mark`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from refitd.daemon.mirror import Mirror
from refitd.daemon.pulls import LocalSource, RemoteSource
from refitd.wire import PullRequest
from transports.batch import rows_as_batch
from transports.interface import Peer
from transports.tcp import TcpGrant, TcpPeer

if TYPE_CHECKING:
    from refitd.daemon.node import Daemon

__all__ = [
    "BATCH_CHUNKS",
    "RELAY_ANSWER_S",
    "RELAY_FLOOR_BYTES_S",
    "MirroredSource",
    "answer_s",
    "cut",
    "piece_s",
    "read_chunks",
]

BATCH_CHUNKS = 2
"""Chunks per read handed to the data plane at once (two batches in flight): small,
so a downstream relay sees chunks complete soon after they land."""

RELAY_ANSWER_S = 10.0
"""How long a relay (a holder that is not the source) has to answer a request (a lease,
its records, its progress past the long-poll's wait), s: one that does not is skipped
for the next holder. Capped by ``data_plane.pull_timeout_s``."""

RELAY_FLOOR_BYTES_S = 16 << 20
"""The slowest a relay may send, bytes/s: a batch of chunks read from a relay has
``RELAY_ANSWER_S`` plus its bytes at this rate, then the relay is skipped (and its
lanes cut, so nothing more of that batch lands). 16 MiB/s is 134 Mbit/s."""


def answer_s(pull_timeout_s: float) -> float:
    """How long a relay has to answer one request, s."""
    return min(RELAY_ANSWER_S, pull_timeout_s)


def piece_s(nbytes: int, pull_timeout_s: float) -> float:
    """The deadline of reading ``nbytes`` from a relay, s."""
    return min(RELAY_ANSWER_S + nbytes / RELAY_FLOOR_BYTES_S, pull_timeout_s)


def cut(conn: Peer) -> None:
    """Break the lanes of a ``tcp`` connection to a relay that missed its deadline: a
    lane blocked on it wakes with an error, and no late byte lands."""
    base = conn.base if isinstance(conn, TcpGrant) else conn
    if isinstance(base, TcpPeer):
        for lane in base.lanes:
            lane.cut()


async def read_chunks(
    m: Mirror,
    conn: Peer,
    todo: np.ndarray,
    their: dict[int, int] | None,
    pull_timeout_s: float,
) -> None:
    """Read chunks ``todo`` of ``m`` through ``conn``, ``BATCH_CHUNKS`` a read, two reads
    in flight. ``their`` maps source region ids to the holder's (None: the holder is
    the source, which has the whole pull deadline; a relay has a piece's)."""
    window = asyncio.Semaphore(2)
    local = {s: r.region_id for s, r in m.regions.items()}

    async def move(idx: np.ndarray) -> None:
        try:
            c = m.chunks[idx]
            rows = np.empty((len(idx), 5), dtype=np.int64)
            rows[:, 0] = [their[s] if their else s for s in c[:, 0].tolist()]
            rows[:, 1] = c[:, 1]
            rows[:, 2] = [local[s] for s in c[:, 0].tolist()]
            rows[:, 3] = c[:, 1]
            rows[:, 4] = c[:, 2]
            if their is None:
                async with asyncio.timeout(pull_timeout_s):
                    await conn.get(rows_as_batch(rows))
            else:
                try:
                    async with asyncio.timeout(piece_s(int(c[:, 2].sum()), pull_timeout_s)):
                        await conn.get(rows_as_batch(rows))
                except TimeoutError:
                    cut(conn)  # nothing more of this batch lands from that relay
                    raise
            m.mark(idx)  # only now: a failed read leaves its chunks incomplete
        finally:
            window.release()

    try:
        async with asyncio.TaskGroup() as tg:
            for lo in range(0, len(todo), BATCH_CHUNKS):
                await window.acquire()
                tg.create_task(move(todo[lo : lo + BATCH_CHUNKS]))
    except BaseExceptionGroup as group:
        first = next((e for e in group.exceptions if isinstance(e, Exception)), None)
        if first is None:
            raise
        raise first from None


class MirroredSource(LocalSource):
    """This daemon's mirror as the source of a pull an engine asked of a remote source:
    read here, under this daemon's lease, and bound by the engine's own lease at the
    remote source as a direct pull is. Every lease check of the pull (at submit, and
    after its last byte, before it may end ``done``) checks both, so a pull served from
    a mirror fails when the engine's lease ended at the source, as a direct one does."""

    def __init__(self, daemon: Daemon, remote: RemoteSource, engine: PullRequest) -> None:
        super().__init__(daemon)
        self.remote = remote
        self.engine = engine

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        await super().check_lease(lease_id, model, version)
        e = self.engine
        await self.remote.check_lease(e.lease_id, e.model, e.version)
