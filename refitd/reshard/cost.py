"""The per-copy cost model: exact segments, a pack spec, or a bounding-rows pull.

A copy whose exact segments fit the descriptor budget is always pulled exactly (no
extra wire bytes, nothing to replay). Otherwise the cheapest option within budget
wins, by

    cost = wire bytes + DESCRIPTOR_COST_BYTES * descriptors (+ PACK_COST_BYTES per pack)

``DESCRIPTOR_COST_BYTES`` prices one descriptor as the bytes the wire could have
moved in the time it takes to post, track and complete one extra read: about 1 µs
of a ~16 GB/s path, i.e. 16 KiB. ``PACK_COST_BYTES`` adds the same again for each
pack spec, for the source-side gather that has to run before the read.

This module only *fits* pack specs; :mod:`refitd.reshard.transfer_plan` applies
the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "DESCRIPTOR_COST_BYTES",
    "PACK_COST_BYTES",
    "PackFit",
    "fit_pack",
    "fit_progression",
]

IntArray = npt.NDArray[np.int64]

DESCRIPTOR_COST_BYTES = 16 * 1024
"""Price of one descriptor, in wire bytes (see the module docstring)."""

PACK_COST_BYTES = 16 * 1024
"""Extra price of a pack spec over a plain descriptor, in wire bytes."""


@dataclass(frozen=True)
class PackFit:
    """A strided region equal to a set of equal-length reads, in bytes.

    ``shape`` is in elements (its last dim is the run length); ``src_strides`` and
    ``dst_strides`` are byte strides; ``dst_strides`` is ``None`` when the packed
    bytes land contiguous at ``dst0``.
    """

    src0: int
    dst0: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...] | None


def fit_progression(values: IntArray) -> list[tuple[int, int]] | None:
    """Write ``values`` as a nested arithmetic progression, outer dim first.

    Returns ``[(count, stride), ...]`` with ``values == v0 + sum(i_k * stride_k)``
    over the row-major index, or ``None`` when no such shape exists.
    """
    if values.size == 0:
        return None
    dims: list[tuple[int, int]] = []
    cur = values
    while cur.size > 1:
        step = int(cur[1] - cur[0])
        diffs = np.diff(cur)
        bad = np.flatnonzero(diffs != step)
        inner = cur.size if bad.size == 0 else int(bad[0]) + 1
        if cur.size % inner:
            return None
        block = cur.reshape(-1, inner)
        if not bool((np.diff(block, axis=1) == step).all()):
            return None
        dims.insert(0, (inner, step))
        cur = block[:, 0]
    return dims or [(1, 0)]


def _fit_shape(values: IntArray, shape: list[int]) -> list[int] | None:
    """Byte strides with which ``values`` is affine over ``shape``, else ``None``."""
    strides: list[int] = []
    pos = 1
    for n in reversed(shape):
        strides.insert(0, int(values[pos] - values[0]) if n > 1 else 0)
        pos *= n
    expected = np.full(shape, values[0], dtype=np.int64)
    for k, (n, s) in enumerate(zip(shape, strides, strict=True)):
        axis = [1] * len(shape)
        axis[k] = n
        expected = expected + (np.arange(n, dtype=np.int64) * s).reshape(axis)
    return strides if np.array_equal(expected.reshape(-1), values) else None


def fit_pack(addr: IntArray, dst: IntArray, nbytes: IntArray, elsize: int) -> PackFit | None:
    """Fit reads ``(addr, dst, nbytes)`` of one session, in destination order, as one
    pack spec; ``None`` when they are not one strided region on both sides."""
    if addr.size < 2 or not bool((nbytes == nbytes[0]).all()) or int(nbytes[0]) % elsize:
        return None
    dims = fit_progression(addr)
    if dims is None or any(s < 0 for _, s in dims):
        return None
    shape = [n for n, _ in dims]
    dst_str = _fit_shape(dst, shape)
    if dst_str is None or any(s < 0 for s in dst_str):
        return None
    run = int(nbytes[0])
    full_shape = (*shape, run // elsize)
    src_strides = (*(s for _, s in dims), elsize)
    dst_strides = (*dst_str, elsize)
    packed = [elsize] * len(full_shape)
    for k in range(len(full_shape) - 2, -1, -1):
        packed[k] = packed[k + 1] * full_shape[k + 1]
    contiguous = all(
        n == 1 or d == p for n, d, p in zip(full_shape, dst_strides, packed, strict=True)
    )
    return PackFit(
        int(addr[0]), int(dst[0]), full_shape, src_strides, None if contiguous else dst_strides
    )
