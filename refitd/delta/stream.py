"""The stream of a planned pull, and the changed units inside it.

A full refit's pull is a list of reads: descriptor rows ``(src_region, src_offset,
dst_region, dst_offset, nbytes)``, then pack specs (a strided block the source packs
contiguous). Laid end to end in that order, each pack spec in the C order of its
shape, they make the pull's *stream*: the bytes the full pull would move, in the
order they land. Source and receiver both derive it from the same compiled plan, so
a changed unit is named by one integer, its index in the stream (in units):

- the source turns the plan's reads into source byte ranges (:func:`reads_of`) and
  finds the changed units inside them (:func:`select`);
- the receiver turns a stream index back into where the full pull would have landed
  it (:func:`landing`).

Positions travel compactly (:func:`encode`): the stream is cut into pages of
``2**16`` units; a page count per page (uint32) and each position's low 16 bits
(uint16). At 1 % of bf16 values changed that is 2 bytes a change plus 4 bytes per
128 KiB of stream, next to the change's own 2 bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "PAGE_BITS",
    "Layout",
    "Strided",
    "decode",
    "encode",
    "landing",
    "layout",
    "reads_of",
    "select",
]

PAGE_BITS = 16
ALIGN = 64

I64 = npt.NDArray[np.int64]


class Strided(Protocol):
    """What a pack spec says of its source: a strided block (strides in elements)."""

    @property
    def src_region(self) -> int: ...
    @property
    def src_offset(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def itemsize(self) -> int: ...


def _runs(spec: Strided) -> tuple[I64, int]:
    """``spec``'s source as contiguous runs in packed order: start offsets, run bytes."""
    shape, strides, size = list(spec.shape), list(spec.strides), spec.itemsize
    if any(s == 0 for s in shape):
        return np.zeros(0, dtype=np.int64), 0
    run = size
    while shape and (shape[-1] == 1 or strides[-1] * size == run):
        run *= shape.pop()
        strides.pop()
    starts = np.array([spec.src_offset], dtype=np.int64)
    for n, st in zip(shape, strides, strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * (st * size)).reshape(-1)
    return starts, run


def reads_of(rows: npt.NDArray[np.int64], specs: Sequence[Strided]) -> I64:
    """The pull's stream as source reads, in stream order: ``(m, 3)`` int64 rows of
    ``(src_region, src_offset, nbytes)``. ``rows`` is the ``(n, 5)`` descriptor table."""
    parts = [np.ascontiguousarray(rows[:, [0, 1, 4]], dtype=np.int64).reshape(-1, 3)]
    for p in specs:
        starts, run = _runs(p)
        part = np.empty((len(starts), 3), dtype=np.int64)
        part[:, 0], part[:, 1], part[:, 2] = p.src_region, starts, run
        parts.append(part)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def select(index: Mapping[int, I64], reads: I64, unit: int) -> tuple[I64, I64, I64]:
    """The changed units the stream ``reads`` covers: ``(k, region, at)``, ``k``
    each one's stream index (units, ascending), ``region`` the source region holding
    it and ``at`` its position in ``index[region]``. ``index`` maps a region to its changed units' byte offsets (sorted).
    Every read starts and ends on a unit (refused with ``ValueError`` otherwise)."""
    if len(reads) and ((reads[:, 1] % unit).any() or (reads[:, 2] % unit).any()):
        raise ValueError(f"a read of the plan does not start and end on a {unit}-byte unit")
    starts = np.zeros(len(reads), dtype=np.int64)
    if len(reads) > 1:
        np.cumsum(reads[:-1, 2] // unit, out=starts[1:])
    ks: list[I64] = []
    regions: list[I64] = []
    offsets: list[I64] = []
    for region in np.unique(reads[:, 0]).tolist():
        idx = index.get(int(region))
        if idx is None or not len(idx):
            continue
        mask = reads[:, 0] == region
        off, nb, st = reads[mask, 1], reads[mask, 2], starts[mask]
        lo = np.searchsorted(idx, off)
        hi = np.searchsorted(idx, off + nb)
        counts = hi - lo
        total = int(counts.sum())
        if not total:
            continue
        first = np.repeat(np.cumsum(counts) - counts, counts)
        at = np.repeat(lo, counts) + (np.arange(total, dtype=np.int64) - first)
        src = idx[at]
        ks.append(np.repeat(st, counts) + (src - np.repeat(off, counts)) // unit)
        offsets.append(at)
        regions.append(np.full(total, region, dtype=np.int64))
    if not ks:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    k, r, o = np.concatenate(ks), np.concatenate(regions), np.concatenate(offsets)
    order = np.argsort(k, kind="stable")
    return k[order], r[order], o[order]


def encode(k: I64, stream_units: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint16]]:
    """Ascending stream indices as page counts and low 16 bits."""
    pages = -(-stream_units >> PAGE_BITS) if stream_units else 0
    counts = np.bincount(k >> PAGE_BITS, minlength=pages).astype(np.uint32)
    return counts, (k & ((1 << PAGE_BITS) - 1)).astype(np.uint16)


def decode(counts: npt.NDArray[np.uint32], low: npt.NDArray[np.uint16]) -> I64:
    """:func:`encode` undone: the ascending stream indices."""
    page = np.repeat(np.arange(len(counts), dtype=np.int64), counts.astype(np.int64))
    return (page << PAGE_BITS) | low.astype(np.int64)


@dataclass(frozen=True)
class Layout:
    """Where each part of a staged delta sits (bytes from its start)."""

    counts: int
    low: int
    values: int
    nbytes: int


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(pages: int, changed: int, unit: int) -> Layout:
    """A staged delta: page counts (uint32), low bits (uint16), values (units), each
    part 64-byte aligned."""
    low = _up(4 * pages)
    values = low + _up(2 * changed)
    return Layout(0, low, values, values + _up(unit * changed))


def landing(pieces: I64, k: I64, unit: int) -> tuple[I64, I64, I64]:
    """Where the full pull would have landed the stream units ``k``: ``(piece,
    region, offset)``. ``pieces`` is ``(m, 3)``: per read of the receiver's plan in
    stream order (each descriptor row, then each pack spec), its destination region,
    destination offset and bytes; each lands contiguous."""
    ends = np.cumsum(pieces[:, 2] // unit)
    piece = np.searchsorted(ends, k, side="right")
    if len(k) and int(piece[-1]) >= len(pieces):
        raise ValueError("a delta position lies past the end of the pull's stream")
    start = ends[piece] - pieces[piece, 2] // unit
    return piece, pieces[piece, 0], pieces[piece, 1] + (k - start) * unit
