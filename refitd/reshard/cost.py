"""The per-copy cost model: exact reads, a pack spec, or a bounding-rows pull.

A copy whose exact reads fit the descriptor budget is always pulled exactly (no
extra wire bytes, nothing to replay). Otherwise the cheapest option within budget
wins, by

    cost = wire bytes + DESCRIPTOR_COST_BYTES * descriptors (+ PACK_COST_BYTES per pack)

``DESCRIPTOR_COST_BYTES`` prices one descriptor as the bytes the wire could have
moved in the time it takes to post, track and complete one extra read: about 1 µs
of a ~16 GB/s path, i.e. 16 KiB. ``PACK_COST_BYTES`` adds the same again for each
pack spec, for the source-side gather that has to run before the read.

This module fits pack specs and chooses each copy's option (:func:`choose`);
:mod:`refitd.reshard.transfer_plan` assembles the choices into a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from refitd.reshard.slice_plan import Pieces, Shard
from refitd.reshard.types import RecordedCopy

__all__ = [
    "DESCRIPTOR_COST_BYTES",
    "PACK_COST_BYTES",
    "Choice",
    "PackFit",
    "choose",
    "fit_pack",
    "fit_progression",
    "full_cost",
    "full_read_rows",
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


@dataclass
class Choice:
    """One copy's option: ``kind`` ``exact``, ``pack`` or ``full``; its exact
    (coalesced) and raw pieces; for ``pack``, the fitted packs with their session
    code (``exact`` then holds the pieces no pack covers)."""

    copy: RecordedCopy
    kind: str
    exact: Pieces
    raw: Pieces
    packs: list[tuple[PackFit, int]] = field(default_factory=list)


def _groups(codes: IntArray) -> list[IntArray]:
    """Indices of each distinct code, groups in first-seen order."""
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    return [np.flatnonzero(inverse == g) for g in order]


def full_read_rows(raw: Pieces, shards: Sequence[Shard], elsize: int) -> dict[int, tuple[int, int]]:
    """Bounding shard-local row range ``[r0, r1)`` per touched shard (``raw``'s
    shards index ``shards``; ``elsize`` bytes an element)."""
    rows: dict[int, tuple[int, int]] = {}
    for k in np.unique(raw.shard).tolist():
        shard = shards[k]
        row_bytes = math.prod(shard.shape[1:]) * elsize
        sel = raw.shard == k
        rel = raw.addr[sel] - shard.addr
        r0 = int(rel.min()) // row_bytes
        r1 = -(-int((rel + raw.nbytes[sel]).max()) // row_bytes)
        rows[k] = (r0, r1)
    return rows


def full_cost(raw: Pieces, shards: Sequence[Shard], elsize: int) -> tuple[int, int]:
    """A full read's wire bytes and descriptors (one per touched shard)."""
    rows = full_read_rows(raw, shards, elsize)
    wire = sum((r1 - r0) * math.prod(shards[k].shape[1:]) * elsize for k, (r0, r1) in rows.items())
    return wire, len(rows)


def choose(
    copy: RecordedCopy,
    raw: Pieces,
    exact: Pieces,
    shards: Sequence[Shard],
    elsize: int,
    bounded: bool,
    budget: int,
    pack_specs: bool,
    costs: tuple[int, int],
) -> Choice:
    """The option for one copy (the module docstring): exact when its ``exact``
    pieces fit ``budget`` descriptors, else the cheapest within budget of exact, a
    pack spec per session (with ``pack_specs``) and, for a ``bounded`` (dim-0
    blocked) source, a full read; ``costs`` prices a descriptor and a pack spec."""
    descriptor_cost, pack_cost = costs
    n_exact = len(exact)
    if n_exact <= budget:
        return Choice(copy, "exact", exact, raw)
    total = exact.total()
    options: list[tuple[bool, int, int, Choice]] = [
        (False, total + descriptor_cost * n_exact, 0, Choice(copy, "exact", exact, raw))
    ]
    if pack_specs:
        keep: list[IntArray] = []
        packs: list[tuple[PackFit, int]] = []
        for g in _groups(exact.session):
            fit = fit_pack(exact.addr[g], exact.dst[g], exact.nbytes[g], elsize)
            if fit is not None:
                packs.append((fit, int(exact.session[g[0]])))
                continue
            # One session may hold several unrelated buffers: try each shard alone.
            for sub in _groups(exact.shard[g]):
                h = g[sub]
                fit = fit_pack(exact.addr[h], exact.dst[h], exact.nbytes[h], elsize)
                if fit is None:
                    keep.append(h)
                else:
                    packs.append((fit, int(exact.session[h[0]])))
        n = sum(len(g) for g in keep) + len(packs)
        cost = total + descriptor_cost * n + pack_cost * len(packs)
        rest = (
            exact.take(np.sort(np.concatenate(keep))) if keep else exact.take(np.zeros(0, np.int64))
        )
        options.append((n <= budget, cost, 1, Choice(copy, "pack", rest, raw, packs)))
    if bounded:
        wire, n = full_cost(raw, shards, elsize)
        options.append(
            (n <= budget, wire + descriptor_cost * n, 2, Choice(copy, "full", exact, raw))
        )
    if not pack_specs and bounded:
        return options[-1][3]
    within = [o for o in options if o[0]]
    return min(within or options, key=lambda o: (o[1], o[2]))[3]
