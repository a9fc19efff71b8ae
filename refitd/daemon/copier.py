"""Moving bytes between mapped regions of one host, in batches that report progress.

A :class:`Copier` runs an already validated ``(n, 5)`` descriptor matrix between
lists of source and destination buffers. The default :class:`ThreadCopier` copies
in worker threads with numpy (which releases the GIL for large copies), one batch
at a time, so the event loop stays responsive and a cancel lands between batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

__all__ = ["Copier", "ThreadCopier", "pack_strided"]

Progress = Callable[[int, int], None]
"""Called with ``(descriptors_done, bytes_done)`` increments after each batch."""


class Copier(Protocol):
    async def copy(
        self,
        srcs: Sequence[memoryview],
        dsts: Sequence[memoryview],
        rows: np.ndarray,
        progress: Progress,
    ) -> None:
        """Copy every row ``(src_idx, src_off, dst_idx, dst_off, nbytes)``. Rows must
        have passed :func:`refitd.daemon.regions.validate_descriptors`."""
        ...


def _batches(rows: np.ndarray, max_bytes: int, max_rows: int) -> list[tuple[int, int]]:
    """Split rows into ``[lo, hi)`` spans of at most ``max_rows`` rows or about
    ``max_bytes`` bytes (a single larger row is its own batch)."""
    spans: list[tuple[int, int]] = []
    n = rows.shape[0]
    lo = 0
    sizes = rows[:, 4]
    while lo < n:
        csum = np.cumsum(sizes[lo : lo + max_rows])
        k = int(np.searchsorted(csum, max_bytes, side="right"))
        hi = lo + max(1, min(k, max_rows))
        spans.append((lo, hi))
        lo = hi
    return spans


def _copy_span(srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], rows: np.ndarray) -> None:
    for si, so, di, do, nb in rows.tolist():
        if nb:
            dsts[di][do : do + nb] = srcs[si][so : so + nb]


class ThreadCopier:
    """Copies in a worker thread, one batch (``batch_bytes``/``batch_rows``) at a time.

    A batch that is a single row of 8 MiB or more is split into ``threads`` equal
    pieces copied in parallel worker threads."""

    def __init__(
        self, batch_bytes: int = 64 << 20, batch_rows: int = 8192, threads: int = 2
    ) -> None:
        self.batch_bytes = batch_bytes
        self.batch_rows = batch_rows
        self.threads = threads

    async def copy(
        self,
        srcs: Sequence[memoryview],
        dsts: Sequence[memoryview],
        rows: np.ndarray,
        progress: Progress,
    ) -> None:
        s = [np.frombuffer(m, dtype=np.uint8) for m in srcs]
        d = [np.frombuffer(m, dtype=np.uint8) for m in dsts]
        for lo, hi in _batches(rows, self.batch_bytes, self.batch_rows):
            span = rows[lo:hi]
            nbytes = int(span[:, 4].sum())
            if hi - lo == 1 and nbytes >= (8 << 20) and self.threads > 1:
                await self._parallel_row(s, d, span[0])
            else:
                await asyncio.to_thread(_copy_span, s, d, span)
            progress(hi - lo, nbytes)

    async def _parallel_row(
        self, s: list[np.ndarray], d: list[np.ndarray], row: np.ndarray
    ) -> None:
        si, so, di, do, nb = (int(x) for x in row)
        step = -(-nb // self.threads)
        pieces = [
            np.array([[si, so + k, di, do + k, min(step, nb - k)]], dtype=np.int64)
            for k in range(0, nb, step)
        ]
        async with asyncio.TaskGroup() as tg:
            for p in pieces:
                tg.create_task(asyncio.to_thread(_copy_span, s, d, p))


def pack_strided(
    src: memoryview,
    src_offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    dst: memoryview,
    dst_offset: int,
) -> int:
    """Gather the strided block (``strides`` in elements) into ``dst`` contiguously.

    Returns the bytes written. Bounds must have been checked by
    :func:`refitd.daemon.regions.validate_pack_specs`.
    """
    # An integer dtype of the element's size lets numpy copy whole rows with memcpy;
    # an opaque void dtype would be copied element by element (~40x slower).
    if itemsize in (1, 2, 4, 8):
        dtype = np.dtype(f"<u{itemsize}")
        eshape, estrides = shape, tuple(st * itemsize for st in strides)
    else:
        dtype = np.dtype(np.uint8)
        eshape = (*shape, itemsize)
        estrides = (*(st * itemsize for st in strides), 1)
    view = np.ndarray(eshape, dtype=dtype, buffer=src, offset=src_offset, strides=estrides)
    n = view.nbytes
    out = np.ndarray(eshape, dtype=dtype, buffer=dst, offset=dst_offset)
    np.copyto(out, view)
    return n
