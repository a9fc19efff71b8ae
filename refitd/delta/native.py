"""The delta refit's per-change stages in native code (``transports.native._delta``).

Each function here does in one pass over the changes what the pure-numpy reference
does in many (:mod:`refitd.delta.diff`, :mod:`refitd.delta.stream`,
:mod:`refitd.delta.digest`), and gives the same bytes: ``tests/delta`` checks each
against its reference on random change patterns (every unit size, unaligned tails).
Numpy cannot make these stages run at memory speed: each of its steps over a million
changes walks a fresh array (a page fault per 4 KiB of it) and the stages took about
fifteen such steps each. The C functions run with the GIL released (ctypes).

- :func:`compare`: the source's comparison of one chunk of a version with its base
  (lanes of both, the changed units' offsets and old and new bytes);
- :func:`stage`: the source's selection and encoding of the changes a planned
  stream reads, laid out as the staged payload (:func:`refitd.delta.stream.layout`);
- :func:`place`: the engine's decoding of a payload whose reads land whole in its
  memory: each change's engine unit, the unit found there and the unit to write;
- :func:`scatter` and :func:`digest_update`: the writes, and the engine digest's
  update from what they found and left.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

from refitd.delta.diff import LANES, unit_dtype
from refitd.delta.stream import PAGE, ChangeIndex, layout, read_spans
from refitd.errors import ProtocolError

__all__ = [
    "compare",
    "digest_update",
    "lanes",
    "payload_of",
    "place",
    "place_write",
    "scatter",
    "stage",
    "stream_units",
]

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]


def _lib() -> Any:
    from transports.native import delta_lib

    return delta_lib()


def _at(a: npt.NDArray[Any] | None) -> int | None:
    """The address of ``a``'s first byte (C-contiguous, checked), None for None."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise ValueError("a native delta kernel takes C-contiguous arrays only")
    return int(a.ctypes.data)


def lanes(buf: U8, into: U64 | None = None) -> U64:
    """The lane digest of ``buf`` added into ``into`` (a fresh one when None)."""
    out = np.zeros(LANES, np.uint64) if into is None else into
    _lib().rfx_lanes(len(buf), _at(buf), _at(out))
    return out


def compare(
    old: U8 | None,
    new: U8,
    unit: int,
    lanes_old: U64 | None,
    lanes_new: U64,
    at: I64,
    vals: U8,
) -> int:
    """Compare ``old`` with ``new`` (equal lengths, whole units; ``old`` None: only
    ``new``'s lanes are taken): lanes added into ``lanes_old`` and ``lanes_new``, and
    the changes written into ``at`` (byte offsets) and ``vals`` (old then new bytes,
    ``2 * unit`` each), which hold ``len(new) // unit`` changes. Returns how many."""
    n = len(new)
    if old is None:
        lanes(new, lanes_new)
        return 0
    if len(old) != n or n % unit:
        raise ValueError(f"compare refused: {len(old)} and {n} bytes, unit {unit}")
    if len(at) < n // unit or len(vals) < 2 * n:
        raise ValueError("compare refused: the output buffers are too small")
    got: int = _lib().rfx_compare(
        n, _at(old), _at(new), unit, _at(lanes_old), _at(lanes_new), _at(at), _at(vals)
    )
    return got


def stream_units(reads: I64, unit: int) -> int:
    return int(reads[:, 2].sum()) // unit if len(reads) else 0


def stage(
    index: ChangeIndex, values: U8, reads: I64, unit: int, nibbles: bool = False
) -> tuple[U8, tuple[int, int, int, int, int]]:
    """The staged delta of the stream ``reads`` (``(m, 3)``: region, offset, bytes, in
    stream order) given a version's changed units (``index``; ``values`` each one's old
    then new unit): its bytes and ``(pages, changed, exceptions, stream units)``, the
    same as the reference (:func:`refitd.delta.stream.select`, :func:`encode`,
    :func:`encode_values` laid out by :func:`layout`), and the bits of a difference.
    With ``nibbles`` (the receiver decodes them) differences are 4-bit where that
    stages fewer bytes: it does when few differences lie beyond ±7 (each then an
    exception of a whole unit). ``ValueError`` for a read that does not start and end
    on a unit."""
    reads = np.ascontiguousarray(reads, dtype=np.int64)
    # Each read's first and last change by binary search; the changes themselves are
    # walked once, natively.
    start, lo, hi = read_spans(index, reads, unit)
    units = stream_units(reads, unit)
    pages = -(-units // PAGE)
    changed = int((hi - lo).sum())
    room = layout(pages, changed, changed, unit)  # every change an exception, at most
    out = np.empty(max(room.nbytes, 64), np.uint8)  # pages untouched stay unbacked
    offsets = np.ascontiguousarray(index.offsets, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.uint8)
    read_off = np.ascontiguousarray(reads[:, 1])  # kept alive across the call
    mid = ctypes.c_int64(0)

    def encode(bits: int) -> int:
        out[:pages] = 0
        if bits == 4:
            out[room.diff : room.diff + -(-changed // 2)] = 0  # nibbles are or-ed in
        return int(
            _lib().rfx_encode(
                len(reads), _at(read_off), _at(start), _at(lo), _at(hi), _at(offsets), _at(values),
                unit, unit.bit_length() - 1, _at(out), pages,
                int(out.ctypes.data) + room.low, int(out.ctypes.data) + room.diff,
                int(out.ctypes.data) + room.exceptions, bits, ctypes.byref(mid),
            )
        )  # fmt: skip

    # 4-bit differences save half a byte a change and cost a whole unit for each one
    # beyond +-7 that 8 bits carried: chosen when that is fewer bytes. Encoded 4-bit
    # first where the receiver takes them (``mid`` counts what 8 bits would carry
    # unescaped), so the usual case is one pass over the changes, not two.
    bits = 4 if nibbles else 8
    exc = encode(bits)
    if (
        exc >= 0
        and bits == 4
        and layout(pages, changed, exc, unit, 4).nbytes
        >= layout(pages, changed, exc - mid.value, unit, 8).nbytes
    ):
        bits = 8
        exc = encode(bits)
    if exc < 0:
        raise ValueError("a change lies past the end of the plan's stream")
    lay = layout(pages, changed, exc, unit, bits)
    # The exceptions sit where 8-bit differences would end: moved down when 4-bit.
    if lay.exceptions != room.exceptions:
        out[lay.exceptions : lay.exceptions + unit * exc] = out[
            room.exceptions : room.exceptions + unit * exc
        ]
    diff_bytes = changed if bits == 8 else -(-changed // 2)
    # The gaps between the parts (64-byte alignment) are zero, as the reference's.
    out[pages : lay.low] = 0
    out[lay.low + changed : lay.diff] = 0
    out[lay.diff + diff_bytes : lay.exceptions] = 0
    end = max(lay.nbytes, 64)
    out[lay.exceptions + unit * exc : end] = 0
    return out[:end], (pages, changed, exc, units, bits)


_PLACE_ERRORS = {
    -1: "its page counts name more positions than the {changed} it carries",
    -2: "its page counts name fewer positions than the {changed} it carries",
    -3: "a position lies past the end of the pull's stream",
    -4: "a position lands outside the engine's memory",
    -5: "its positions are not strictly ascending",
    -6: "its escaped differences are not the {exceptions} exceptions it carries",
}


def _place_args(
    counts: U8,
    low: U8,
    diff: npt.NDArray[np.int8],
    exceptions: npt.NDArray[np.unsignedinteger],
    pieces: I64,
    unit: int,
    diff_bits: int,
) -> list[Any]:
    """The arrays :func:`place` and :func:`place_write` hand the kernel, contiguous,
    after checking the differences hold the changes."""
    changed = len(low)
    if len(diff) * 8 < changed * diff_bits:
        raise ValueError(f"its differences hold fewer than the {changed} it carries")
    units = pieces[:, 2] // unit
    ends = np.ascontiguousarray(np.cumsum(units), dtype=np.int64)
    origin = np.ascontiguousarray(pieces[:, 1] // unit - (ends - units), dtype=np.int64)
    return [
        np.ascontiguousarray(counts),
        np.ascontiguousarray(low),
        np.ascontiguousarray(diff),
        np.ascontiguousarray(exceptions),
        ends,
        origin,
    ]


def _placed(got: int, changed: int, exceptions: int) -> None:
    if got < 0:
        raise ValueError(_PLACE_ERRORS[got].format(changed=changed, exceptions=exceptions))


def place(
    counts: U8,
    low: U8,
    diff: npt.NDArray[np.int8],
    exceptions: npt.NDArray[np.unsignedinteger],
    pieces: I64,
    engine: U8,
    unit: int,
    diff_bits: int = 8,
) -> tuple[I64, npt.NDArray[np.unsignedinteger], npt.NDArray[np.unsignedinteger]]:
    """Decode a staged delta whose every piece lands whole in ``engine`` (``pieces``:
    per read in stream order, ``(region, engine byte offset, bytes)``): each change's
    engine unit index, the unit there now and the unit it becomes. Nothing is
    written. ``diff``: the difference bytes (``diff_bits`` 4: two a byte, see
    :func:`refitd.delta.stream.pack_nibbles`). ``ValueError`` (saying what) for a
    payload that does not fit the plan."""
    # Each held by a name across the call: the kernel reads their addresses.
    c, lo, d, exc, ends, origin = _place_args(
        counts, low, diff, exceptions, pieces, unit, diff_bits
    )
    changed = len(low)
    udt = unit_dtype(unit)
    idx = np.empty(changed, np.int64)
    old = np.empty(changed, udt)
    new = np.empty(changed, udt)
    got = _lib().rfx_place(
        len(c), _at(c), _at(lo), changed, _at(d), _at(exc), len(exc), len(pieces),
        _at(ends), _at(origin), unit, _at(engine), len(engine) // unit,
        _at(idx), _at(old), _at(new), diff_bits,
    )  # fmt: skip
    _placed(int(got), changed, len(exc))
    return idx, old, new


def place_write(
    counts: U8,
    low: U8,
    diff: npt.NDArray[np.int8],
    exceptions: npt.NDArray[np.unsignedinteger],
    pieces: I64,
    engine: U8,
    unit: int,
    diff_bits: int,
    lanes_: U64,
    block: int,
) -> tuple[I64, npt.NDArray[np.unsignedinteger]]:
    """:func:`place`, :func:`scatter` and :func:`digest_update` in one pass over the
    changes (and so over the engine memory): each change decoded, the unit it finds
    kept, the new unit written into ``engine`` and the digest's per-block lanes
    ``lanes_`` (blocks of ``block`` bytes) updated. Returns each change's engine unit
    index and the unit it found: the undo record. ``ValueError`` (saying what) for a
    payload that does not fit the plan, with nothing written: every unit written
    before the fault was found is put back, and every lane."""
    c, lo, d, exc, ends, origin = _place_args(
        counts, low, diff, exceptions, pieces, unit, diff_bits
    )
    changed = len(low)
    idx = np.empty(changed, np.int64)
    old = np.empty(changed, unit_dtype(unit))
    if not (lanes_.flags.c_contiguous and lanes_.dtype == np.uint64):
        raise ValueError("place refused: the digest's lanes are not contiguous uint64")
    got = _lib().rfx_place_write(
        len(c), _at(c), _at(lo), changed, _at(d), _at(exc), len(exc), len(pieces),
        _at(ends), _at(origin), unit, _at(engine), len(engine) // unit,
        _at(idx), _at(old), diff_bits, _at(lanes_), block.bit_length() - 1, len(lanes_),
    )  # fmt: skip
    _placed(int(got), changed, len(exc))
    return idx, old


def scatter(engine: U8, idx: I64, new: npt.NDArray[np.unsignedinteger]) -> None:
    """``engine`` (bytes) as units of ``new``'s size: ``[idx] = new``; ``idx`` from
    :func:`place`, so inside ``engine``."""
    unit = new.dtype.itemsize
    if len(idx) and (int(idx.max()) >= len(engine) // unit or int(idx.min()) < 0):
        raise ValueError("scatter refused: an index lies outside the engine's memory")
    _lib().rfx_scatter(len(idx), _at(idx), _at(new), unit, _at(engine))


def digest_update(
    lanes_: U64,
    block: int,
    idx: I64,
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
) -> None:
    """Per-block lanes ``lanes_`` (``(blocks, LANES)``, blocks of ``block`` bytes, a
    power of two) after the units at indices ``idx`` changed from ``old`` to ``new``
    (no index twice). ``ValueError`` (nothing updated) for an index outside them."""
    unit = old.dtype.itemsize
    idx = np.ascontiguousarray(idx, dtype=np.int64)  # held across the call
    old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
    rc = _lib().rfx_digest_update(
        len(idx),
        _at(idx),
        _at(old),
        _at(new),
        unit,
        block.bit_length() - 1,
        len(lanes_),
        _at(lanes_),
    )
    if rc != 0:
        raise ValueError("digest update refused: a unit lies outside the digested memory")


def payload_of(
    unit: int, index: ChangeIndex, values: U8, reads: I64, nibbles: bool
) -> tuple[U8, tuple[int, ...]]:
    """The staged delta of the stream ``reads``
    (:func:`refitd.delta.stream.reads_of`), given a version's changed units
    (``index``, ``values``): its bytes and (pages, changed, exceptions, stream units,
    bits of a difference), selected and encoded natively in one pass over the changes
    (:func:`stage`; its reference: ``staged_reference``); ProtocolError, naming why,
    for a stream :func:`stage` refuses."""
    try:
        return stage(index, values, reads, unit, nibbles)
    except ValueError as err:
        raise ProtocolError(f"delta refused: {err}") from err
