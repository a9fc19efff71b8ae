"""Resolve one recorded copy to the exact source bytes it reads, as contiguous reads.

A :class:`~refitd.reshard.types.RecordedCopy` says: the engine's loader applied an
op chain to a full source tensor and copied the result into a (possibly strided)
view of a parameter. This module turns that into *runs*: maximal stretches where
both the source element and the destination element advance by one, then cuts the
runs at shard boundaries and merges neighbours that are contiguous on both sides.

Resolution, all exact and never per element:

1. **Views.** The chain is replayed on a zero-storage meta tensor laid out as the
   contiguous global tensor; ``contiguous()`` is skipped (it never changes which
   source element lands where) and ``view`` is replayed as ``reshape``. While the
   result is a view of the base, its ``storage_offset``/``stride`` *are* the map
   from result index to global element.
2. **Materializing steps.** A ``reshape``/``flatten`` that torch cannot express as a
   view (``t().reshape(-1)``, MLA's split heads flattened, a fused weight unfused by
   ``view``/``select``/``reshape``) starts an intermediate contiguous index space:
   the map so far becomes a table of runs over that space, later ops are replayed
   on a fresh contiguous base, and the runs are composed back through the tables
   (the same interval intersection that cuts runs at shards). Only the rows of an
   intermediate space that are actually read are tabulated.

Units: ``*_elem`` and run arrays are in elements; ``addr``, ``*_byte`` and
``nbytes`` are bytes.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from refitd.errors import PlanError
from refitd.reshard.chunks import ChunkTable, chunk_table
from refitd.reshard.replay import MULTI_OUTPUT_OPS, replay_ops, validate_op
from refitd.reshard.types import OpChain, RecordedCopy, UnsupportedReshard, castable

__all__ = [
    "Pieces",
    "Read",
    "Runs",
    "Shard",
    "check_cast",
    "check_dtype",
    "coalesce",
    "contiguous_strides",
    "copy_runs",
    "plan_pull",
    "split_runs",
    "write_through_pointer",
]

IntArray = npt.NDArray[np.int64]

RUN_LIMIT = 1 << 24
"""Most runs one copy may resolve to before the plan is refused as unreasonable."""


@dataclass(frozen=True)
class Shard:
    """A box of a full tensor published by one peer.

    ``shard_offset`` and ``shape`` are in elements of the global tensor. The box's
    elements sit contiguous and row-major (in the box's own shape) starting at byte
    address ``addr`` of the buffer named by ``session``; ``elsize`` is bytes per
    element.
    """

    shard_offset: tuple[int, ...]
    shape: tuple[int, ...]
    session: str
    addr: int
    elsize: int


@dataclass(frozen=True)
class Read:
    """One contiguous read: ``nbytes`` from ``src_addr`` of ``session`` to byte
    ``dst_byte`` of parameter ``param_name``'s storage (or of a staging buffer)."""

    session: str
    src_addr: int
    dst_byte: int
    nbytes: int
    param_name: str


@dataclass(frozen=True)
class Runs:
    """Element runs of one copy in destination order.

    ``src`` is the first global (row-major) element of each run, ``dst`` the first
    element of the destination storage, ``length`` the run length in elements.
    """

    src: IntArray
    dst: IntArray
    length: IntArray

    def __len__(self) -> int:
        return int(self.src.shape[0])


@dataclass(frozen=True)
class Pieces:
    """Byte reads cut to shard boundaries, in destination order.

    ``shard`` indexes the source's shard list, ``session`` a caller-chosen session
    code, ``addr`` is the absolute source byte address, ``dst`` the destination byte
    offset and ``nbytes`` the length.
    """

    shard: IntArray
    session: IntArray
    addr: IntArray
    dst: IntArray
    nbytes: IntArray

    def __len__(self) -> int:
        return int(self.addr.shape[0])

    def total(self) -> int:
        return int(self.nbytes.sum())

    def take(self, index: IntArray | npt.NDArray[np.bool_]) -> Pieces:
        return Pieces(
            self.shard[index],
            self.session[index],
            self.addr[index],
            self.dst[index],
            self.nbytes[index],
        )

    @staticmethod
    def concat(parts: list[Pieces]) -> Pieces:
        if not parts:
            return Pieces(*(np.zeros(0, dtype=np.int64) for _ in range(5)))
        return Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in _PIECE_FIELDS))


_PIECE_FIELDS = ("shard", "session", "addr", "dst", "nbytes")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    return tuple(strides)


def _meta_base(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty_strided(shape, contiguous_strides(shape), dtype=torch.uint8, device="meta")


def _viewable_chain(chain: OpChain) -> OpChain:
    """The chain with ``contiguous()`` dropped and ``view`` replayed as ``reshape``."""
    out = []
    for op in chain:
        validate_op(op)
        name, args, kwargs = op
        if name == "contiguous":
            continue
        if name == "view":
            if any(isinstance(a, torch.dtype) for a in args) or kwargs:
                raise UnsupportedReshard(
                    f"view as another dtype reinterprets bytes; refused {op!r}"
                )
            name = "reshape"
        out.append((name, args, kwargs))
    return tuple(out)


def _is_view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t is base or t._base is base


Strided = tuple[int, tuple[int, ...], tuple[int, ...]]
"""``(offset, shape, strides)`` in elements: result index -> global element."""


def _steps(chain: OpChain) -> list[OpChain]:
    """The chain cut into replayable steps: a multi-output op travels with its pick."""
    steps: list[OpChain] = []
    i = 0
    while i < len(chain):
        width = 2 if chain[i][0] in MULTI_OUTPUT_OPS else 1
        steps.append(chain[i : i + width])
        i += width
    return steps


def _strided_maps(chain: OpChain, global_shape: tuple[int, ...]) -> list[Strided]:
    """Resolve ``chain`` to a composition of strided maps, innermost last.

    ``maps[0]`` maps its index space to global elements; each later map takes its
    index to an element of the previous map's index space laid out contiguous.
    A single map means the whole chain is a view of the source.
    """
    base = _meta_base(global_shape)
    t = base
    maps: list[Strided] = []
    try:
        for step in _steps(_viewable_chain(chain)):
            out = replay_ops(t, step)
            if not _is_view_of(out, base):
                # torch had to copy: the map so far ends here, and the step is
                # replayed on a contiguous stand-in for the copy.
                maps.append((int(t.storage_offset()), tuple(t.shape), tuple(t.stride())))
                base = _meta_base(tuple(t.shape))
                out = replay_ops(base, step)
            t = out
    except (RuntimeError, IndexError, TypeError, ValueError) as exc:
        raise UnsupportedReshard(
            f"op chain {chain!r} fails on shape {global_shape}: {exc}"
        ) from exc
    maps.append((int(t.storage_offset()), tuple(t.shape), tuple(t.stride())))
    return maps


def _table(m: Strided, lo: int, hi: int) -> ChunkTable:
    """Runs of map ``m`` over its contiguous index space, as a chunk table keyed by
    index-space position, restricted to the dim-0 rows covering ``[lo, hi)``."""
    off, shape, strides = m
    if shape and hi > lo:
        row = math.prod(shape[1:])
        r0, r1 = lo // max(row, 1), -(-hi // max(row, 1))
        off, shape = off + r0 * strides[0], (r1 - r0, *shape[1:])
        start = r0 * row
    else:
        start = 0
    runs = _joint_strided((off, shape, strides), start, shape, contiguous_strides(shape))
    zero = np.zeros(len(runs), dtype=np.int64)
    return ChunkTable(runs.dst, runs.dst + runs.length, runs.src, zero)


def _joint_strided(
    src: Strided, dest_offset: int, dest_shape: tuple[int, ...], dest_stride: tuple[int, ...]
) -> Runs:
    s_off, shape, s_str = src
    dims = [(n, s, d) for n, s, d in zip(shape, s_str, dest_stride, strict=True) if n != 1]
    if any(n == 0 for n, _, _ in dims) or 0 in shape:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    # Walk in destination order so runs come out sorted by destination.
    dims.sort(key=lambda x: -x[2])
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:
        if merged and merged[-1][1] == s * n and merged[-1][2] == d * n:
            merged[-1] = (merged[-1][0] * n, s, d)
        else:
            merged.append((n, s, d))
    run = 1
    if merged and merged[-1][1] == 1 and merged[-1][2] == 1:
        run = merged.pop()[0]
    count = math.prod(n for n, _, _ in merged)
    if count > RUN_LIMIT:
        raise UnsupportedReshard(f"copy resolves to {count} runs, above the {RUN_LIMIT} limit")
    src_start = np.array([s_off], dtype=np.int64)
    dst_start = np.array([dest_offset], dtype=np.int64)
    for n, s, d in merged:
        steps = np.arange(n, dtype=np.int64)
        src_start = (src_start[:, None] + steps * s).ravel()
        dst_start = (dst_start[:, None] + steps * d).ravel()
    return Runs(src_start, dst_start, np.full(src_start.shape[0], run, dtype=np.int64))


def _broadcast(src: Strided, dest_shape: tuple[int, ...]) -> Strided:
    off, shape, stride = src
    meta = torch.empty(0, dtype=torch.uint8, device="meta").as_strided(shape, stride, off)
    try:
        out = torch.broadcast_to(meta, dest_shape)
    except RuntimeError as exc:
        raise UnsupportedReshard(
            f"copy_ of a {tuple(shape)} view into a {dest_shape} destination does not broadcast"
        ) from exc
    return off, tuple(out.shape), tuple(out.stride())


def copy_runs(copy: RecordedCopy, global_shape: tuple[int, ...]) -> Runs:
    """Resolve ``copy`` to element runs of the global tensor, in destination order.

    Raises :class:`UnsupportedReshard` when the chain is malformed, does not fit the
    destination, or resolves to more than :data:`RUN_LIMIT` runs.
    """
    global_shape = tuple(int(n) for n in global_shape)
    maps = _strided_maps(copy.op_chain, global_shape)
    dest = (copy.dest_offset, tuple(copy.dest_shape), tuple(copy.dest_stride))
    runs = _joint_strided(_broadcast(maps[-1], dest[1]), *dest)
    for m in reversed(maps[:-1]):
        if not len(runs):
            break
        lo, hi = int(runs.src.min()), int((runs.src + runs.length).max())
        _, src, dst, length = split_runs(runs, _table(m, lo, hi), 1)
        runs = Runs(src, dst, length)
    return runs


def split_runs(
    runs: Runs, table: ChunkTable, elsize: int
) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """Cut ``runs`` at chunk boundaries.

    Returns ``(chunk, storage_byte, dst_byte, nbytes)`` per piece in destination
    order, where ``storage_byte`` is relative to the owning shard's ``addr``.
    Raises :class:`PlanError` if any needed element is in no shard.
    """
    a = runs.src
    e = a + runs.length
    k0 = np.searchsorted(table.end, a, side="right")
    k1 = np.searchsorted(table.start, e, side="left")
    cnt = np.maximum(k1 - k0, 0)
    total = int(cnt.sum())
    rep = np.repeat(np.arange(len(runs), dtype=np.int64), cnt)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    k = np.repeat(k0, cnt) + (np.arange(total, dtype=np.int64) - first)
    ps = np.maximum(a[rep], table.start[k])
    pe = np.minimum(e[rep], table.end[k])
    covered = np.zeros(len(runs), dtype=np.int64)
    np.add.at(covered, rep, pe - ps)
    if not np.array_equal(covered, runs.length):
        bad = int(np.flatnonzero(covered != runs.length)[0])
        lo, hi = _first_gap(int(a[bad]), int(e[bad]), ps[rep == bad], pe[rep == bad])
        raise PlanError(
            f"no published shard holds global elements [{lo}, {hi}) (row-major) that a "
            f"copy reads; the shards do not cover the tensor"
        )
    storage = (table.storage[k] + (ps - table.start[k])) * elsize
    dst = (runs.dst[rep] + (ps - a[rep])) * elsize
    return table.chunk_shard[k], storage, dst, (pe - ps) * elsize


def _first_gap(a: int, e: int, starts: IntArray, ends: IntArray) -> tuple[int, int]:
    """The first stretch of ``[a, e)`` not covered by the ``[starts, ends)`` pieces."""
    pos = a
    for s0, s1 in sorted(zip(starts.tolist(), ends.tolist(), strict=True)):
        if s0 > pos:
            return pos, s0
        pos = max(pos, s1)
    return pos, e


def coalesce(p: Pieces) -> Pieces:
    """Merge each piece into its predecessor when both sides continue it exactly:
    same session, the next source byte and the next destination byte."""
    if len(p) < 2:
        return p
    end_src = p.addr[:-1] + p.nbytes[:-1]
    end_dst = p.dst[:-1] + p.nbytes[:-1]
    joins = (p.session[1:] == p.session[:-1]) & (end_src == p.addr[1:]) & (end_dst == p.dst[1:])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    if starts.size == len(p):
        return p
    merged = p.take(starts)
    return Pieces(
        merged.shard, merged.session, merged.addr, merged.dst, np.add.reduceat(p.nbytes, starts)
    )


def pieces_for(
    runs: Runs, table: ChunkTable, shards: list[Shard], session_codes: IntArray, elsize: int
) -> Pieces:
    """Runs cut to shards, as absolute source addresses, coalesced."""
    shard, storage, dst, nbytes = split_runs(runs, table, elsize)
    addrs = np.array([s.addr for s in shards], dtype=np.int64)
    return coalesce(Pieces(shard, session_codes[shard], addrs[shard] + storage, dst, nbytes))


def check_dtype(copy: RecordedCopy, src_dtype: torch.dtype) -> None:
    if copy.dest_dtype != src_dtype:
        raise UnsupportedReshard(
            f"copy of {copy.src_name!r} ({src_dtype}) into {copy.param_name!r} "
            f"({copy.dest_dtype}) converts dtype; a byte copy cannot do that"
        )


def plan_pull(
    copy: RecordedCopy,
    global_shape: tuple[int, ...],
    src_dtype: torch.dtype,
    elsize: int,
    shards: list[Shard],
) -> list[Read]:
    """Exact, coalesced reads that reproduce ``copy`` from ``shards``.

    Each read takes only bytes the copy needs; where replicas overlap, each
    region is read from exactly one of them. Destination offsets are bytes into the
    parameter's storage.
    """
    check_dtype(copy, src_dtype)
    shape = tuple(int(n) for n in global_shape)
    table = chunk_table(shape, shards)
    names = sorted({s.session for s in shards})
    codes = np.array([names.index(s.session) for s in shards], dtype=np.int64)
    p = pieces_for(copy_runs(copy, shape), table, shards, codes, elsize)
    return [
        Read(names[int(c)], int(a), int(d), int(n), copy.param_name)
        for c, a, d, n in zip(p.session, p.addr, p.dst, p.nbytes, strict=True)
    ]


def check_cast(copy: RecordedCopy, src_dtype: torch.dtype, bounded: bool) -> None:
    """A copy that converts dtype is planned as a full read (the source's rows staged
    in its own dtype, converted at install by the loader's ``copy_``): refuse one
    whose conversion is not replayable, or whose source cannot be staged. The
    loader's own casts (``copy.casts``, from ``.to()`` and the like) are replayed
    in order before the ``copy_``'s."""
    if not castable(src_dtype, copy.dest_dtype):
        check_dtype(copy, src_dtype)
    steps = [src_dtype, *copy.casts, copy.dest_dtype]
    for a, b in itertools.pairwise(steps):
        if a != b and not castable(a, b):
            raise UnsupportedReshard(
                f"copy of {copy.src_name!r} ({src_dtype}) into {copy.param_name!r} "
                f"({copy.dest_dtype}) converts {a} to {b} on the way, which is not replayable"
            )
    if not bounded:
        raise UnsupportedReshard(
            f"copy of {copy.src_name!r} ({src_dtype}) into {copy.param_name!r} "
            f"({copy.dest_dtype}) converts dtype, which is done at install from the "
            "source's rows staged whole, but its shards are not blocks of whole rows"
        )


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_through_pointer(ptr: int, copy: RecordedCopy, value: torch.Tensor) -> None:
    """Copy ``value`` (broadcast to ``copy.dest_shape``) into the strided destination
    of ``copy`` (elements of ``copy.dest_dtype``) inside the storage that starts at
    ``ptr`` (bytes)."""
    for dtype in copy.casts:
        # The loader's own conversions (``.to()``, ``.float()``...), in its order: a
        # conversion is elementwise, so converting the replayed view equals
        # converting before the movement ops, bit for bit.
        value = value.to(dtype)
    value = torch.broadcast_to(value, copy.dest_shape)
    if value.numel() == 0:
        return
    if value.dtype != copy.dest_dtype:
        # The loader's own conversion (``copy_`` into its parameter's dtype), so
        # the bits are the ones a fresh load leaves.
        value = torch.empty(value.shape, dtype=copy.dest_dtype).copy_(value)
    elsize = copy.dest_dtype.itemsize
    flat = value.contiguous().reshape(-1)
    if flat.stride(-1) != 1:  # one element counts as contiguous whatever its stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    flat = flat.view(_INT_OF_SIZE[elsize]).view(torch.uint8)
    src = flat.reshape(*copy.dest_shape, elsize).numpy()
    span = (
        copy.dest_offset
        + sum((n - 1) * s for n, s in zip(copy.dest_shape, copy.dest_stride, strict=True))
    ) * elsize + elsize
    mem = np.ctypeslib.as_array((ctypes.c_ubyte * span).from_address(ptr))
    dst = np.lib.stride_tricks.as_strided(
        mem[copy.dest_offset * elsize :],
        (*copy.dest_shape, elsize),
        (*(s * elsize for s in copy.dest_stride), 1),
    )
    dst[...] = src
