"""Applying a delta at the engine: each changed unit written where a full refit would
have landed it, every write kept in an undo record.

Pure (numpy, no I/O, no ``await``): the receiver
(:class:`~refitd.client.deltarefit.DeltaReceiver`) reads the stream and calls
:func:`apply_chunk` on each chunk, in a worker thread. A unit of the plan's stream
(:mod:`refitd.delta.stream`) lands in

- the engine's own memory (a read landing in the engine region, or in staging
  mode's image of it in scratch);
- a packed block that the install scatters through its destination strides: the
  unit is written where the scatter would put it;
- a full read's staged tensor, kept in scratch (staging mode): the unit is patched
  there and the full read replayed into its parameters (:attr:`Target.replay`, the
  receiver's install of full reads), each destination parameter kept whole first.

Where every read lands whole in the engine (no scattered block, no full read, no
two destinations overlapping: :attr:`Landing.direct`), a unit's place is its read's
origin plus its stream index, and the native stage decodes, writes and digests in
one pass (:func:`refitd.delta.native.place_write`); the general path is its
reference. A value is the base's unit where it lands plus the difference sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from refitd.delta import native
from refitd.delta.diff import unit_dtype
from refitd.delta.digest import EngineDigest
from refitd.delta.stream import (
    areas_of,
    cut,
    decode,
    decode_values,
    landing,
    layout,
    scattered,
    unpack_nibbles,
)
from refitd.delta.undo import UndoLog
from refitd.errors import ConflictError

__all__ = ["Chunk", "Landing", "Plan", "Target", "apply_chunk"]

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


class Chunk(Protocol):
    """A chunk of a streamed delta as the apply reads it: the encoded parts' sizes
    (``pages`` counts, ``changed`` positions, ``exceptions`` whole units, differences
    of ``diff_bits``), and which units of the plan's stream it covers (``first`` on,
    ``units`` of them, of ``unit`` bytes)."""

    @property
    def index(self) -> int: ...
    @property
    def pages(self) -> int: ...
    @property
    def changed(self) -> int: ...
    @property
    def exceptions(self) -> int: ...
    @property
    def diff_bits(self) -> int: ...
    @property
    def unit(self) -> int: ...
    @property
    def base_version(self) -> int: ...
    @property
    def first(self) -> int: ...
    @property
    def units(self) -> int: ...


class Plan(Protocol):
    """A compiled pull as the apply reads it: its rows ``(src region, src offset, dst
    region, dst offset, nbytes)``, pack specs (``dst_region``, ``dst_offset``,
    ``nbytes``), scatter entries ``(scratch offset, dtype, shape, strides in elements,
    parameter, byte in it)`` and full reads ``(scratch offset, full read)``."""

    @property
    def rows(self) -> I64: ...
    @property
    def packs(self) -> Sequence[Any]: ...
    @property
    def scatter(self) -> Sequence[Any]: ...
    @property
    def full_reads(self) -> Sequence[tuple[int, Any]]: ...


@dataclass
class Target:
    """The engine memory a delta writes: the engine region's bytes, the scratch
    region's (None: none placed), the engine's digest (kept up to date by every
    write), each parameter's ``(byte offset, nbytes)`` in the engine region, the
    base version (named in refusals), and ``replay``: writes the full reads of
    the given indices from scratch into their parameters."""

    engine: U8
    scratch: U8 | None
    digest: EngineDigest
    spans: Mapping[str, tuple[int, int]]
    base_version: int
    replay: Callable[[list[int]], None]


@dataclass(frozen=True)
class Landing:
    """Where a compiled pull's stream lands, worked out once per plan: its pieces
    ``(region, offset, bytes)`` in stream order (rows, then packs), each piece's
    scatter entry and full read (-1: none), the pieces' cumulative bytes, whether
    two destinations may write one engine byte, and whether every piece lands whole
    in the engine (the native one-pass path)."""

    pieces: I64
    scat_of: I64
    fr_of: I64
    ends: I64
    overlapping: bool
    direct: bool
    engine_id: int
    scratch_id: int
    limit: int  # scratch's first ``limit`` bytes: the engine's image (staging mode)

    @staticmethod
    def of(
        plan: Plan,
        engine_id: int,
        scratch_id: int,
        limit: int,
        spans: Mapping[str, tuple[int, int]],
    ) -> Landing:
        """The landing of ``plan`` in the engine region ``engine_id`` and the scratch
        region ``scratch_id`` (-2: none), whose first ``limit`` bytes are the
        engine's image; ``spans``: each parameter's ``(byte offset, nbytes)`` in the engine."""
        packs = [(p.dst_region, p.dst_offset, p.nbytes) for p in plan.packs]
        pieces = np.concatenate([plan.rows[:, 2:5], np.array(packs, dtype=np.int64).reshape(-1, 3)])
        scat_of, fr_of = areas_of(plan, pieces, scratch_id)
        overlap = _overlapping(plan, pieces, engine_id, scratch_id, limit, spans)
        in_image = (pieces[:, 0] == scratch_id) & (pieces[:, 1] + pieces[:, 2] <= limit)
        direct = (
            not (scat_of >= 0).any()
            and not (fr_of >= 0).any()
            and bool(((pieces[:, 0] == engine_id) | in_image).all())
            and not overlap
        )
        ends = np.cumsum(pieces[:, 2])
        return Landing(pieces, scat_of, fr_of, ends, overlap, direct, engine_id, scratch_id, limit)


def apply_chunk(
    at: Landing,
    plan: Plan,
    chunk: Chunk,
    payload: U8,
    target: Target,
    undo: UndoLog,
    parts: list[float],
) -> int:
    """Write ``chunk`` of the delta (its ``payload``) where a full refit by ``plan``
    would have landed each unit (module docstring), every write recorded in ``undo``
    and the digest kept up to date. Returns the units written; adds the seconds of
    placing, writing and the digest's update to ``parts``. A chunk that does not fit
    its plan is refused (:class:`ConflictError`) before it writes anything."""
    t0 = time.perf_counter()
    unit = chunk.unit
    udt = unit_dtype(unit)
    bits = chunk.diff_bits
    what = f"delta of v{chunk.base_version}+ refused: chunk {chunk.index}"
    if bits not in (4, 8):
        raise ConflictError(f"{what}: {bits}-bit differences are not a format")
    lay = layout(chunk.pages, chunk.changed, chunk.exceptions, unit, bits)
    if len(payload) < lay.exceptions + unit * chunk.exceptions:
        raise ConflictError(f"{what}: {len(payload)} bytes do not hold what it says")
    counts = payload[lay.counts : lay.counts + chunk.pages]
    low = payload[lay.low : lay.low + chunk.changed]
    diff = payload[lay.diff : lay.exceptions].view(np.int8)  # bits == 4: two a byte
    exceptions = payload[lay.exceptions : lay.exceptions + unit * chunk.exceptions].view(udt)
    if int(counts.sum()) != chunk.changed:
        raise ConflictError(
            f"{what}: its page counts sum to {int(counts.sum())}, not the "
            f"{chunk.changed} positions it carries"
        )
    pieces = at.pieces
    part = cut(pieces, chunk.first * unit, (chunk.first + chunk.units) * unit, at.ends)
    if at.direct:
        return _apply_direct(part, counts, low, diff, exceptions, target, undo, parts, t0, bits)
    if (chunk.first, chunk.units) != (0, int(pieces[:, 2].sum()) // unit):
        raise ConflictError(f"{what}: a plan that scatters is applied in one chunk")
    k = decode(counts, low)
    diff = (
        unpack_nibbles(diff.view(np.uint8), chunk.changed) if bits == 4 else diff[: chunk.changed]
    )
    piece, region, off = landing(pieces, k, unit)
    # Where each unit lands in the engine's memory (-1: in a scratch area).
    in_engine = (region == at.engine_id) | ((region == at.scratch_id) & (off < at.limit))
    eng = np.where(in_engine, off, -1)
    sid = at.scat_of[piece]
    hit = sid >= 0
    if hit.any():
        offsets = {name: lo for name, (lo, _n) in target.spans.items()}
        eng[hit] = scattered(plan.scatter, offsets, sid[hit], off[hit])
    fid = at.fr_of[piece]
    scratch_writes = fid >= 0
    dirty = np.flatnonzero(np.bincount(fid[scratch_writes], minlength=len(plan.full_reads)))
    unplaced = (eng < 0) & ~scratch_writes
    if unplaced.any():
        bad = int(np.flatnonzero(unplaced)[0])
        raise ConflictError(
            f"delta refused: stream unit {int(k[bad])} lands in region {int(region[bad])} "
            f"at {int(off[bad])}, outside the engine and this plan's scratch areas"
        )
    engine_u = target.engine.view(udt)
    at_eng = eng >= 0
    # Each value is sent as its difference from the base's unit where it lands.
    scratch_u = target.scratch.view(udt) if target.scratch is not None else None
    old = np.empty(len(k), dtype=udt)
    old[at_eng] = engine_u[eng[at_eng] // unit]
    if scratch_writes.any():
        assert scratch_u is not None
        old[scratch_writes] = scratch_u[off[scratch_writes] // unit]
    values = decode_values(old, diff, exceptions)
    idx = eng[at_eng] // unit
    vals, prev = values[at_eng], old[at_eng]
    if at.overlapping:
        # A unit written twice keeps its last value, as a full refit's later read would.
        last = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
        idx, vals, prev = idx[last], vals[last], prev[last]
    t1 = time.perf_counter()
    before = undo.write(engine_u, idx, vals, prev)
    t2 = time.perf_counter()
    target.digest.update_units(idx, before, vals)  # type: ignore[arg-type]
    t3 = time.perf_counter()
    if len(dirty):
        assert scratch_u is not None
        undo.write(scratch_u, off[scratch_writes] // unit, values[scratch_writes])
        _replay(plan, dirty.tolist(), target, undo)
    t4 = time.perf_counter()
    parts[0] += t1 - t0
    parts[1] += (t2 - t1) + (t4 - t3)  # a replay's digest update counts as writing
    parts[2] += t3 - t2
    return len(k)


def _apply_direct(
    pieces: I64,
    counts: U8,
    low: U8,
    diff: npt.NDArray[np.int8],
    exceptions: npt.NDArray[np.unsignedinteger],
    target: Target,
    undo: UndoLog,
    parts: list[float],
    t0: float,
    bits: int,
) -> int:
    """:func:`apply_chunk` where every piece lands whole in the engine
    (:attr:`Landing.direct`): each unit's engine index is its piece's origin plus its
    stream index. Decoded, written and digested natively in one pass over the
    changes, each unit's cache line read and written once
    (:func:`refitd.delta.native.place_write`; the general path, and ``place``,
    ``scatter`` and ``digest_update``, are its reference). Its seconds count as
    placing."""
    unit = exceptions.dtype.itemsize
    engine = target.engine
    digest = target.digest
    try:
        idx, old = native.place_write(
            counts, low, diff, exceptions, pieces, engine, unit, bits, digest.lanes,
            digest.block,
        )  # fmt: skip
    except ValueError as err:
        raise ConflictError(f"delta of v{target.base_version}+1 refused: {err}") from None
    undo.record(engine.view(unit_dtype(unit)), idx, old)
    parts[0] += time.perf_counter() - t0
    return len(idx)


def _overlapping(
    plan: Plan,
    pieces: I64,
    engine_id: int,
    scratch_id: int,
    limit: int,
    spans: Mapping[str, tuple[int, int]],
) -> bool:
    """Whether two destinations of the plan may write the same engine byte (then a
    unit landed twice keeps its last value)."""
    direct = (pieces[:, 0] == engine_id) | ((pieces[:, 0] == scratch_id) & (pieces[:, 1] < limit))
    lo = list(pieces[direct, 1].tolist())
    hi = list((pieces[direct, 1] + pieces[direct, 2]).tolist())
    for _at, dt, shape, strides, name, dst_byte in plan.scatter:
        start = spans[name][0] + dst_byte
        reach = sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        lo.append(start)
        hi.append(start + (reach + 1) * dt.itemsize)
    for _at, fr in plan.full_reads:
        for c in fr.copies:
            off, nbytes = spans[c.param_name]
            lo.append(off)
            hi.append(off + nbytes)
    order = np.argsort(np.array(lo, dtype=np.int64), kind="stable")
    a, b = np.array(lo, dtype=np.int64)[order], np.array(hi, dtype=np.int64)[order]
    return bool(len(a) > 1 and (a[1:] < np.maximum.accumulate(b)[:-1]).any())


def _replay(plan: Plan, dirty: list[int], target: Target, undo: UndoLog) -> None:
    """Replay the full reads ``dirty`` (patched in scratch) into the parameters
    (:attr:`Target.replay`), each destination parameter recorded whole first; the
    digest follows."""
    engine = target.engine
    names = sorted({c.param_name for i in dirty for c in plan.full_reads[i][1].copies})
    kept = []
    for name in names:
        lo, nbytes = target.spans[name]
        view = engine[lo : lo + nbytes]
        kept.append((lo, view, view.copy()))
        undo.keep(view)
    target.replay(dirty)
    for lo, view, before in kept:
        target.digest.rewrite(lo, before, view)
