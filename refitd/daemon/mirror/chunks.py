"""One host mirror's state, and a source's holder book: pure, no I/O.

A :class:`Mirror` is a version of a remote source held by this daemon, cut into
chunks (:func:`chunk_bytes`); a chunk is complete only once the read that filled it
returned. The source's :class:`HolderBook` (who reads from whom) is
:mod:`refitd.daemon.mirror.book`. The I/O around
them (filling, serving, failing over) is :mod:`refitd.daemon.mirror.mirrors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from refitd.daemon.access.trust import merge_extents
from refitd.daemon.mirror.book import MAX_HOLDERS, HolderBook
from refitd.errors import ProtocolError, TransportError
from refitd.wire import RegionInfo
from refitd.wire.mirrors import MirrorState
from transports.interface import Scope

__all__ = [
    "CHUNKS_PER_VERSION",
    "CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_HOLDERS",
    "HolderBook",
    "Mirror",
    "chunk_bytes",
    "chunk_count",
    "chunk_reads",
    "covered",
    "cut_chunks",
]

CHUNK_BYTES = 1 << 20
"""The smallest chunk (bytes), the unit of completion: a relay serves a chunk only
once all of it arrived. One ``tcp`` lane piece (``transports.tcp.SLICE``), sixteen
times the size the ``tcp`` path sends and receives with no copy (64 KiB): a chunk is
never gathered through a buffer."""

MAX_CHUNK_BYTES = 16 << 20
"""The largest chunk (bytes): 134 ms at 1 Gbit/s, 13 ms at 10 Gbit/s."""

CHUNKS_PER_VERSION = 64
"""A version is cut into about this many chunks. A relay hop delays the host behind it
by about one chunk's time on the link (it serves a chunk once all of it arrived), and
the whole transfer takes the version's time on the same link, so a hop adds about
``1 / CHUNKS_PER_VERSION`` (1.6 %) of the transfer, whatever the link's rate: well
under a tenth even for a chain of six hops."""


def chunk_bytes(total: int) -> int:
    """The chunk size of a version of ``total`` bytes: ``total / CHUNKS_PER_VERSION``
    rounded down to a power of two, within ``[CHUNK_BYTES, MAX_CHUNK_BYTES]``. Every
    holder of a version cuts it the same way (the same scope, the same size)."""
    want = max(1, total // CHUNKS_PER_VERSION)
    size = 1 << (want.bit_length() - 1)
    return max(CHUNK_BYTES, min(MAX_CHUNK_BYTES, size))


# ---------------------------------------------------------------- one mirror


@dataclass
class Mirror:
    """A version of ``source`` held here. ``chunks`` rows are ``(source region,
    offset, nbytes)``; ``done`` says which are complete (set only after the read that
    filled it returned)."""

    source: str
    model: str
    version: int
    regions: dict[int, RegionInfo] = field(default_factory=dict)
    #: the source region ids of the version, known once its chunks are cut (``planned``);
    #: ``regions`` has them all only once ``ready`` (they are made one by one)
    layout: frozenset[int] = frozenset()
    chunks: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    upstream: str = ""
    error: str = ""
    tried: list[str] = field(default_factory=list)
    began_at: float = field(default_factory=time.time)
    completed_at: float = 0.0
    #: bytes of memory the mirror's regions take (counted from before they are made)
    nbytes: int = 0
    task: asyncio.Task[None] | None = None
    #: chunks read from each holder (its URL), and chunks asked again of another
    reads: dict[str, int] = field(default_factory=dict)
    reasked: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # regions exist
    #: its chunks are cut (``chunks``, ``done``): set before its regions are made
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    _tick: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return bool(self.ready.is_set() and self.done.all())

    @property
    def finished(self) -> bool:
        return self.complete or bool(self.error)

    def done_bytes(self) -> int:
        """Bytes of the complete chunks."""
        return int(self.chunks[self.done, 2].sum()) if len(self.done) else 0

    def mark(self, idx: np.ndarray) -> None:
        self.done[idx] = True
        self.notify()

    def notify(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def changed(self, timeout_s: float) -> None:
        """Return at the next change (a chunk completed, the mirror failed), or after
        ``timeout_s``."""
        tick = self._tick
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await tick.wait()

    async def wait_chunks(self, idx: np.ndarray) -> None:
        """Return once every chunk of ``idx`` is complete; :class:`TransportError`
        naming the mirror's error once it failed (they never will be)."""
        while not bool(self.done[idx].all()):
            if self.error:
                raise TransportError(
                    f"this host's mirror of {self.model!r} version {self.version} failed "
                    f"before the bytes read from it were complete: {self.error}"
                )
            await self.changed(3600.0)

    def done_extents(self) -> Scope:
        """Local region id -> the byte ranges of complete chunks."""
        rows = self.chunks[self.done]
        local = {src: r.region_id for src, r in self.regions.items()}
        return merge_extents((local[int(s)], int(o), int(o + n)) for s, o, n in rows.tolist())

    def state(self, held_bytes: int = 0, budget_bytes: int = 0) -> MirrorState:
        return MirrorState(
            self.model,
            self.version,
            self.source,
            self.upstream,
            {s: r.region_id for s, r in self.regions.items()},
            int(self.done.size),
            int(self.done.sum()),
            self.complete,
            self.error,
            list(self.tried),
            self.began_at,
            self.completed_at,
            self.nbytes,
            held_bytes,
            budget_bytes,
            dict(self.reads),
            self.reasked,
        )


def cut_chunks(scope: Scope, chunk: int | None = None) -> np.ndarray:
    """``(region, offset, nbytes)`` rows covering every range of ``scope``, each at most
    ``chunk`` bytes (default: :func:`chunk_bytes` of the scope's bytes), in region
    then offset order."""
    if chunk is None:
        chunk = chunk_bytes(sum(e - s for ext in scope.values() for s, e in ext))
    rows: list[tuple[int, int, int]] = []
    for rid in sorted(scope):
        for start, end in scope[rid]:
            for off in range(start, end, chunk):
                rows.append((rid, off, min(chunk, end - off)))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def chunk_count(scope: Scope) -> int:
    """How many rows :func:`cut_chunks` cuts ``scope`` into, counted, not cut."""
    chunk = chunk_bytes(sum(e - s for ext in scope.values() for s, e in ext))
    return sum(-(-(e - s) // chunk) for ext in scope.values() for s, e in ext)


def covered(rows: np.ndarray, scope: Scope) -> np.ndarray:
    """Which ``(region, offset, nbytes)`` rows lie wholly inside one range of ``scope``."""
    ok = np.zeros(len(rows), dtype=bool)
    for i, (rid, off, n) in enumerate(rows.tolist()):
        for start, end in scope.get(rid, []):
            if start <= off and off + n <= end:
                ok[i] = True
                break
    return ok


_SHIFT = 40
"""Offsets are below 1 TiB: ``region << _SHIFT | offset`` orders chunks and reads."""


def chunk_reads(
    rows: np.ndarray, chunks: np.ndarray, done: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wire ``rows`` cut at the boundaries of ``chunks`` (``(region, offset, nbytes)``,
    sorted, tiling what the rows read) and ordered as the chunks are: returns the cut
    rows, per row how many descriptors it ends (a row's last piece ends it, counted
    as ``done`` says, default 1), and per row the index of the chunk it reads.
    :class:`ProtocolError` for a row with bytes outside every chunk (nothing to
    wait for); a row of no bytes goes with the chunk nearest it, wherever it is."""
    n = rows.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return rows.reshape(0, 5), empty, empty
    keys = (chunks[:, 0] << _SHIFT) | chunks[:, 1]
    stops = keys + chunks[:, 2]
    start = (rows[:, 0] << _SHIFT) | rows[:, 1]
    stop = start + rows[:, 4]
    first = np.searchsorted(keys, start, side="right") - 1
    last = np.searchsorted(keys, np.maximum(start, stop - 1), side="right") - 1
    # A read of no bytes needs no chunk (a lease's scope lets it through anywhere in
    # its region, even in a gap between shards): it goes with the nearest one.
    empty = rows[:, 4] == 0
    first = np.where(empty, np.clip(first, 0, max(len(keys) - 1, 0)), first)
    last = np.where(empty, first, last)
    count = np.maximum(1, last - first + 1)
    which = np.repeat(np.arange(n), count)
    base = np.cumsum(count) - count
    k = first[which] + (np.arange(int(count.sum())) - base[which])
    if bool((k < 0).any()) or bool((k >= len(keys)).any()):
        raise ProtocolError("a read lies outside every chunk of the mirror it reads")
    lo = np.where(empty[which], start[which], np.maximum(start[which], keys[k]))
    hi = np.where(empty[which], start[which], np.minimum(stop[which], stops[k]))
    outside = (hi < lo) | (lo < keys[k]) | (hi > stops[k])
    if bool((outside & ~empty[which]).any()):
        raise ProtocolError("a read lies outside every chunk of the mirror it reads")
    # Fail closed: a read over a gap between two chunks would skip the gap's bytes
    # (a lease's scope check refuses one before this, as no extent spans a gap).
    if not np.array_equal(np.add.reduceat(hi - lo, base), rows[:, 4]):
        raise ProtocolError("a read spans bytes between two chunks of the mirror it reads")
    shift = lo - start[which]
    out = np.empty((len(k), 5), dtype=np.int64)
    out[:, 0] = rows[which, 0]
    out[:, 1] = rows[which, 1] + shift
    out[:, 2] = rows[which, 2]
    out[:, 3] = rows[which, 3] + shift
    out[:, 4] = hi - lo
    ends = np.zeros(len(k), dtype=np.int64)
    ends[np.cumsum(count) - 1] = 1 if done is None else done
    order = np.argsort(k, kind="stable")
    return out[order], ends[order], k[order]
