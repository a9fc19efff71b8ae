"""The stream of a planned pull, and the changed units inside it.

A full refit's pull is a list of reads: descriptor rows ``(src_region, src_offset,
dst_region, dst_offset, nbytes)``, then pack specs (a strided block the source packs
contiguous). Laid end to end in that order, each pack spec in the C order of its
shape, they make the pull's *stream*: the bytes a full refit would move, in the
order they land. Source and receiver both derive it from the same compiled plan, so
a changed unit is named by one integer, its index in the stream (in units):

- the source turns the plan's reads into source byte ranges (:func:`reads_of`) and
  finds the changed units inside them (:func:`select`);
- the receiver turns a stream index back into where a full refit would have landed
  it (:func:`landing`).

Positions travel compactly (:func:`encode`): the stream is cut into pages of
``PAGE`` (255) units; a count per page (uint8) and each position's offset in its
page (uint8). Values travel as the difference of the new unit from the old one,
as integers (:func:`encode_values`): one signed byte when it is within ±127 (a
step of a few ulps), else an escape and the whole new unit in a list of
exceptions. The receiver adds each difference to the unit its base holds there,
which the base check has proven to be the source's old unit. At ``c`` changed
units of a bf16 stream of ``n`` units that is about ``2c + n/255`` bytes against
a full refit's ``2n``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from refitd.delta.diff import unit_dtype

__all__ = [
    "ESCAPE",
    "MAX_CHUNKS",
    "PAGE",
    "ChangeIndex",
    "Layout",
    "Strided",
    "areas_of",
    "changed_pairs",
    "chunking",
    "compose",
    "cut",
    "decode",
    "decode_values",
    "encode",
    "encode_values",
    "landing",
    "layout",
    "pack_nibbles",
    "pieces_of",
    "reads_of",
    "scattered",
    "select",
    "staged_reference",
    "unpack_nibbles",
]

PAGE = 255
"""Units per page: a page's count and a position's offset in it fit one byte."""
ESCAPE = -128
"""The difference byte that says "this value is in the exceptions"."""
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


MAX_CHUNKS = 1024
"""The most chunks a streamed delta is cut into (:func:`chunking`)."""


def chunking(units: int, chunk_bytes: int, unit: int) -> tuple[int, int]:
    """How a stream of ``units`` units of ``unit`` bytes is cut for a streamed delta
    asked in chunks of ``chunk_bytes``: ``(units per chunk, chunks)``, the chunks
    made larger where there would be more than :data:`MAX_CHUNKS` (each costs the
    source a search of the plan's reads). Source and engine both cut by this."""
    per = max(chunk_bytes // unit, -(-units // MAX_CHUNKS), 1)
    return per, -(-units // per)


def cut(spans: I64, lo: int, hi: int, ends: I64 | None = None) -> I64:
    """The part of a stream from its byte ``lo`` to ``hi`` as spans: ``spans`` is the
    stream, ``(m, 3)`` int64 rows of ``(region, offset, bytes)`` in stream order (a
    source's reads, or an engine's landing pieces), each trimmed to the part and
    those of no bytes there left out. The source cuts its reads and the engine its
    pieces with this one function, so a chunk of a streamed delta names the same
    stream units on both sides."""
    if ends is None:  # the caller cutting many parts passes it once
        ends = np.cumsum(spans[:, 2])
    starts = ends - spans[:, 2]
    i = int(np.searchsorted(ends, lo, side="right"))
    j = int(np.searchsorted(starts, hi, side="left"))
    part = np.array(spans[i:j], dtype=np.int64).reshape(-1, 3)
    head = np.maximum(lo - starts[i:j], 0)
    tail = np.maximum(ends[i:j] - hi, 0)
    part[:, 1] += head
    part[:, 2] -= head + tail
    return part[part[:, 2] > 0]


@dataclass(frozen=True)
class ChangeIndex:
    """Changed units of a version: their byte offsets, region after region (each
    region's ascending), and each region's span ``[lo, hi)`` in ``offsets``."""

    offsets: I64
    spans: Mapping[int, tuple[int, int]]

    @staticmethod
    def of(per_region: Mapping[int, I64]) -> ChangeIndex:
        spans, at = {}, 0
        for region, offs in per_region.items():
            spans[region] = (at, at + len(offs))
            at += len(offs)
        parts = list(per_region.values())
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return ChangeIndex(flat.astype(np.int64, copy=False), spans)


def read_spans(index: ChangeIndex, reads: I64, unit: int) -> tuple[I64, I64, I64]:
    """Per read of the stream ``reads``: its first unit in the stream, and its first
    and past-last change in ``index.offsets`` (binary search per region: O(reads log
    changes)). Every read starts and ends on a unit (refused with ``ValueError``
    otherwise)."""
    if len(reads) and ((reads[:, 1] % unit).any() or (reads[:, 2] % unit).any()):
        raise ValueError(f"a read of the plan does not start and end on a {unit}-byte unit")
    starts = np.zeros(len(reads), dtype=np.int64)
    if len(reads) > 1:
        np.cumsum(reads[:-1, 2] // unit, out=starts[1:])
    lo = np.zeros(len(reads), dtype=np.int64)
    hi = np.zeros(len(reads), dtype=np.int64)
    for region in np.unique(reads[:, 0]).tolist():
        span = index.spans.get(int(region))
        if span is None or span[0] == span[1]:
            continue
        mask = reads[:, 0] == region
        offs = index.offsets[span[0] : span[1]]
        lo[mask] = span[0] + np.searchsorted(offs, reads[mask, 1])
        hi[mask] = span[0] + np.searchsorted(offs, reads[mask, 1] + reads[mask, 2])
    return starts, lo, hi


def select(index: ChangeIndex, reads: I64, unit: int) -> tuple[I64, I64]:
    """The changed units the stream ``reads`` covers: ``(k, at)``, ``k`` each one's
    stream index (units, ascending: reads are in stream order, and each read's
    changes ascend) and ``at`` its position in ``index.offsets``. Every read starts
    and ends on a unit (refused with ``ValueError`` otherwise)."""
    starts, lo, hi = read_spans(index, reads, unit)
    counts = hi - lo
    total = int(counts.sum())
    # One repeat per result: each read's shift, then the running position added.
    at = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    at += np.arange(total, dtype=np.int64)
    k = np.repeat(starts - reads[:, 1] // unit, counts)
    k += index.offsets[at] >> (unit.bit_length() - 1)  # // unit, a power of two
    return k, at


def changed_pairs(
    values: npt.NDArray[np.uint8], at: I64, unit: int
) -> tuple[npt.NDArray[np.unsignedinteger], npt.NDArray[np.unsignedinteger]]:
    """The old and new units of changes ``at`` (positions in a version's ``values``:
    each change's old then new bytes, ``unit`` each). One word gathered per change
    (both units at once), not ``2 * unit`` bytes each: numpy's gather of a row of
    bytes costs about 40 times more."""
    udt = unit_dtype(unit)
    if unit < 8:
        pairs = values.view(unit_dtype(2 * unit))[at].view(udt).reshape(-1, 2)
    else:
        pairs = values.view(udt).reshape(-1, 2)[at]
    return pairs[:, 0], pairs[:, 1]


def encode(k: I64, stream_units: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Ascending stream indices as page counts and offsets in their page."""
    pages = -(-stream_units // PAGE)
    counts = np.bincount(k // PAGE, minlength=pages).astype(np.uint8)
    return counts, (k % PAGE).astype(np.uint8)


def decode(counts: npt.NDArray[np.uint8], low: npt.NDArray[np.uint8]) -> I64:
    """:func:`encode` undone: the ascending stream indices."""
    page = np.repeat(np.arange(len(counts), dtype=np.int64), counts.astype(np.int64))
    return page * PAGE + low.astype(np.int64)


def encode_values(
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
    limit: int = 127,
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.unsignedinteger]]:
    """New units as differences from the old ones (same unsigned dtype): a signed
    byte each, ``ESCAPE`` for one beyond ±``limit`` (127; 7 for 4-bit differences),
    whose new unit goes to the returned exceptions (in order)."""
    signed = np.dtype(f"i{old.dtype.itemsize}")
    d = (new - old).view(signed)
    far = (d < -limit) | (d > limit)
    diff = np.where(far, ESCAPE, d).astype(np.int8)
    return diff, new[far]


def decode_values(
    old: npt.NDArray[np.unsignedinteger],
    diff: npt.NDArray[np.int8],
    exceptions: npt.NDArray[np.unsignedinteger],
) -> npt.NDArray[np.unsignedinteger]:
    """:func:`encode_values` undone, given the old units."""
    new = old + diff.astype(old.dtype)  # modular: a negative difference wraps
    far = diff == ESCAPE
    if int(far.sum()) != len(exceptions):
        raise ValueError(f"{int(far.sum())} escaped differences but {len(exceptions)} exceptions")
    new[far] = exceptions
    return new


@dataclass(frozen=True)
class Layout:
    """Where each part of a staged delta sits (bytes from its start)."""

    counts: int
    low: int
    diff: int
    exceptions: int
    nbytes: int


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(pages: int, changed: int, exceptions: int, unit: int, diff_bits: int = 8) -> Layout:
    """A staged delta: page counts, offsets in page, differences (a byte each, or
    with ``diff_bits`` 4 two a byte), the exceptions (units), each part 64-byte
    aligned."""
    low = _up(pages)
    diff = low + _up(changed)
    exc = diff + _up(changed if diff_bits == 8 else -(-changed // 2))
    return Layout(0, low, diff, exc, exc + _up(unit * exceptions))


NIBBLE_ESCAPE = 8
"""The 4-bit difference that says "this value is in the exceptions"."""


def pack_nibbles(diff: npt.NDArray[np.int8]) -> npt.NDArray[np.uint8]:
    """Differences within ±7 (``ESCAPE`` for any other) as 4-bit ones, two a byte,
    the first in the low nibble; an escape is :data:`NIBBLE_ESCAPE`."""
    d = np.zeros(len(diff) + len(diff) % 2, np.uint8)
    d[: len(diff)] = np.where(diff == ESCAPE, NIBBLE_ESCAPE, diff).astype(np.uint8)
    np.bitwise_and(d, np.uint8(0xF), out=d)
    out: npt.NDArray[np.uint8] = d[0::2] | (d[1::2] << np.uint8(4))
    return out


def unpack_nibbles(packed: npt.NDArray[np.uint8], n: int) -> npt.NDArray[np.int8]:
    """:func:`pack_nibbles` undone: ``n`` differences as signed bytes, ``ESCAPE`` for
    an escape."""
    d = np.empty(2 * len(packed), np.int16)
    d[0::2], d[1::2] = packed & 0xF, packed >> 4
    d = d[:n]
    out = np.where(d == NIBBLE_ESCAPE, ESCAPE, (d ^ 8) - 8).astype(np.int8)
    return out


def pieces_of(pieces: I64, k: I64, unit: int) -> I64:
    """The piece each of the stream units ``k`` (ascending) lies in (see :func:`landing`)."""
    units = pieces[:, 2] // unit
    ends = np.cumsum(units)
    # ``k`` ascends: count each piece's units by its bounds, no search per unit.
    counts = np.searchsorted(k, ends) - np.searchsorted(k, ends - units)
    if int(counts.sum()) != len(k):
        raise ValueError("a delta position lies past the end of the pull's stream")
    return np.repeat(np.arange(len(pieces), dtype=np.int64), counts)


def landing(pieces: I64, k: I64, unit: int) -> tuple[I64, I64, I64]:
    """Where a full refit would have landed the stream units ``k`` (ascending): ``(piece,
    region, offset)``. ``pieces`` is ``(m, 3)``: per read of the receiver's plan in
    stream order (each descriptor row, then each pack spec), its destination region,
    destination offset and bytes; each lands contiguous."""
    units = pieces[:, 2] // unit
    ends = np.cumsum(units)
    piece = pieces_of(pieces, k, unit)
    # Per piece, where stream unit 0 would land: one gather per unit, not three.
    origin = pieces[:, 1] - (ends - units) * unit
    off = origin[piece]
    off += k * unit
    return piece, np.ascontiguousarray(pieces[:, 0])[piece], off


def staged_reference(
    unit: int, index: ChangeIndex, values: npt.NDArray[np.uint8], reads: I64, diff_bits: int = 8
) -> tuple[npt.NDArray[np.uint8], tuple[int, int, int, int]]:
    """The staged delta of the stream ``reads`` (:func:`reads_of`) given a version's
    changed units (``index``; ``values`` each one's old then new unit), in numpy: its
    bytes and (pages, changed, exceptions, stream units). The reference the source's
    native staging (:func:`refitd.delta.native.stage`) is tested against.
    ``ValueError`` for a read that does not start and end on a unit."""
    k, at = select(index, reads, unit)
    stream_units = int(reads[:, 2].sum()) // unit if len(reads) else 0
    counts, low = encode(k, stream_units)
    old, new = changed_pairs(values, at, unit)
    diff, exc = encode_values(old, new, 127 if diff_bits == 8 else 7)
    lay = layout(len(counts), len(k), len(exc), unit, diff_bits)
    out = np.zeros(max(lay.nbytes, 64), np.uint8)
    out[lay.counts : lay.counts + counts.nbytes] = counts
    out[lay.low : lay.low + low.nbytes] = low
    packed = diff.view(np.uint8) if diff_bits == 8 else pack_nibbles(diff)
    out[lay.diff : lay.diff + packed.nbytes] = packed
    out[lay.exceptions : lay.exceptions + exc.nbytes] = exc.view(np.uint8)
    return out, (len(counts), len(k), len(exc), stream_units)


def compose(
    chain: Sequence[tuple[ChangeIndex, npt.NDArray[np.uint8]]], unit: int
) -> tuple[ChangeIndex, npt.NDArray[np.uint8]]:
    """The changes of consecutive deltas (oldest first: each one's changed units and
    their old then new units) as one delta from the first's base to the last's
    version: a unit changed by several keeps the oldest old and the newest new unit,
    and one that came back to its old value is no change."""
    udt = unit_dtype(unit)
    regions = sorted({r for index, _ in chain for r in index.spans})
    per_offsets: dict[int, I64] = {}
    per_pairs = []
    for r in regions:
        offs, pairs, seq = [], [], []
        for i, (index, values) in enumerate(chain):
            lo, hi = index.spans.get(r, (0, 0))
            offs.append(index.offsets[lo:hi])
            pairs.append(values.view(udt).reshape(-1, 2)[lo:hi])
            seq.append(np.full(hi - lo, i, np.int64))
        o, p, q = np.concatenate(offs), np.concatenate(pairs), np.concatenate(seq)
        order = np.lexsort((q, o))  # by offset, then oldest first
        o, p = o[order], p[order]
        first = np.ones(len(o), bool)
        first[1:] = o[1:] != o[:-1]
        last = np.ones(len(o), bool)
        last[:-1] = o[1:] != o[:-1]
        merged = np.stack([p[first, 0], p[last, 1]], axis=1)
        moved = merged[:, 0] != merged[:, 1]
        per_offsets[r] = o[first][moved]
        per_pairs.append(merged[moved])
    values = (
        np.ascontiguousarray(np.concatenate(per_pairs)).view(np.uint8).reshape(-1)
        if per_pairs
        else np.zeros(0, np.uint8)
    )
    return ChangeIndex.of(per_offsets), values


def scattered(scatter: Sequence[Any], param_off: Mapping[str, int], sid: I64, off: I64) -> I64:
    """Engine byte offsets of scratch offsets ``off`` in the plan's scatter entries
    ``sid`` (each ``(scratch offset, dtype, shape, strides, parameter, byte in it)``):
    each entry's packed (C-order) element mapped through its destination strides."""
    nd = max(len(e[2]) for e in scatter)
    shapes = np.array([(1,) * (nd - len(e[2])) + tuple(e[2]) for e in scatter])
    strides = np.array([(0,) * (nd - len(e[3])) + tuple(e[3]) for e in scatter])
    at = np.array([e[0] for e in scatter], dtype=np.int64)
    size = np.array([e[1].itemsize for e in scatter], dtype=np.int64)
    base = np.array([param_off[e[4]] + e[5] for e in scatter], dtype=np.int64)
    rel = off - at[sid]
    isz = size[sid]
    elem, byte = rel // isz, rel % isz
    flat = np.zeros(len(sid), dtype=np.int64)
    for d in range(nd - 1, -1, -1):
        n = shapes[sid, d]
        flat += (elem % n) * strides[sid, d]
        elem //= n
    return np.asarray(base[sid] + flat * isz + byte, dtype=np.int64)


def areas_of(comp: Any, pieces: I64, scratch_id: int) -> tuple[I64, I64]:
    """Per piece of the stream of ``comp`` (a compiled pull: its rows, packs, scatter
    entries and full reads): the scatter entry it lands in (-1: none), and the full
    read whose staged tensor it lands in (-1: none)."""
    n = len(pieces)
    scat_of = np.full(n, -1, dtype=np.int64)
    fr_of = np.full(n, -1, dtype=np.int64)
    entry = {at: e for e, (at, *_) in enumerate(comp.scatter)}
    nrows = len(comp.rows)
    for j, p in enumerate(comp.packs):
        if p.dst_region == scratch_id and p.dst_offset in entry:
            scat_of[nrows + j] = entry[p.dst_offset]
    in_scratch = pieces[:, 0] == scratch_id
    for i, (at, fr) in enumerate(comp.full_reads):
        inside = in_scratch & (pieces[:, 1] >= at) & (pieces[:, 1] < at + fr.staging_nbytes)
        fr_of[inside] = i
    return scat_of, fr_of
