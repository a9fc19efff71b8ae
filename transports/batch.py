"""The batch algebra of the data plane: reads as rows of one numpy layout.

A *read* is ``(local_region, local_offset, remote_region, remote_offset, nbytes)``;
offsets and sizes are in bytes, relative to the start of the region. A batch is a
numpy structured array of ``READ_DTYPE`` (so a daemon passes 100k reads without a
Python object per read). Every rule about a batch is written here once, on that
layout, and every transport goes through it: conversion (`as_read_batch`, the wire's
rows), bounds (`within`, the one range containment refitd has, and `within_spans`,
the same over a region's readable spans) and overlap
(`validate_batch`), merging (`coalesce`), cutting
(`split_shares`, `split_pieces`) and the ranges a failed batch leaves undefined
(`suspect_ranges`, through `merge_ranges`, the one range merge refitd has).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError

__all__ = [
    "READ_DTYPE",
    "ByteRange",
    "ReadBatch",
    "ReadRefused",
    "as_read_batch",
    "batch_as_rows",
    "coalesce",
    "merge_ranges",
    "read_spans",
    "rows_as_batch",
    "spans_of",
    "split_pieces",
    "split_shares",
    "suspect_ranges",
    "validate_batch",
    "within",
    "within_spans",
]


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes at ``offset`` (bytes) in local region ``region``."""

    region: int
    offset: int
    nbytes: int


class ReadRefused(ProtocolError):
    """Read ``index`` of a batch failed validation; no read of the batch was posted."""

    def __init__(
        self,
        index: int,
        read: tuple[int, int, int, int, int],
        why: str,
        check: str = "",
        other: int | None = None,
    ) -> None:
        lr, lo, rr, ro, n = read
        super().__init__(
            f"read #{index} (local region {lr} @ {lo}, remote region {rr} @ {ro}, "
            f"{n} bytes) refused: {why}; nothing in the batch was read"
        )
        self.index = index
        self.read = read
        self.why = why
        #: which check refused it (see :func:`validate_batch`), "" when not said
        self.check = check
        #: for an overlap, the index of the earlier read it collides with
        self.other = other


#: One read per row. All fields are little-endian int64; offsets and nbytes in bytes.
READ_DTYPE = np.dtype(
    [
        ("local_region", "<i8"),
        ("local_offset", "<i8"),
        ("remote_region", "<i8"),
        ("remote_offset", "<i8"),
        ("nbytes", "<i8"),
    ]
)

ReadBatch = npt.NDArray[np.void]


def as_read_batch(batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> ReadBatch:
    """Return ``batch`` as a 1-D ``READ_DTYPE`` array, without copying when it is one.

    Accepts a ``READ_DTYPE`` array, an int64 array of shape (n, 5) in read order, or
    an iterable of 5-tuples.
    """
    if isinstance(batch, np.ndarray):
        if batch.dtype == READ_DTYPE:
            return cast(ReadBatch, batch.reshape(-1))
        if batch.dtype.fields is None and batch.ndim == 2 and batch.shape[1] == 5:
            arr = np.ascontiguousarray(batch, dtype="<i8")
            return cast(ReadBatch, arr.view(READ_DTYPE).reshape(-1))
        raise ProtocolError(
            f"batch refused: an array of dtype {batch.dtype} and shape {batch.shape} is neither "
            "READ_DTYPE nor int64 of shape (n, 5)"
        )
    rows = [tuple(int(v) for v in r) for r in batch]
    for i, r in enumerate(rows):
        if len(r) != 5:
            raise ProtocolError(f"batch refused: read #{i} has {len(r)} fields, expected 5")
    return np.array(rows, dtype=READ_DTYPE).reshape(-1)


@overload
def within(offset: int, nbytes: int, size: int) -> bool: ...
@overload
def within(
    offset: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64] | int,
    size: npt.NDArray[np.int64] | int,
) -> npt.NDArray[np.bool_]: ...
def within(offset: object, nbytes: object, size: object) -> object:
    """Whether the byte range ``[offset, offset + nbytes)`` lies inside ``[0, size)``:
    ``offset >= 0``, ``nbytes >= 0``, ``size >= 0`` and ``offset <= size - nbytes``
    (no sum, and with both non-negative no difference wraps int64 either: a size
    near ``-2**63`` is not made huge). A zero-byte range anywhere in ``[0, size]`` is
    inside; nothing is inside a negative size. Elementwise over numpy arrays (a mask), a ``bool`` for
    ints. The one range containment refitd has: every bound of a read, a shard, a
    digest row and a view asks it."""
    o, n, s = cast(Any, offset), cast(Any, nbytes), cast(Any, size)
    inside = (o >= 0) & (n >= 0) & (s >= 0) & (o <= s - n)
    return bool(inside) if isinstance(inside, bool | np.bool_) else inside


def within_spans(
    offset: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64] | int,
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """:func:`within` over spans: for each byte range ``[offset, offset + nbytes)``,
    the index of the span it would lie in (the last span starting at or before
    ``offset``; -1 where none does), and whether it lies inside that span (a mask).
    Span ``k`` is ``[starts[k], ends[k])``, bytes; ``starts`` ascend, are ≥ 0, and
    spans do not overlap (:func:`spans_of` makes them so). Vectorised: one search and
    one mask, no Python step a range (the ``tcp`` data server runs it on every read)."""
    k = np.searchsorted(starts, offset, side="right") - 1
    if len(starts) == 0:
        return k, np.zeros(np.shape(offset), dtype=bool)
    # The range starts in span k (it starts at or after the span does), so it lies
    # inside it iff it is within [0, the span's end).
    inside = within(offset, nbytes, ends[np.maximum(k, 0)])
    inside &= k >= 0
    return k, inside


def spans_of(
    extents: Sequence[tuple[int, int]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``[start, end)`` byte extents of one region, merged (:func:`merge_ranges`):
    the starts and ends of sorted, disjoint spans, as :func:`within_spans` reads
    them."""
    spans = np.array(extents, dtype=np.int64).reshape(-1, 2)
    runs = merge_ranges(np.zeros(len(spans), np.int64), spans[:, 0], spans[:, 1] - spans[:, 0])
    starts = np.array([r.offset for r in runs], dtype=np.int64)
    return starts, starts + np.array([r.nbytes for r in runs], dtype=np.int64)


def _sizes_of(
    ids: npt.NDArray[np.int64], table: dict[int, int]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Sizes for region ``ids`` from ``table`` (id -> size), and a mask of known ids."""
    if not table:
        return np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
    keys = np.array(sorted(table), dtype=np.int64)
    sizes = np.array([table[int(k)] for k in keys], dtype=np.int64)
    pos = np.clip(np.searchsorted(keys, ids), 0, len(keys) - 1)
    known = keys[pos] == ids
    return np.where(known, sizes[pos], 0), known


def validate_batch(
    batch: ReadBatch,
    local_sizes: dict[int, int],
    remote_sizes: dict[int, int],
    remote_nbytes: npt.NDArray[np.int64] | None = None,
) -> None:
    """Refuse the whole batch, naming the first bad read, unless every read is in bounds.

    A read is in bounds when both region ids are registered (the table maps region
    id -> size in bytes) and each side's range is :func:`within` its region. A
    zero-byte read is allowed anywhere in ``[0, size]``. Destination
    ranges of one batch must not overlap: overlapping writes would race.

    ``remote_nbytes`` (one length per read, bytes), when given, is the length of the
    source range each read spans where it differs from what it writes (a strided
    gather reads a footprint wider than the bytes it packs).
    """
    if len(batch) == 0:
        return
    lr, lo = batch["local_region"], batch["local_offset"]
    rr, ro, n = batch["remote_region"], batch["remote_offset"], batch["nbytes"]
    rn = n if remote_nbytes is None else remote_nbytes
    lsize, lknown = _sizes_of(lr, local_sizes)
    rsize, rknown = _sizes_of(rr, remote_sizes)
    checks: list[tuple[str, npt.NDArray[np.bool_], Callable[[int], str]]] = [
        (
            "remote_unknown",
            ~rknown,
            lambda i: f"remote region {int(rr[i])} is not in the peer's authenticated record",
        ),
        (
            "local_unknown",
            ~lknown,
            lambda i: f"local region {int(lr[i])} is not registered with this transport",
        ),
        ("negative", n < 0, lambda i: "negative length"),
        ("negative", rn < 0, lambda i: "negative source length"),
        ("negative", lo < 0, lambda i: "negative local offset"),
        ("negative", ro < 0, lambda i: "negative remote offset"),
        (
            "remote_range",
            ~within(ro, rn, rsize),
            lambda i: f"remote range ends past the region's {int(rsize[i])} bytes",
        ),
        (
            "local_range",
            ~within(lo, n, lsize),
            lambda i: f"local range ends past the region's {int(lsize[i])} bytes",
        ),
    ]
    for check, bad, why in checks:
        hits = np.flatnonzero(bad)
        if len(hits):
            i = int(hits[0])
            raise ReadRefused(i, tuple(int(v) for v in batch[i].tolist()), why(i), check)  # type: ignore[arg-type]
    nz = np.flatnonzero(n > 0)
    if len(nz) > 1:
        order = nz[np.lexsort((lo[nz], lr[nz]))]
        same = lr[order[1:]] == lr[order[:-1]]
        overlap = same & (lo[order[1:]] < lo[order[:-1]] + n[order[:-1]])
        hits = np.flatnonzero(overlap)
        if len(hits):
            a, b = int(order[hits[0]]), int(order[hits[0] + 1])
            i = max(a, b)
            raise ReadRefused(
                i,
                tuple(int(v) for v in batch[i].tolist()),  # type: ignore[arg-type]
                f"its destination overlaps read #{min(a, b)}'s; overlapping writes would race",
                "overlap",
                min(a, b),
            )


def coalesce(batch: ReadBatch) -> ReadBatch:
    """Drop zero-byte reads and merge reads contiguous on both sides into one.

    Reads are sorted by destination first (a validated batch has no overlapping
    destinations, so order does not change the result). A contiguous layout of n
    pieces becomes one read; a shuffled one stays n reads.
    """
    live = batch[batch["nbytes"] > 0]
    if len(live) < 2:
        return live.copy()
    live = live[np.lexsort((live["local_offset"], live["local_region"]))]
    lr, lo, rr, ro, n = (live[f] for f in READ_DTYPE.names or ())
    joins = (
        (lr[1:] == lr[:-1])
        & (rr[1:] == rr[:-1])
        & (lo[1:] == lo[:-1] + n[:-1])
        & (ro[1:] == ro[:-1] + n[:-1])
    )
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    out: ReadBatch = live[starts].copy()  # typed here: numpy < 2.4 stubs say Any
    out["nbytes"] = np.add.reduceat(n, starts)
    return out


def split_shares(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    shares: int,
    tag: npt.NDArray[np.int64] | None = None,
) -> list[
    tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
    ]
]:
    """Cut copies (``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``) into
    ``shares`` groups of about equal bytes, splitting a copy where a cut falls in it.

    Returns ``(dst, src, nbytes, tag)`` per non-empty share; ``tag`` (one int per
    copy, e.g. a region index) follows its copy's pieces. Order within a share is kept.
    """
    tag = np.zeros(len(nbytes), np.int64) if tag is None else tag
    total = int(nbytes.sum())
    if shares <= 1 or total == 0:
        return [(dst, src, nbytes, tag)]
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    cuts = [total * k // shares for k in range(shares + 1)]
    out = []
    for a, b in itertools.pairwise(cuts):
        lo = np.maximum(starts, a)
        hi = np.minimum(ends, b)
        take = hi > lo
        if not take.any():
            continue
        skip = (lo - starts)[take]
        out.append((dst[take] + skip, src[take] + skip, (hi - lo)[take], tag[take]))
    return out


def split_pieces(batch: ReadBatch, piece: int) -> ReadBatch:
    """``batch`` with every read longer than ``piece`` bytes cut into ``piece``-sized
    reads (same bytes, same order), so several can be in flight at once."""
    n = batch["nbytes"]
    counts = np.maximum(1, -(-n // piece))
    if int(counts.max(initial=1)) == 1:
        return batch
    out = np.repeat(batch, counts)
    k = np.arange(len(out)) - np.repeat(np.cumsum(counts) - counts, counts)
    step = k * piece
    out["local_offset"] += step
    out["remote_offset"] += step
    out["nbytes"] = np.minimum(piece, np.repeat(n, counts) - step)
    return out


def read_spans(
    sizes: npt.NDArray[np.int64], max_reads: int, max_bytes: int
) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans of reads (``sizes`` in bytes, in order), each at most
    ``max_reads`` reads and about ``max_bytes`` bytes (a larger single read is its own
    span): how a data plane cuts a batch into requests."""
    out: list[tuple[int, int]] = []
    lo, n = 0, len(sizes)
    while lo < n:
        csum = np.cumsum(sizes[lo : lo + max_reads])
        k = int(np.searchsorted(csum, max_bytes, side="right"))
        hi = lo + max(1, min(k, max_reads))
        out.append((lo, hi))
        lo = hi
    return out


def rows_as_batch(rows: npt.NDArray[np.int64]) -> ReadBatch:
    """Wire descriptor rows ``(src_region, src_offset, dst_region, dst_offset, nbytes)``
    (the pull API's layout) as a ``READ_DTYPE`` batch read into this side (the
    destination is local, the source remote)."""
    return as_read_batch(np.ascontiguousarray(rows.reshape(-1, 5)[:, [2, 3, 0, 1, 4]]))


def batch_as_rows(batch: ReadBatch) -> npt.NDArray[np.int64]:
    """The inverse of :func:`rows_as_batch`: ``(n, 5)`` wire rows."""
    flat = np.ascontiguousarray(batch).view("<i8").reshape(-1, 5)
    return np.ascontiguousarray(flat[:, [2, 3, 0, 1, 4]])


def merge_ranges(
    region: npt.ArrayLike, offset: npt.ArrayLike, nbytes: npt.ArrayLike
) -> list[ByteRange]:
    """Byte ranges ``[offset, offset + nbytes)`` of regions, merged: sorted by
    ``(region, offset)``, each run of ranges of one region that overlap or touch
    joined into one, empty ranges dropped. The one range merge of refitd: suspect
    ranges, a lease's readable extents (the daemon's scope, the tcp server's grant),
    a receiver's staged bytes."""
    regions = np.asarray(region, dtype=np.int64).reshape(-1)
    offsets = np.asarray(offset, dtype=np.int64).reshape(-1)
    sizes = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    live = sizes > 0
    regions, offsets, sizes = regions[live], offsets[live], sizes[live]
    if len(sizes) == 0:
        return []
    order = np.lexsort((offsets, regions))
    regions, starts = regions[order], offsets[order]
    ends = starts + sizes[order]
    out: list[ByteRange] = []
    # One vectorised pass per region: a range starts a new run unless it begins at or
    # before the furthest end reached so far in its region.
    bounds = np.flatnonzero(np.concatenate(([True], regions[1:] != regions[:-1], [True])))
    for lo, hi in itertools.pairwise(bounds.tolist()):
        s, reach = starts[lo:hi], np.maximum.accumulate(ends[lo:hi])
        first = np.flatnonzero(np.concatenate(([True], s[1:] > reach[:-1])))
        last = np.append(first[1:], hi - lo) - 1
        region_id = int(regions[lo])
        out.extend(
            ByteRange(region_id, a, b - a)
            for a, b in zip(s[first].tolist(), reach[last].tolist(), strict=True)
        )
    return out


def suspect_ranges(batch: ReadBatch) -> list[ByteRange]:
    """The destination ranges ``batch`` writes, sorted and coalesced (bytes)."""
    return merge_ranges(batch["local_region"], batch["local_offset"], batch["nbytes"])
