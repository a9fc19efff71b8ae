"""Moving bytes between mapped regions of one host, in batches that report progress.

A :class:`Copier` runs an already validated ``(n, 5)`` descriptor matrix between
lists of source and destination buffers. The default :class:`ThreadCopier` copies
one batch at a time with the data plane's own copy engine
(:func:`transports.local.copy_addresses`, the ``local`` and ``shm`` transports'
parallel C memcpy, GIL released), so the event loop stays responsive and a cancel
lands between batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from transports.local import copy_addresses

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


_POOL: ThreadPoolExecutor | None = None


def _pool(threads: int) -> ThreadPoolExecutor:
    """One copy pool per process, shared by every copier (daemons in tests are many)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(2, threads), thread_name_prefix="refitd-copy")
    return _POOL


def _base(m: memoryview) -> int:
    return int(np.frombuffer(m, dtype=np.uint8).ctypes.data)


class ThreadCopier:
    """Copies one batch (``batch_bytes``/``batch_rows``) at a time, each cut into
    ``threads`` shares of about equal bytes copied in parallel (a single large row
    is cut too)."""

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
        s_base = np.array([_base(m) for m in srcs], dtype=np.int64)
        d_base = np.array([_base(m) for m in dsts], dtype=np.int64)
        pool = _pool(self.threads)
        for lo, hi in _batches(rows, self.batch_bytes, self.batch_rows):
            span = rows[lo:hi]
            live = span[span[:, 4] > 0]
            await copy_addresses(
                d_base[live[:, 2]] + live[:, 3],
                s_base[live[:, 0]] + live[:, 1],
                live[:, 4].astype(np.int64),
                threads=self.threads,
                pool=pool,
                inline_bytes=1,  # only an empty batch is "copied" on the loop
            )
            progress(hi - lo, int(span[:, 4].sum()))


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
