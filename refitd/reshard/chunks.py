"""Where each element of a full tensor can be read from: a shard's *chunks*.

A shard is a box of the global tensor stored row-major in its own shape. Seen in
global row-major order, the box is a sequence of *chunks*: for every index of the
leading dims the box only partly covers, one stretch that is contiguous both in the
global order and in the shard's storage. A dim-0 block is a single chunk; a dim-1
block of a matrix has one chunk per row.

Replicas (shards covering the same elements) are resolved here, once per source:
every global element is assigned to exactly one shard, so no byte is read twice.
The choice is deterministic and spreads bytes across sessions (least-loaded first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from refitd.errors import PlanError


class ShardBox(Protocol):
    """What a chunk table reads of a shard (:class:`refitd.reshard.slice_plan.Shard`
    is one): where its block sits in the full tensor (elements), its element size
    (bytes) and the session that holds it."""

    @property
    def shard_offset(self) -> tuple[int, ...]: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def elsize(self) -> int: ...
    @property
    def session(self) -> str: ...


__all__ = ["ChunkTable", "chunk_table", "is_dim0_block"]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ChunkTable:
    """Disjoint chunks sorted by global position (all in elements).

    Chunk ``k`` covers global elements ``[start[k], end[k])``; they are stored at
    element ``storage[k]`` of shard ``chunk_shard[k]``'s storage onwards.
    """

    start: IntArray
    end: IntArray
    storage: IntArray
    chunk_shard: IntArray


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def is_dim0_block(global_shape: tuple[int, ...], shard: ShardBox) -> bool:
    """True when the shard covers every trailing dim whole (a block of dim-0 rows)."""
    return all(n == g for n, g in zip(shard.shape[1:], global_shape[1:], strict=True))


def _check_shard(global_shape: tuple[int, ...], shard: ShardBox, elsize: int | None) -> None:
    if len(shard.shard_offset) != len(global_shape) or len(shard.shape) != len(global_shape):
        raise PlanError(
            f"shard at {shard.shard_offset} of session {shard.session!r} has rank "
            f"{len(shard.shape)}, but the tensor is {global_shape}"
        )
    for o, n, g in zip(shard.shard_offset, shard.shape, global_shape, strict=True):
        if o < 0 or n < 0 or o + n > g:
            raise PlanError(
                f"shard {shard.shard_offset}+{shard.shape} of session {shard.session!r} "
                f"lies outside the tensor {global_shape}"
            )
    if elsize is not None and shard.elsize != elsize:
        raise PlanError(
            f"shard of session {shard.session!r} has elsize {shard.elsize}, tensor has {elsize}"
        )


def _shard_chunks(global_shape: tuple[int, ...], shard: ShardBox) -> tuple[IntArray, int]:
    """Global start of every chunk of ``shard`` (in storage order) and the chunk length."""
    if not global_shape:
        return np.zeros(1, dtype=np.int64), 1
    g_strides = _contiguous(global_shape)
    partial = [d for d, (n, g) in enumerate(zip(shard.shape, global_shape, strict=True)) if n != g]
    c = partial[-1] if partial else 0
    starts = np.array(
        [sum(o * s for o, s in zip(shard.shard_offset[: c + 1], g_strides[: c + 1], strict=True))],
        dtype=np.int64,
    )
    for d in range(c):
        steps = np.arange(shard.shape[d], dtype=np.int64) * g_strides[d]
        starts = (starts[:, None] + steps).ravel()
    return starts, shard.shape[c] * g_strides[c]


def chunk_table(
    global_shape: tuple[int, ...],
    shards: Sequence[ShardBox],
    elsize: int | None = None,
    loads: dict[str, int] | None = None,
) -> ChunkTable:
    """Build the disjoint chunk table of a source from its shards.

    ``loads`` (bytes already assigned per session, updated in place) steers replica
    choice toward the least-loaded session; ties go to the earlier shard.
    """
    loads = {} if loads is None else loads
    for shard in shards:
        _check_shard(global_shape, shard, elsize)
    starts: list[IntArray] = []
    lens: list[IntArray] = []
    owner: list[IntArray] = []
    storage: list[IntArray] = []
    for i in _one_per_box(shards, loads):
        shard = shards[i]
        if math.prod(shard.shape) == 0:
            continue
        s, n = _shard_chunks(global_shape, shard)
        starts.append(s)
        lens.append(np.full(s.shape[0], n, dtype=np.int64))
        owner.append(np.full(s.shape[0], i, dtype=np.int64))
        storage.append(np.arange(s.shape[0], dtype=np.int64) * n)
    if not starts:
        z = np.zeros(0, dtype=np.int64)
        return ChunkTable(z, z, z, z)
    start = np.concatenate(starts)
    end = start + np.concatenate(lens)
    shard_of = np.concatenate(owner)
    stor = np.concatenate(storage)
    order = np.lexsort((shard_of, start))
    start, end, shard_of, stor = start[order], end[order], shard_of[order], stor[order]
    if start.size > 1 and bool((end[:-1] > start[1:]).any()):
        start, end, shard_of, stor = _resolve_replicas(start, end, shard_of, stor, shards, loads)
    return ChunkTable(start, end, stor, shard_of)


def _one_per_box(shards: Sequence[ShardBox], loads: dict[str, int]) -> list[int]:
    """Indices of the shards to read, one per distinct box, in shard order.

    Replicas usually repeat whole boxes (data-parallel copies of one layout), so a
    whole box is given to one replica: reads stay coalescable inside its storage,
    and boxes alternate between sessions by bytes assigned so far. Partial overlaps
    are left to the chunk-level resolution.
    """
    by_box: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, shard in enumerate(shards):
        by_box.setdefault((tuple(shard.shard_offset), tuple(shard.shape)), []).append(i)
    if len(by_box) == len(shards):
        return list(range(len(shards)))
    keep = []
    for (_, shape), group in by_box.items():
        pick = min(group, key=lambda i: (loads.get(shards[i].session, 0), i))
        nbytes = math.prod(shape) * shards[pick].elsize
        loads[shards[pick].session] = loads.get(shards[pick].session, 0) + nbytes
        keep.append(pick)
    return sorted(keep)


def _resolve_replicas(
    start: IntArray,
    end: IntArray,
    shard_of: IntArray,
    stor: IntArray,
    shards: Sequence[ShardBox],
    loads: dict[str, int],
) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """Split overlapping chunks at every boundary and give each piece one owner."""
    bounds = np.unique(np.concatenate([start, end]))
    covering: list[list[int]] = [[] for _ in range(bounds.size - 1)]
    lo = np.searchsorted(bounds, start)
    hi = np.searchsorted(bounds, end)
    for k in range(start.size):
        for j in range(int(lo[k]), int(hi[k])):
            covering[j].append(k)
    out: list[tuple[int, int, int, int]] = []
    j = 0
    while j < len(covering):
        cands = covering[j]
        if not cands:
            j += 1
            continue
        # A maximal stretch covered by the same shards gets one owner, so a
        # replica switch never fragments reads more than the overlap demands.
        owners = [int(shard_of[k]) for k in cands]
        j_end = j + 1
        while j_end < len(covering) and [int(shard_of[k]) for k in covering[j_end]] == owners:
            j_end += 1
        nbytes = int(bounds[j_end] - bounds[j]) * shards[owners[0]].elsize
        pick = min(range(len(cands)), key=lambda i: (loads.get(shards[owners[i]].session, 0), i))
        loads[shards[owners[pick]].session] = loads.get(shards[owners[pick]].session, 0) + nbytes
        for jj in range(j, j_end):
            k = next(c for c in covering[jj] if int(shard_of[c]) == owners[pick])
            b0 = int(bounds[jj])
            out.append((b0, int(bounds[jj + 1]), owners[pick], int(stor[k]) + b0 - int(start[k])))
        j = j_end
    arr = np.array(out, dtype=np.int64).reshape(-1, 4)
    return arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), arr[:, 3].copy()
