"""The native delta stages (:mod:`refitd.delta.native`) against the pure-numpy
reference, on random change patterns: the source's comparison and staging, the
engine's placing, writing and digest update. Every unit the planner's dtypes make
(the gcd of their item sizes), reads and memories of lengths that are not whole
words or whole pages (unaligned tails), differences near and far (escaped)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.delta import native
from refitd.delta.diff import LANES, compare_chunk, lanes_of, unit_dtype, unit_of
from refitd.delta.digest import EngineDigest
from refitd.delta.stream import (
    ChangeIndex,
    compose,
    decode,
    decode_values,
    landing,
    layout,
    staged_reference,
    unpack_nibbles,
)

#: every dtype a plan may carry; the delta's unit is the gcd of a model's item sizes
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.int16,
    torch.float32,
    torch.int32,
    torch.float64,
    torch.int64,
]

dtypes = st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3)


def _unit(ds: list[torch.dtype]) -> int:
    return unit_of(d.itemsize for d in ds)


def _changed(rng: np.random.Generator, base: np.ndarray, unit: int, frac: float) -> np.ndarray:
    """``base`` with a fraction of its units changed: most by a few steps, some far."""
    new = base.copy()
    u = new.view(unit_dtype(unit))
    mask = rng.random(len(u)) < frac
    near = rng.integers(1, 4, int(mask.sum())) * rng.choice([-1, 1], int(mask.sum()))
    step = np.where(
        rng.random(int(mask.sum())) < 0.8, near, rng.integers(128, 2**7 * 3, int(mask.sum()))
    )
    u[mask] = u[mask] + step.astype(np.int64).astype(u.dtype)
    return new


@given(
    ds=dtypes,
    units=st.integers(0, 1500),
    frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=80, deadline=None)
def test_the_native_comparison_finds_the_changes_and_lanes_the_reference_finds(
    ds: list[torch.dtype], units: int, frac: float, seed: int
) -> None:
    unit = _unit(ds)
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, units * unit, dtype=np.uint8)  # any length: unaligned tails
    new = _changed(rng, old, unit, frac)
    at = np.empty(units, np.int64)
    vals = np.empty(2 * len(new), np.uint8)
    lo, ln = np.zeros(LANES, np.uint64), np.zeros(LANES, np.uint64)
    c = native.compare(old, new, unit, lo, ln, at, vals)
    want_at, want_old, want_new = compare_chunk(old, new, unit)
    assert at[:c].tolist() == want_at.tolist()
    pairs = vals[: 2 * unit * c].reshape(-1, 2, unit)
    assert pairs[:, 0].tobytes() == want_old.tobytes()
    assert pairs[:, 1].tobytes() == want_new.tobytes()
    assert lo.tolist() == lanes_of(old).tolist() and ln.tolist() == lanes_of(new).tolist()


def _stream(rng: np.random.Generator, unit: int, regions: int, size: int, reads: int) -> np.ndarray:
    rows = []
    for _ in range(reads):
        lo = int(rng.integers(0, size))
        n = int(rng.integers(0, size - lo + 1))
        rows.append((int(rng.integers(0, regions + 1)), lo * unit, n * unit))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


@given(
    ds=dtypes,
    regions=st.integers(1, 3),
    size=st.integers(1, 1200),
    reads=st.integers(0, 10),
    frac=st.sampled_from([0.0, 0.02, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
    nibbles=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_the_native_staging_stages_the_bytes_the_reference_stages(
    ds: list[torch.dtype],
    regions: int,
    size: int,
    reads: int,
    frac: float,
    seed: int,
    nibbles: bool,
) -> None:
    unit = _unit(ds)
    rng = np.random.default_rng(seed)
    per, vals = {}, []
    for r in range(regions):
        old = rng.integers(0, 256, size * unit, dtype=np.uint8)
        new = _changed(rng, old, unit, frac)
        at, o, n = compare_chunk(old, new, unit)
        per[r] = at
        vals.append(np.stack([o.reshape(-1, unit), n.reshape(-1, unit)], axis=1).reshape(-1))
    index = ChangeIndex.of(per)
    values = np.concatenate(vals)
    table = _stream(rng, unit, regions, size, reads)
    got, (*got_counts, bits) = native.stage(index, values, table, unit, nibbles)
    want, want_counts = staged_reference(unit, index, values, table, bits)
    assert tuple(got_counts) == want_counts
    assert got.tobytes() == want.tobytes()
    assert bits == 8 or nibbles
    if nibbles:  # 4-bit differences are chosen only where they stage fewer bytes
        eight, _ = staged_reference(unit, index, values, table, 8)
        four, _ = staged_reference(unit, index, values, table, 4)
        assert len(got) == min(len(eight), len(four)) or bits == 8


def _plan(rng: np.random.Generator, unit: int, engine_units: int, reads: int) -> np.ndarray:
    """Disjoint destinations in the engine, in a random stream order: (region, offset,
    bytes) per read, as the receiver's plan gives them."""
    cuts = np.sort(rng.choice(engine_units + 1, min(2 * reads, engine_units + 1), replace=False))
    spans = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
    rng.shuffle(spans)
    return np.array([(7, a * unit, (b - a) * unit) for a, b in spans], dtype=np.int64).reshape(
        -1, 3
    )


@given(
    ds=dtypes,
    engine_units=st.integers(1, 3000),
    reads=st.integers(1, 8),
    frac=st.sampled_from([0.0, 0.02, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
    bits=st.sampled_from([8, 4]),
)
@settings(max_examples=100, deadline=None)
def test_native_placing_writing_and_digest_leave_what_the_reference_leaves(
    ds: list[torch.dtype], engine_units: int, reads: int, frac: float, seed: int, bits: int
) -> None:
    unit = _unit(ds)
    rng = np.random.default_rng(seed)
    # An engine with an unaligned tail: the digest's last word is a partial one.
    tail = int(rng.integers(0, unit))
    engine = rng.integers(0, 256, engine_units * unit + tail, dtype=np.uint8)
    pieces = _plan(rng, unit, engine_units, reads)
    # The source's side: the stream as the old and new bytes the pieces read.
    old_stream = np.concatenate(
        [engine[o : o + n] for _, o, n in pieces] or [np.zeros(0, np.uint8)]
    )
    new_stream = _changed(rng, old_stream, unit, frac)
    at, o, n = compare_chunk(old_stream, new_stream, unit)
    values = np.stack([o.reshape(-1, unit), n.reshape(-1, unit)], axis=1).reshape(-1)
    reads_ = np.array([[0, 0, len(old_stream)]], dtype=np.int64)
    payload, (pages, changed, exc, _units) = staged_reference(
        unit, ChangeIndex.of({0: at}), values, reads_, bits
    )
    lay = layout(pages, changed, exc, unit, bits)
    udt = unit_dtype(unit)
    counts = payload[:pages]
    low = payload[lay.low : lay.low + changed]
    packed = payload[lay.diff : lay.exceptions]
    diff = packed[:changed].view(np.int8) if bits == 8 else unpack_nibbles(packed, changed)
    excs = payload[lay.exceptions : lay.exceptions + unit * exc].view(udt)

    ref_engine = engine.copy()
    ref_digest = EngineDigest.of(engine)
    k = decode(counts, low)
    _piece, _region, off = landing(pieces, k, unit)
    ref_u = ref_engine[: engine_units * unit].view(udt)
    ref_old = ref_u[off // unit]
    ref_new = decode_values(ref_old.copy(), diff, excs)
    ref_u[off // unit] = ref_new
    ref_digest.update(off, ref_old, ref_new)

    # Placed, written and digested in one pass: the same bytes, lanes and undo record.
    fused, fused_digest = engine.copy(), EngineDigest.of(engine)
    d8 = packed.view(np.int8) if bits == 4 else diff
    f_idx, f_old = native.place_write(
        counts, low, d8, excs, pieces, fused, unit, bits, fused_digest.lanes, fused_digest.block
    )
    assert f_idx.tolist() == (off // unit).tolist() and f_old.tolist() == ref_old.tolist()
    assert fused.tobytes() == ref_engine.tobytes()
    assert np.array_equal(fused_digest.lanes, ref_digest.lanes)

    digest = EngineDigest.of(engine)
    idx, old, new = native.place(
        counts, low, packed.view(np.int8) if bits == 4 else diff, excs, pieces, engine, unit, bits
    )
    assert idx.tolist() == (off // unit).tolist()
    assert old.tolist() == ref_old.tolist() and new.tolist() == ref_new.tolist()
    native.scatter(engine, idx, new)
    digest.update_units(idx, old, new)
    assert engine.tobytes() == ref_engine.tobytes()
    assert np.array_equal(digest.lanes, ref_digest.lanes)
    assert np.array_equal(digest.lanes, EngineDigest.of(engine).lanes)


def _payload_of(
    unit: int, stream: np.ndarray, new: np.ndarray
) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    at, o, n = compare_chunk(stream, new, unit)
    values = np.stack([o.reshape(-1, unit), n.reshape(-1, unit)], axis=1).reshape(-1)
    reads = np.array([[0, 0, len(stream)]], dtype=np.int64)
    return staged_reference(unit, ChangeIndex.of({0: at}), values, reads)


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        ("count_more", "more positions"),
        ("count_fewer", "fewer positions"),
        ("descending", "not strictly ascending"),
        ("escape", "escaped differences"),
        ("short_plan", "past the end"),
    ],
)
def test_native_placing_refuses_a_payload_that_does_not_fit_its_plan_and_reads_only(
    spoil: str, why: str
) -> None:
    unit = 2
    rng = np.random.default_rng(5)
    engine = rng.integers(0, 256, 4096 * unit, dtype=np.uint8)
    new = _changed(rng, engine, unit, 0.05)
    payload, (pages, changed, exc, _) = _payload_of(unit, engine, new)
    lay = layout(pages, changed, exc, unit)
    counts = payload[:pages].copy()
    low = payload[lay.low : lay.low + changed].copy()
    diff = payload[lay.diff : lay.diff + changed].view(np.int8).copy()
    excs = payload[lay.exceptions : lay.exceptions + unit * exc].view(np.uint16).copy()
    pieces = np.array([[7, 0, len(engine)]], dtype=np.int64)
    if spoil == "count_more":
        counts[np.flatnonzero(counts)[-1]] += 1
    elif spoil == "count_fewer":
        counts[np.flatnonzero(counts)[-1]] -= 1
    elif spoil == "descending":
        low[[0, 1]] = low[[1, 0]]
    elif spoil == "escape":
        excs = excs[:-1] if len(excs) else np.zeros(1, np.uint16)
    else:
        pieces = np.array([[7, 0, len(engine) // 2]], dtype=np.int64)
    before = engine.copy()
    with pytest.raises(ValueError, match=why):
        native.place(counts, low, diff, excs, pieces, engine, unit)
    # The one-pass placing finds the fault after writing units before it: every one
    # of them, and every lane, is put back.
    digest = EngineDigest.of(engine)
    lanes = digest.lanes.copy()
    with pytest.raises(ValueError, match=why):
        native.place_write(
            counts, low, diff, excs, pieces, engine, unit, 8, digest.lanes, digest.block
        )
    assert np.array_equal(digest.lanes, lanes)
    assert engine.tobytes() == before.tobytes()


@given(
    ds=dtypes,
    units=st.integers(0, 600),
    steps=st.integers(1, 4),
    frac=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_composed_deltas_over_skipped_versions_equal_the_direct_comparison(
    ds: list[torch.dtype], units: int, steps: int, frac: float, seed: int
) -> None:
    """v -> v+k as the composition of k deltas is the comparison of v with v+k: units
    changed and changed back are no change, the oldest old and newest new unit kept."""
    unit = _unit(ds)
    rng = np.random.default_rng(seed)
    versions = [rng.integers(0, 256, units * unit, dtype=np.uint8)]
    for _ in range(steps):
        nxt = _changed(rng, versions[-1], unit, frac)
        if len(nxt) and rng.random() < 0.5:  # some units back to an older version's
            back = rng.random(units) < 0.3
            nxt.view(unit_dtype(unit))[back] = versions[0].view(unit_dtype(unit))[back]
        versions.append(nxt)

    def delta(a: np.ndarray, b: np.ndarray) -> tuple[ChangeIndex, np.ndarray]:
        at, o, n = compare_chunk(a, b, unit)
        pairs = np.stack([o.reshape(-1, unit), n.reshape(-1, unit)], axis=1).reshape(-1)
        return ChangeIndex.of({5: at}), pairs

    chain = [delta(a, b) for a, b in itertools.pairwise(versions)]
    index, values = compose(chain, unit)
    want_index, want_values = delta(versions[0], versions[-1])
    assert index.offsets.tolist() == want_index.offsets.tolist()
    assert values.tobytes() == want_values.tobytes()
