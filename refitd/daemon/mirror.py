"""One host mirror's state, and a source's holder book: pure, no I/O.

A :class:`Mirror` is a version of a remote source held by this daemon, cut into
chunks of ``CHUNK_BYTES``; a chunk is complete only once the read that filled it
returned. A :class:`HolderBook` is, per version a daemon is the source of, the
mirrors holding it in the order they joined: the relay pipeline. The I/O around
them (filling, serving, failing over) is :mod:`refitd.daemon.mirrors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from refitd.daemon.trust import Extents, merge_extents
from refitd.wire import RegionInfo
from refitd.wire.mirrors import HolderAssign, HolderJoin, MirrorState

__all__ = ["CHUNK_BYTES", "MAX_HOLDERS", "HolderBook", "Mirror", "covered", "cut_chunks"]

CHUNK_BYTES = 4 << 20
"""Unit of completion (bytes): a relay serves a chunk only once all of it arrived.
Small enough that a downstream host starts a few milliseconds after its upstream
(4 MiB is 34 ms at 1 Gbit/s), large enough that a batch of them fills the lanes."""


# ---------------------------------------------------------------- source side


MAX_HOLDERS = 64
"""Holders the book keeps per version: a joiner past them is told its upstream (the
last holder) but not recorded, so the book, and each answer, stay bounded."""


class HolderBook:
    """Per version this daemon is the source of, the mirrors holding it, in the order
    they joined: the pipeline. Pure state; bounded (``MAX_HOLDERS`` per version, and
    only versions the caller checked exist here, older ones of a model forgotten)."""

    def __init__(self) -> None:
        self._holders: dict[tuple[str, int], list[str]] = {}

    def join(self, j: HolderJoin) -> HolderAssign:
        """Record ``j.url`` (once) and give it the nearest holder that joined before it
        and is not excluded, or ``""`` (the source) when there is none. The holders
        ``j`` excludes (it failed to read from them) leave the book: no later joiner is
        sent to them. Entries of older versions of the model are forgotten."""
        for key in [k for k in self._holders if k[0] == j.model and k[1] < j.version]:
            del self._holders[key]
        failed = set(j.exclude) - {j.url}
        book = self._holders.setdefault((j.model, j.version), [])
        if failed:
            book[:] = [u for u in book if u not in failed]
        if j.url not in book and len(book) < MAX_HOLDERS:
            book.append(j.url)
        before = book[: book.index(j.url)] if j.url in book else book
        upstream = before[-1] if before else ""
        return HolderAssign(upstream, list(book))

    def holders(self, model: str, version: int) -> list[str]:
        return list(self._holders.get((model, version), []))


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
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # regions exist
    _tick: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return bool(self.ready.is_set() and self.done.all())

    @property
    def finished(self) -> bool:
        return self.complete or bool(self.error)

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

    async def wait_finished(self) -> None:
        while not self.finished:
            await self.changed(3600.0)

    def done_extents(self) -> dict[int, Extents]:
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
        )


def cut_chunks(scope: dict[int, Extents], chunk: int = CHUNK_BYTES) -> np.ndarray:
    """``(region, offset, nbytes)`` rows covering every range of ``scope``, each at most
    ``chunk`` bytes, in region then offset order."""
    rows: list[tuple[int, int, int]] = []
    for rid in sorted(scope):
        for start, end in scope[rid]:
            for off in range(start, end, chunk):
                rows.append((rid, off, min(chunk, end - off)))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def covered(rows: np.ndarray, scope: dict[int, Extents]) -> np.ndarray:
    """Which ``(region, offset, nbytes)`` rows lie wholly inside one range of ``scope``."""
    ok = np.zeros(len(rows), dtype=bool)
    for i, (rid, off, n) in enumerate(rows.tolist()):
        for start, end in scope.get(rid, []):
            if start <= off and off + n <= end:
                ok[i] = True
                break
    return ok
