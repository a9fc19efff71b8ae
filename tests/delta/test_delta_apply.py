"""The engine's apply of a delta (:mod:`refitd.delta.apply`), pure, on plans built by
hand: whatever a unit's destination (the engine's memory, a block scattered by its
strides, a full read's staged tensor, two reads landing on one byte), applying the
delta to what a full refit to the old version left leaves what a full refit to the
new version leaves, the digest kept; and a rollback leaves the old one, bit for bit.

The source side is the daemon's own staging (:func:`refitd.delta.native.stage`) over
the plan's reads; the reference is a byte model of a full refit (rows landed in
order, then each packed block scattered, then each full read replayed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.delta import native
from refitd.delta.apply import Landing, Target, apply_chunk
from refitd.delta.diff import compare_chunk
from refitd.delta.digest import EngineDigest
from refitd.delta.stream import ChangeIndex, reads_of
from refitd.delta.undo import UndoLog
from refitd.errors import ConflictError
from refitd.reshard.transfer_plan import FullRead
from refitd.reshard.types import RecordedCopy
from refitd.wire import PackSpec

SRC, ENGINE, SCRATCH = 0, 5, 6
UNIT = 4  # float32 units throughout


@dataclass
class Plan:
    rows: np.ndarray
    packs: list[PackSpec] = field(default_factory=list)
    scatter: list[Any] = field(default_factory=list)
    full_reads: list[tuple[int, FullRead]] = field(default_factory=list)


@dataclass
class Engine:
    """The engine's memory as a full refit to a version leaves it."""

    engine: np.ndarray
    scratch: np.ndarray
    spans: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Chunk:
    index: int
    pages: int
    changed: int
    exceptions: int
    diff_bits: int
    unit: int
    base_version: int
    first: int
    units: int


def _replay(plan: Plan, mem: Engine, dirty: list[int]) -> None:
    """A full read replayed from scratch: its staged tensor copied whole (its one
    copy has an empty op chain) into the parameter's bytes."""
    for i in dirty:
        at, fr = plan.full_reads[i]
        (copy,) = fr.copies
        lo, n = mem.spans[copy.param_name]
        mem.engine[lo : lo + n] = mem.scratch[at : at + fr.staging_nbytes]


def full_refit(
    plan: Plan, src: np.ndarray, spans: dict[str, tuple[int, int]], limit: int = 0
) -> Engine:
    """The byte model of a full refit to ``src`` by ``plan`` (staging mode: scratch's
    first ``limit`` bytes are the engine's image, installed into it)."""
    mem = Engine(np.zeros(256, np.uint8), np.zeros(256, np.uint8), spans)
    regions = {ENGINE: mem.engine, SCRATCH: mem.scratch}
    for s_region, s_off, d_region, d_off, n in plan.rows.tolist():
        assert s_region == SRC
        regions[d_region][d_off : d_off + n] = src[s_off : s_off + n]
        if d_region == SCRATCH and d_off + n <= limit:
            mem.engine[d_off : d_off + n] = src[s_off : s_off + n]
    for p in plan.packs:
        elems = np.lib.stride_tricks.as_strided(
            src[p.src_offset :].view(np.float32),
            p.shape,
            tuple(s * UNIT for s in p.strides),
        )
        dst = regions[p.dst_region]
        dst[p.dst_offset : p.dst_offset + p.nbytes] = (
            np.ascontiguousarray(elems).view(np.uint8).reshape(-1)
        )
    for at, _dt, shape, strides, name, dst_byte in plan.scatter:
        lo, _n = spans[name]
        packed = mem.scratch[at : at + UNIT * int(np.prod(shape))].view(np.float32).reshape(shape)
        dst = np.lib.stride_tricks.as_strided(
            mem.engine[lo + dst_byte :].view(np.float32), shape, tuple(s * UNIT for s in strides)
        )
        dst[...] = packed
    _replay(plan, mem, list(range(len(plan.full_reads))))
    return mem


def delta(plan: Plan, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, Chunk]:
    """The source's staged delta of ``plan``'s stream from ``old`` to ``new``, as one
    chunk."""
    at, o, n = compare_chunk(old, new, UNIT)
    values = np.stack([o.reshape(-1, UNIT), n.reshape(-1, UNIT)], axis=1).reshape(-1)
    reads = reads_of(plan.rows, plan.packs)
    payload, (pages, changed, exc, units, bits) = native.stage(
        ChangeIndex.of({SRC: at}), values, reads, UNIT, nibbles=True
    )
    return payload, Chunk(0, pages, changed, exc, bits, UNIT, 1, 0, units)


def applied(
    plan: Plan,
    old: np.ndarray,
    new: np.ndarray,
    spans: dict[str, tuple[int, int]],
    limit: int = 0,
    direct: bool | None = None,
) -> tuple[Engine, UndoLog, EngineDigest, Landing]:
    """A full refit to ``old`` with the delta to ``new`` applied over it."""
    mem = full_refit(plan, old, spans, limit)
    landing = Landing.of(plan, ENGINE, SCRATCH, limit, spans)
    if direct is not None:
        landing = dataclasses.replace(landing, direct=direct)
    digest = EngineDigest.of(mem.engine)
    target = Target(
        mem.engine, mem.scratch, digest, spans, 1, lambda dirty: _replay(plan, mem, dirty)
    )
    payload, chunk = delta(plan, old, new)
    undo = UndoLog()
    apply_chunk(landing, plan, chunk, payload, target, undo, [0.0, 0.0, 0.0])
    return mem, undo, digest, landing


def _versions(seed: int, frac: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.standard_normal(64).astype(np.float32)
    new = old.copy()
    mask = rng.random(64) < frac
    new[mask] += rng.standard_normal(int(mask.sum())).astype(np.float32)
    return old.view(np.uint8), new.view(np.uint8)


def _rows(*rows: tuple[int, int, int, int]) -> np.ndarray:
    return np.array([(SRC, s, d_region, d, n) for s, d_region, d, n in rows], np.int64)


ROWS_INTO_THE_ENGINE = _rows((0, ENGINE, 64, 32), (128, ENGINE, 0, 64), (32, ENGINE, 96, 8))
NO_PARAMS: dict[str, tuple[int, int]] = {}


@given(seed=st.integers(0, 2**32 - 1), frac=st.sampled_from([0.0, 0.05, 0.5, 1.0]))
@settings(max_examples=40, deadline=None)
def test_reads_landing_whole_in_the_engine_apply_in_one_native_pass_exactly(
    seed: int, frac: float
) -> None:
    old, new = _versions(seed, frac)
    plan = Plan(ROWS_INTO_THE_ENGINE)
    mem, undo, digest, landing = applied(plan, old, new, NO_PARAMS)
    assert landing.direct
    assert mem.engine.tobytes() == full_refit(plan, new, NO_PARAMS).engine.tobytes()
    assert np.array_equal(digest.lanes, EngineDigest.of(mem.engine).lanes)
    undo.rollback()
    assert mem.engine.tobytes() == full_refit(plan, old, NO_PARAMS).engine.tobytes()


@given(seed=st.integers(0, 2**32 - 1), frac=st.sampled_from([0.05, 0.5, 1.0]))
@settings(max_examples=40, deadline=None)
def test_the_general_path_leaves_what_the_native_one_pass_leaves(seed: int, frac: float) -> None:
    old, new = _versions(seed, frac)
    plan = Plan(ROWS_INTO_THE_ENGINE)
    native_pass, *_ = applied(plan, old, new, NO_PARAMS, direct=True)
    general, _undo, digest, _ = applied(plan, old, new, NO_PARAMS, direct=False)
    assert general.engine.tobytes() == native_pass.engine.tobytes()
    assert np.array_equal(digest.lanes, EngineDigest.of(general.engine).lanes)


def test_reads_into_staging_scratchs_image_of_the_engine_land_in_the_engine() -> None:
    old, new = _versions(3, 0.5)
    # Staging mode: scratch's first 128 bytes are the engine's image.
    plan = Plan(_rows((0, SCRATCH, 0, 64), (64, ENGINE, 64, 64)))
    mem, _undo, _digest, landing = applied(plan, old, new, NO_PARAMS, limit=128)
    assert landing.direct
    assert mem.engine.tobytes() == full_refit(plan, new, NO_PARAMS, 128).engine.tobytes()


def test_two_reads_landing_on_one_byte_leave_the_later_reads_value() -> None:
    old, new = _versions(4, 1.0)
    plan = Plan(_rows((0, ENGINE, 0, 64), (64, ENGINE, 32, 64)))  # bytes 32..64 twice
    mem, undo, digest, landing = applied(plan, old, new, NO_PARAMS)
    assert landing.overlapping and not landing.direct
    assert mem.engine.tobytes() == full_refit(plan, new, NO_PARAMS).engine.tobytes()
    assert np.array_equal(digest.lanes, EngineDigest.of(mem.engine).lanes)
    undo.rollback()
    assert mem.engine.tobytes() == full_refit(plan, old, NO_PARAMS).engine.tobytes()


def test_a_unit_of_a_packed_block_lands_where_the_scatter_puts_it() -> None:
    old, new = _versions(5, 0.4)
    spans = {"a": (0, 64)}  # a (4, 4) float32 parameter at engine byte 0
    plan = Plan(
        _rows((128, ENGINE, 128, 32)),
        packs=[PackSpec(SRC, 0, (4, 4), (8, 1), UNIT, SCRATCH, 64)],  # every other row of 8
        scatter=[(64, torch.float32, (4, 4), (1, 4), "a", 0)],  # lands transposed
    )
    mem, undo, digest, landing = applied(plan, old, new, spans)
    assert not landing.direct and landing.scat_of.tolist() == [-1, 0]
    assert mem.engine.tobytes() == full_refit(plan, new, spans).engine.tobytes()
    assert np.array_equal(digest.lanes, EngineDigest.of(mem.engine).lanes)
    undo.rollback()
    assert mem.engine.tobytes() == full_refit(plan, old, spans).engine.tobytes()


def test_a_unit_of_a_full_reads_staged_tensor_is_patched_there_and_the_read_replayed() -> None:
    old, new = _versions(6, 0.3)
    spans = {"w": (64, 48)}  # a (12,) float32 parameter at engine byte 64
    copy = RecordedCopy("w", (), "w", 0, (12,), (1,), torch.float32)
    plan = Plan(
        _rows((0, ENGINE, 0, 64), (64, SCRATCH, 128, 48)),
        full_reads=[(128, FullRead("w", (12,), torch.float32, UNIT, [], [copy]))],
    )
    mem, undo, digest, landing = applied(plan, old, new, spans)
    assert landing.fr_of.tolist() == [-1, 0]
    want = full_refit(plan, new, spans)
    assert mem.engine.tobytes() == want.engine.tobytes()
    assert mem.scratch.tobytes() == want.scratch.tobytes()
    assert np.array_equal(digest.lanes, EngineDigest.of(mem.engine).lanes)
    undo.rollback()
    base = full_refit(plan, old, spans)
    assert mem.engine.tobytes() == base.engine.tobytes()
    assert mem.scratch.tobytes() == base.scratch.tobytes()


def test_a_chunk_whose_page_counts_do_not_sum_to_its_positions_is_refused_writing_nothing() -> None:
    old, new = _versions(7, 0.5)
    plan = Plan(ROWS_INTO_THE_ENGINE)
    mem = full_refit(plan, old, NO_PARAMS)
    before = mem.engine.tobytes()
    payload, chunk = delta(plan, old, new)
    lying = dataclasses.replace(chunk, changed=chunk.changed + 1)
    target = Target(mem.engine, mem.scratch, EngineDigest.of(mem.engine), NO_PARAMS, 1, print)
    landing = Landing.of(plan, ENGINE, SCRATCH, 0, NO_PARAMS)
    with pytest.raises(ConflictError, match="page counts sum to"):
        apply_chunk(landing, plan, lying, payload, target, UndoLog(), [0.0, 0.0, 0.0])
    assert mem.engine.tobytes() == before


def test_a_unit_landing_outside_the_engine_and_the_plans_scratch_areas_is_refused() -> None:
    old, new = _versions(8, 1.0)
    plan = Plan(_rows((0, 9, 0, 64)))  # a region that is neither
    mem = full_refit(Plan(_rows()), old, NO_PARAMS)
    payload, chunk = delta(plan, old, new)
    target = Target(mem.engine, mem.scratch, EngineDigest.of(mem.engine), NO_PARAMS, 1, print)
    landing = Landing.of(plan, ENGINE, SCRATCH, 0, NO_PARAMS)
    with pytest.raises(ConflictError, match="outside the engine"):
        apply_chunk(landing, plan, chunk, payload, target, UndoLog(), [0.0, 0.0, 0.0])
