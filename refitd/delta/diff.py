"""Bytewise comparison of two versions of a block, and the lane digest.

A *unit* is the comparison's granularity in bytes: the greatest common divisor of
the item sizes of a model's dtypes (2 for a bf16 model with fp32 norms), so every
element, every planned read and every block start is a whole number of units, and a
unit's bytes are compared and moved as one integer. Comparing bytes, not values,
makes a delta exact whatever the dtype: ``-0.0`` and ``0.0`` differ, and a NaN is
equal to itself.

The *lane digest* views memory as little-endian 64-bit words and adds word ``i``
into lane ``i % LANES`` (modulo 2**64). It is cheap (one pass at memory speed),
position-keyed to the lane, and linear: a write that changes a unit from ``a`` to
``b`` changes one lane by ``(b - a) << shift``, so a receiver keeps the digest of its
engine memory up to date in O(changed) (:func:`update_lanes`). It detects memory that changed; it is
not a cryptographic hash and is never used as one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

__all__ = [
    "CHUNK",
    "LANES",
    "compare_chunk",
    "lanes_of",
    "unit_dtype",
    "unit_of",
    "update_lanes",
]

LANES = 512
"""Lanes of the digest: 4 KiB of state, one word every 4 KiB of memory per lane."""

CHUNK = 1 << 20
"""Bytes compared per step: a multiple of ``8 * LANES``, small enough that both
sides' chunks stay in a core's cache while they are compared and digested."""

_UNITS: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


def unit_of(itemsizes: Iterable[int]) -> int:
    """The comparison unit for dtypes of these item sizes (bytes): their greatest
    common divisor, at most 8; 1 for none."""
    g = 0
    for s in itemsizes:
        g = math.gcd(g, int(s))
    g = g or 1
    while g not in _UNITS:
        g //= 2
    return g


def unit_dtype(unit: int) -> np.dtype[np.unsignedinteger]:
    """The unsigned integer dtype one unit is read as."""
    return np.dtype(_UNITS[unit])


def lanes_of(buf: U8) -> npt.NDArray[np.uint64]:
    """The lane digest of ``buf`` (bytes; word 0 at its start): ``LANES`` uint64."""
    n = len(buf)
    lanes = np.zeros(LANES, dtype=np.uint64)
    whole = n - n % 8
    words = buf[:whole].view("<u8")
    full = len(words) // LANES * LANES
    if full:
        lanes += np.add.reduce(words[:full].reshape(-1, LANES), axis=0, dtype=np.uint64)
    tail = words[full:]
    lanes[: len(tail)] += tail
    if whole < n:
        last = np.zeros(8, dtype=np.uint8)
        last[: n - whole] = buf[whole:]
        lanes[len(words) % LANES] += last.view("<u8")[0]
    return lanes


def update_lanes(
    lanes: npt.NDArray[np.uint64],
    offsets: I64,
    old: npt.NDArray[np.unsignedinteger],
    new: npt.NDArray[np.unsignedinteger],
) -> None:
    """Bring ``lanes`` (the digest of some memory) up to date after the units at byte
    ``offsets`` changed from ``old`` to ``new`` (unit-typed arrays, one per offset,
    no offset twice). Offsets are unit-aligned, so a unit never straddles a word."""
    if not len(offsets):
        return
    shift = ((offsets % 8) * 8).astype(np.uint64)
    diff = (new.astype(np.uint64) - old.astype(np.uint64)) << shift  # modulo 2**64
    np.add.at(lanes, (offsets // 8) % LANES, diff)  # numpy's fast path for uint64


def compare_chunk(old: U8, new: U8, unit: int) -> tuple[I64, U8, U8]:
    """The units of ``new`` that differ from ``old`` (equal-length byte chunks, a whole
    number of units): their byte offsets in the chunk, ascending, and their old and
    new bytes (``unit`` bytes each, in the same order)."""
    dt = unit_dtype(unit)
    a, b = old.view(dt), new.view(dt)
    at = np.flatnonzero(a != b)
    return at.astype(np.int64) * unit, a[at].view(np.uint8), b[at].view(np.uint8)
