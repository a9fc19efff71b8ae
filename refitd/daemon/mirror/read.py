"""Reading a host mirror's chunks from a holder, the deadlines a holder has, and the
source an engine's pull served from a mirror reads (:class:`MirroredSource`).

Every read goes through the daemon's one byte loop (:func:`refitd.daemon.pull.move.move`)
as a :class:`~refitd.daemon.pull.pulls.PullJob`: a mirror's fill from a holder is listed in
``/v1/pulls`` and counted in ``/metrics`` like any pull, by the path it took.

The source (the last holder a mirror reads from) has the whole pull deadline
(``data_plane.pull_timeout_s``). A relay, a holder that is not the source, has
``RELAY_ANSWER_S`` to answer a request and a batch of chunks that time plus its bytes
at ``RELAY_FLOOR_BYTES_S``: a holder that does not answer is skipped in time
proportional to a piece, not a pull's deadline, and its lanes are cut so no late byte
of the batch lands. A chunk is marked complete only once the read that filled it
returned (:meth:`refitd.daemon.mirror.chunks.Mirror.mark`).

An engine's pull served from a mirror still filling reads each piece as soon as its
chunk is complete (:class:`MirrorGate`), never before: the same lease and scope rules
as a pull from a complete one, the pieces in the order the mirror fills.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.daemon.mirror.chunks import Mirror, chunk_reads
from refitd.daemon.pull import core as pullcore
from refitd.daemon.pull.move import move
from refitd.daemon.pull.pulls import PullManager
from refitd.daemon.pull.sources import Filling, Gated, RemoteSource, Source
from refitd.wire import DescriptorTable, PackSpec, PeerRegions, PullRequest, StagedPack
from transports.batch import ReadBatch, rows_as_batch
from transports.interface import Peer, PeerInfo

if TYPE_CHECKING:
    from refitd.daemon.state.registry import Registry

__all__ = [
    "BATCH_CHUNKS",
    "RELAY_ANSWER_S",
    "RELAY_FLOOR_BYTES_S",
    "MirrorGate",
    "MirroredSource",
    "Regranted",
    "answer_s",
    "fill_chunks",
    "piece_s",
]

BATCH_CHUNKS = 2
"""Chunks per read handed to the data plane at once: small, so a downstream relay
sees chunks complete soon after they land."""

FILL_IN_FLIGHT_BYTES = 16 << 20
"""Bytes a fill keeps in flight (in batches of ``BATCH_CHUNKS`` chunks): enough to
keep a link's lanes busy through the round trips of each batch."""

RELAY_ANSWER_S = 10.0
"""How long a relay (a holder that is not the source) has to answer a request (a lease,
its records, its feed between two frames), s: one that does not is skipped for the
next holder. Capped by ``data_plane.pull_timeout_s``."""

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


class Regranted(Peer):
    """A connection whose grant grows while it is read: each read goes through the
    newest connection :meth:`swap` gave (a relay's feed widens the scope its records
    give as chunks complete there)."""

    def __init__(self, conn: Peer) -> None:
        self.current = conn
        self.info = conn.info

    def swap(self, conn: Peer) -> None:
        self.current = conn
        self.info = conn.info

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        await self.current.get(batch)

    async def update(self, info: PeerInfo) -> None:
        await self.current.update(info)

    async def close(self) -> None:
        await self.current.close()

    def cut(self) -> None:
        self.current.cut()


async def fill_chunks(
    m: Mirror,
    pulls: PullManager,
    conn: Peer,
    path: str,
    todo: np.ndarray,
    *,
    holder: str,
    lease_id: str,
    owner: str,
    their: dict[int, int] | None,
    pull_timeout_s: float,
    ready: Callable[[np.ndarray], Awaitable[None]] | None = None,
    landed: Callable[[], None] = lambda: None,
    check: Callable[[np.ndarray], Awaitable[None]] | None = None,
    in_flight_bytes: int = FILL_IN_FLIGHT_BYTES,
) -> None:
    """Read chunks ``todo`` of ``m`` (in that order) from the holder at ``holder``
    through ``conn`` (on ``path``), ``BATCH_CHUNKS`` a batch, as one job of
    ``owner`` in ``pulls``. ``their`` maps source region ids to the holder's (None:
    the holder is the source, which has the whole pull deadline; a relay has a
    piece's). ``ready(chunks)`` returns once the holder serves those chunks;
    ``check(chunks)`` checks their bytes once read (raising fails the fill, nothing
    marked); ``landed()`` is called after chunks were marked complete."""
    local = {s: r.region_id for s, r in m.regions.items()}
    c = m.chunks[todo]
    rows = np.empty((len(todo), 5), dtype=np.int64)
    rows[:, 0] = [their[s] if their else s for s in c[:, 0].tolist()]
    rows[:, 1] = c[:, 1]
    rows[:, 2] = [local[s] for s in c[:, 0].tolist()]
    rows[:, 3] = c[:, 1]
    rows[:, 4] = c[:, 2]
    req = PullRequest(m.model, m.version, lease_id, DescriptorTable.pack(rows), [], holder)
    spans = [(lo, min(lo + BATCH_CHUNKS, len(todo))) for lo in range(0, len(todo), BATCH_CHUNKS)]

    def deadline(nbytes: int) -> float:
        return pull_timeout_s if their is None else piece_s(nbytes, pull_timeout_s)

    async def gate(lo: int, hi: int) -> None:
        assert ready is not None
        await ready(todo[lo:hi])

    async def checked(lo: int, hi: int) -> None:
        assert check is not None
        await check(todo[lo:hi])

    def mark(lo: int, hi: int) -> None:
        m.mark(todo[lo:hi])  # only now: after the read returned
        m.reads[holder] = m.reads.get(holder, 0) + hi - lo
        landed()

    with pulls.tracked(req, owner, path, int(c[:, 2].sum()), holder) as job:
        await move(
            job,
            conn,
            rows_as_batch(rows),
            np.ones(len(todo), dtype=np.int64),
            spans,
            in_flight=max(1, in_flight_bytes // max(1, BATCH_CHUNKS * int(c[:, 2].max(initial=1)))),
            ready=gate if ready is not None else None,
            landed=mark,
            deadline_s=deadline,
            late=None if their is None else conn.cut,
            check=None if check is None else checked,
        )


class MirrorGate:
    """The reads of an engine's pull from mirror ``m`` while it fills
    (:class:`~refitd.daemon.pull.pulls.Filling`): cut at its chunks' edges, in the order it
    fills them, each span read once its chunks are complete."""

    def __init__(self, m: Mirror) -> None:
        self.m = m

    def gated(self, rows: np.ndarray, done: np.ndarray | None, batch_reads: int) -> Gated:
        m = self.m
        local = {s: r.region_id for s, r in m.regions.items()}
        chunks = m.chunks.copy()
        chunks[:, 0] = [local[s] for s in chunks[:, 0].tolist()]
        by_key = np.lexsort((chunks[:, 1], chunks[:, 0]))  # local ids may sort otherwise
        cut_rows, ends, k = chunk_reads(rows, chunks[by_key], done)
        fill = by_key[k]  # the mirror's own chunk index of each read
        order = np.argsort(fill, kind="stable")
        cut_rows, ends, fill = cut_rows[order], ends[order], fill[order]
        per_span = BATCH_CHUNKS * int(m.chunks[:, 2].max(initial=1))
        spans = pullcore.spans(cut_rows[:, 4], batch_reads, per_span)

        async def ready(lo: int, hi: int) -> None:
            await m.wait_chunks(np.unique(fill[lo:hi]))

        return rows_as_batch(cut_rows), ends, spans, ready

    async def complete(self) -> None:
        await self.m.wait_chunks(np.arange(len(self.m.chunks)))


class MirroredSource:
    """This daemon's mirror as the source of a pull an engine asked of a remote source:
    read here (``local``: this daemon as the source of its own pulls), under this
    daemon's lease, and bound by the engine's own lease at the
    remote source as a direct pull is. Every lease check of the pull (at submit, and
    after its last byte, before it may end ``done``) checks both, so a pull served from
    a mirror fails when the engine's lease ended at the source, as a direct one does.

    While the mirror fills, the pull is checked against the whole version's scope (what
    its lease will read, from ``registry``) and reads each piece once its chunk is
    complete (``filling``); the data server still serves other daemons only complete
    chunks."""

    filling: Filling | None

    def __init__(
        self,
        local: Source,
        registry: Registry,
        remote: RemoteSource,
        engine: PullRequest,
        m: Mirror,
    ) -> None:
        self.local = local
        self.registry = registry
        self.remote = remote
        self.engine = engine
        self.filling = None if m.complete else MirrorGate(m)

    def loopback(self) -> Peer | None:
        return self.local.loopback()

    def own(self, ids: list[int]) -> set[int]:
        return self.local.own(ids)

    def granted(self, req: PullRequest) -> PeerRegions | None:
        return self.local.granted(req)

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        await self.local.check_lease(lease_id, model, version)
        e = self.engine
        await self.remote.check_lease(e.lease_id, e.model, e.version)

    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        rec = await self.local.regions(ids, req)
        if self.filling is None:
            return rec
        whole = self.registry.scope(req.model, req.version)
        scope = {i: whole.get(i, ext) for i, ext in rec.scope.items()}  # staging: as given
        return msgspec.structs.replace(rec, scope=scope)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        return await self.local.pack(model, version, lease_id, specs)

    async def drop(self, region_id: int, lease_id: str) -> None:
        await self.local.drop(region_id, lease_id)
