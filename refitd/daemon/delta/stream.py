"""A streamed delta, the source side (``POST /v1/deltas/stream``, docs/delta.md).

The changes a :class:`~refitd.daemon.delta.source.DeltaBook` keeps for a planned pull
(:func:`~refitd.daemon.delta.selection.select_delta`), not staged in a region for the
engine's daemon to pull: the plan's stream is cut into chunks
(:func:`refitd.delta.stream.chunking`, :func:`~refitd.delta.stream.cut`), each
chunk's changes encoded on their own in the book's thread pool and written to the
answer as soon as they are, while the next chunk is encoded. The engine places
each chunk while the next one crosses, so the source's encoding, the wire and the
engine's placing overlap instead of following one another, and a delta costs one
request: no staging region, no pull, no copy out of a landing region.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.daemon.delta.selection import select_delta
from refitd.daemon.delta.source import DeltaBook
from refitd.daemon.pull.plancheck import check_runs
from refitd.daemon.state.registry import Lease
from refitd.delta import native
from refitd.delta.native import payload_of
from refitd.delta.stream import chunking, cut
from refitd.errors import RefitError
from refitd.wire import DeltaChunk, DeltaStreamHead, DeltaStreamRequest

__all__ = ["opened", "stream"]

U8 = npt.NDArray[np.uint8]
_NONE: U8 = np.zeros(0, np.uint8)  # the payload of a chunk that failed


Stream = tuple[DeltaStreamHead, AsyncIterator[tuple[DeltaChunk, U8]]]


@contextlib.asynccontextmanager
async def opened(book: DeltaBook, req: DeltaStreamRequest, caller: str) -> AsyncIterator[Stream]:
    """``POST /v1/deltas/stream`` for ``caller``, open for the block: its plan bounded
    (400 past ``limits.max_plan_runs`` runs), its lease live on its version (409),
    the plan a warm refit names resolved (kept for its principal, :class:`Plans`);
    then, counted as one of ``caller``'s long polls (429 past its cap: open as long as
    its reader reads, holding its selection and two encoded chunks), the stream's
    head (with its plan's digest) and chunks (:func:`stream`). Every refusal comes
    before the head."""
    what = f"delta stream of {req.model!r} v{req.version}"
    check_runs(len(req.descriptors), req.pack_specs, book.max_plan_runs, what)
    lease = book.registry.check(req.lease_id, req.model, req.version)
    req, plan = await book.plans.resolve(req, caller)
    with book.waits.held(caller, what):
        head, chunks = await stream(book, req, lease, caller)
        yield msgspec.structs.replace(head, plan=plan), chunks


async def stream(
    book: DeltaBook, req: DeltaStreamRequest, lease: Lease, caller: str
) -> tuple[DeltaStreamHead, AsyncIterator[tuple[DeltaChunk, U8]]]:
    """The delta :func:`~refitd.daemon.delta.selection.pack_delta` would stage for
    ``req``, not staged: its head, and its chunks as they are encoded (each of
    ``req.chunk_bytes`` stream bytes, encoded on its own in the pool while the one
    before is sent). Refused before the head as ``pack_delta`` is; a chunk that
    fails, or a lease that ended, ends the chunks with a chunk whose ``error`` says
    why."""
    t0 = time.perf_counter()
    rec, index, values, reads = await select_delta(book, req, caller)
    unit = rec.unit
    units = native.stream_units(reads, unit)
    per, n = chunking(units, req.chunk_bytes, unit)
    ends = np.cumsum(reads[:, 2])
    head = DeltaStreamHead(unit, units, n, per, rec.base, rec.digest, time.perf_counter() - t0)

    def encode(k: int) -> tuple[U8, tuple[int, ...], float]:
        t = time.perf_counter()
        part = cut(reads, k * per * unit, min((k + 1) * per, units) * unit, ends)
        payload, staged = payload_of(unit, index, values, part, req.nibbles)
        return payload, staged, time.perf_counter() - t

    async def chunks() -> AsyncIterator[tuple[DeltaChunk, U8]]:
        nxt = asyncio.ensure_future(book.in_pool(encode, 0)) if n else None
        try:
            for k in range(n):
                assert nxt is not None
                try:
                    payload, staged, secs = await nxt
                    # The next chunk is encoded while this one is written and crosses.
                    nxt = asyncio.ensure_future(book.in_pool(encode, k + 1)) if k + 1 < n else None
                    book.registry.check(lease.lease_id, req.model, req.version)
                except RefitError as exc:
                    yield DeltaChunk(k, error=str(exc)), _NONE
                    return
                pages, changed, exceptions, _units, bits = staged
                yield DeltaChunk(k, len(payload), pages, changed, exceptions, bits, secs), payload
        finally:
            if nxt is not None:  # the reader went away: no chunk is encoded for no one
                nxt.cancel()

    return head, chunks()
