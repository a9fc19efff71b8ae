"""A GPU batch's copies planned without a GPU: runs for 2-D copies, reads for the gather.

Pure code over address arrays (and, for :func:`gather_units`, a tensor of whatever
device), so the CPU suite checks every plan `transports.cuda`'s engine acts on.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = [
    "BATCH_MAX",
    "CU_MEMCPY_SRC_ACCESS_ORDER_STREAM",
    "CU_MEMORYTYPE_UNIFIED",
    "GATHER_UNIT",
    "MAX_PITCH",
    "MIN_RUN",
    "SMALL_PIECE",
    "Memcpy2D",
    "MemcpyAttributes",
    "Span",
    "gather_mask",
    "gather_units",
    "on_one_device",
    "strided_runs",
]

SMALL_PIECE = 64 << 10
"""Bytes: GPU-to-GPU reads up to this size are gathered by one indexed device copy."""
GATHER_UNIT = 8
"""Bytes per element of the indexed gather: a read's offsets and size must be multiples."""


def on_one_device(
    addresses: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    ranges: list[tuple[int, int]],
) -> npt.NDArray[np.bool_]:
    """Which reads ``[addresses[i], addresses[i] + nbytes[i])`` lie wholly inside one
    of ``ranges`` (``(base, bytes)``, not overlapping: allocations)."""
    if not ranges or not len(addresses):
        return np.zeros(len(addresses), dtype=bool)
    table = np.array(sorted(ranges), dtype=np.int64).reshape(-1, 2)
    k = np.searchsorted(table[:, 0], addresses, side="right") - 1
    found = k >= 0
    base = table[np.maximum(k, 0), 0]
    size = table[np.maximum(k, 0), 1]
    inside: npt.NDArray[np.bool_] = (
        found & (addresses >= base) & (addresses + nbytes <= base + size)
    )
    return inside


def gather_mask(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    left: npt.NDArray[np.bool_],
    mine: list[tuple[int, int]],
) -> npt.NDArray[np.bool_]:
    """Which reads of a batch one indexed gather copies: of those ``left`` (not in a
    2-D run), the small (at most :data:`SMALL_PIECE`), :data:`GATHER_UNIT`-aligned
    ones whose two ends both lie in memory of the engine's own device (``mine``:
    its allocations, ``(base, bytes)``); none unless at least two are. The gather
    indexes one span of device memory from its lowest to its highest address: a
    span reaching into another device's memory (or host memory) is an illegal
    address, and that error is sticky (every later copy of the process fails)."""
    aligned = ((dst | src | nbytes) % GATHER_UNIT) == 0
    small: npt.NDArray[np.bool_] = left & aligned & (nbytes <= SMALL_PIECE)
    small &= on_one_device(dst, nbytes, mine) & on_one_device(src, nbytes, mine)
    if int(small.sum()) <= 1:
        small[:] = False
    return small


def gather_units(
    space: torch.Tensor,
    base: int,
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (every one a
    multiple of :data:`GATHER_UNIT`, inside ``space``: int64 units of memory starting
    at address ``base``; reads validated, destinations disjoint) with one indexed copy
    on ``space``'s device. The indices are built there from one start and one count
    per read, so a 4 KiB read costs 24 bytes of upload, not a call of its own."""
    import torch

    dev = space.device
    counts = torch.from_numpy(nbytes // GATHER_UNIT).to(dev)
    d0 = torch.from_numpy((dst - base) // GATHER_UNIT).to(dev)
    s0 = torch.from_numpy((src - base) // GATHER_UNIT).to(dev)
    total = int(nbytes.sum()) // GATHER_UNIT
    first = torch.cumsum(counts, 0) - counts
    step = torch.arange(total, device=dev) - torch.repeat_interleave(
        first, counts, output_size=total
    )
    di = torch.repeat_interleave(d0, counts, output_size=total) + step
    si = torch.repeat_interleave(s0, counts, output_size=total) + step
    space[di] = space[si]


CU_MEMORYTYPE_UNIFIED = 4
MAX_PITCH = (1 << 31) - 1
"""Bytes: the widest row pitch a 2-D copy is given (the driver's limit is of this order)."""
MIN_RUN = 4
"""Reads: a regular run shorter than this is copied read by read."""


BATCH_MAX = 1 << 16
"""Reads per ``cuMemcpyBatchAsync`` call (a batch is cut into calls of at most this)."""
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
"""The source is read in stream order (after the work queued before the copy)."""


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` of the driver API (cuda.h, CUDA 12.8+): the source's
    access order, a location hint for each side (``CUmemLocation``: type, id; zero:
    none) and flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHintType", ctypes.c_int),
        ("srcLocHintId", ctypes.c_int),
        ("dstLocHintType", ctypes.c_int),
        ("dstLocHintId", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` of the driver API (cuda.h), field for field."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


def strided_runs(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    min_count: int = MIN_RUN,
) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive reads that are one 2-D copy: ``(first read, count, dst
    pitch, src pitch)``, every read of a run ``nbytes`` long, each ``dst pitch``
    after the last at the destination and ``src pitch`` at the source, both pitches
    at least the width (rows do not overlap) and at most :data:`MAX_PITCH`. A pack
    spec read directly (a strided block, row by row) is one run. Runs shorter than
    ``min_count`` are not listed."""
    d, s, b = dst.tolist(), src.tolist(), nbytes.tolist()
    n, runs, i = len(d), [], 0
    while i < n:
        end = i + 1
        if end < n and b[end] == b[i] and b[i] > 0:
            dp, sp = d[end] - d[i], s[end] - s[i]
            if b[i] <= dp <= MAX_PITCH and b[i] <= sp <= MAX_PITCH:
                end += 1
                while (
                    end < n
                    and b[end] == b[i]
                    and d[end] - d[end - 1] == dp
                    and s[end] - s[end - 1] == sp
                ):
                    end += 1
                if end - i >= min_count:
                    runs.append((i, end - i, dp, sp))
                    i = end
                    continue
        i += 1
    return runs


class Span:
    """``count`` int64 units of device memory at ``base``, as PyTorch imports it
    (``__cuda_array_interface__``): no copy, no ownership."""

    def __init__(self, base: int, count: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (count,),
            "typestr": "<i8",
            "data": (base, False),
            "version": 3,
            "strides": None,
        }
