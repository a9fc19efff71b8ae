"""Hypothesis over change patterns: the stream arithmetic against a byte-level model
of a full refit, and deltas through a real daemon against a full refit."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.daemons import served
from support.deltas import Change, ColumnSwap, ColumnTrainer, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.delta.diff import compare_chunk, lanes_of, unit_dtype, update_lanes
from refitd.delta.stream import (
    ChangeIndex,
    decode,
    decode_values,
    encode,
    encode_values,
    landing,
    reads_of,
    select,
)
from refitd.reshard.geometry import capture_geometry
from refitd.testing.engines import (
    EngineParallel,
    ToyEngine,
    default_weight_loader,
    dense_toy_config,
    moe_toy_config,
)
from refitd.testing.layouts import full_state, megatron_tp_ep
from refitd.wire import PackSpec

UNITS = st.sampled_from([1, 2, 4])


@st.composite
def pulls(draw: st.DrawFn) -> tuple[int, dict[int, np.ndarray], np.ndarray, list[PackSpec]]:
    """Two source regions, descriptor rows and pack specs reading them (in units)."""
    unit = draw(UNITS)
    sizes = {0: draw(st.integers(8, 96)) * unit, 1: draw(st.integers(8, 96)) * unit}
    old = {
        r: np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
        for r, n in sizes.items()
    }
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        r = draw(st.sampled_from([0, 1]))
        n = sizes[r] // unit
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a, n))
        rows.append((r, a * unit, 9, 0, (b - a) * unit))
    specs = []
    for _ in range(draw(st.integers(0, 3))):
        r = draw(st.sampled_from([0, 1]))
        cols = draw(st.integers(1, 4))
        nrows = draw(st.integers(1, 4))
        width = draw(st.integers(cols, 8))
        if nrows * width * unit > sizes[r]:
            continue
        transpose = draw(st.booleans())
        shape, strides = ((cols, nrows), (1, width)) if transpose else ((nrows, cols), (width, 1))
        specs.append(PackSpec(r, 0, shape, strides, unit, 9, 0))
    return unit, old, np.array(rows, dtype=np.int64).reshape(-1, 5), specs


def full_refit(mem: dict[int, np.ndarray], reads: np.ndarray) -> np.ndarray:
    """The stream's bytes, as a full refit would land them end to end."""
    parts = [mem[int(r)][o : o + n] for r, o, n in reads.tolist()]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


@given(pull=pulls(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_the_changed_units_of_a_stream_turn_the_old_pull_into_the_new_one(
    pull: tuple[int, dict[int, np.ndarray], np.ndarray, list[PackSpec]], data: st.DataObject
) -> None:
    unit, old, rows, specs = pull
    pattern = data.draw(st.sampled_from(["none", "all", "some"]))
    new = {}
    for r, buf in old.items():
        b = buf.copy().view(unit_dtype(unit))
        if pattern == "all":
            b += 1
        elif pattern == "some":
            mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(b), max_size=len(b))))
            b[mask] += 1
        new[r] = b.view(np.uint8)
    index, olds, values = {}, {}, {}
    for r in old:
        at, o, v = compare_chunk(old[r], new[r], unit)
        index[r], olds[r], values[r] = at, o.view(unit_dtype(unit)), v.view(unit_dtype(unit))
    reads = reads_of(rows, specs)
    flat = ChangeIndex.of(index)
    k, at = select(flat, reads, unit)
    region = np.repeat(np.array(list(index), dtype=np.int64), [len(i) for i in index.values()])[at]
    at = at - np.array([flat.spans[int(r)][0] for r in region], dtype=np.int64)
    assert np.all(np.diff(k) > 0)
    units = int(reads[:, 2].sum()) // unit if len(reads) else 0
    counts, low = encode(k, units)
    assert np.array_equal(decode(counts, low), k)
    # Apply the delta where a full refit to the old version landed: the new pull.
    landed = full_refit(old, reads).copy()
    pieces = np.array([[9, off, n] for off, n in _ends(reads)], dtype=np.int64).reshape(-1, 3)
    _, _, off = landing(pieces, k, unit)
    pick = zip(region.tolist(), at.tolist(), strict=True)
    pairs = [(olds[r][a], values[r][a]) for r, a in pick]
    udt = unit_dtype(unit)
    old_u = np.array([p[0] for p in pairs], dtype=udt)
    new_u = np.array([p[1] for p in pairs], dtype=udt)
    diff, exc = encode_values(old_u, new_u)
    # The receiver knows each old unit from where the full refit landed it.
    got = decode_values(landed.view(udt)[off // unit].copy(), diff, exc)
    assert np.array_equal(got, new_u)
    for o, v in zip(off.tolist(), got, strict=True):
        landed[o : o + unit] = np.array([v], dtype=udt).view(np.uint8)
    assert np.array_equal(landed, full_refit(new, reads))
    changed_units = np.count_nonzero(
        full_refit(old, reads).view(unit_dtype(unit))
        != full_refit(new, reads).view(unit_dtype(unit))
    )
    assert len(k) == changed_units


def _ends(reads: np.ndarray) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in reads[:, 2].tolist():
        out.append((at, n))
        at += n
    return out


CHANGES = st.one_of(
    st.just(Change("none")),
    st.just(Change("all")),
    st.builds(Change, st.just("some"), st.floats(0.0, 0.3), st.integers(0, 1000)),
    st.builds(Change, st.just("tensor"), st.just(0.0), st.integers(0, 100)),
)


KINDS = ["dense", "moe", "columns"]
"""``dense``: a Llama-shaped model, Megatron TP 2 into an engine rank of TP 4 (rows and
pack specs); ``moe``: a DeepSeek-shaped one, TP 2 x EP 2 into TP 4 x EP 2 (fused
experts, full reads replayed from scratch, destinations that overlap); ``columns``:
column blocks packed into strided destinations (scattered on arrival)."""


@given(changes=st.lists(CHANGES, min_size=1, max_size=4), kind=st.sampled_from(KINDS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(changes=[Change("some", 0.1, 1), Change("all")], kind="moe")
@example(changes=[Change("some", 0.3, 2), Change("none")], kind="columns")
def test_after_any_number_of_deltas_a_resharded_rank_equals_a_full_refit(
    changes: list[Change], kind: str
) -> None:
    asyncio.run(_deltas(changes, kind))


def _setup(kind: str, client: Any) -> tuple[Any, dict[str, torch.Tensor], Any, Any]:
    """(trainer, first state, receiver arguments, the check of an engine)."""
    if kind == "columns":
        state = {
            "w": torch.randn(16, 8, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        }

        def columns_ok(eng: Any, st_: dict[str, torch.Tensor]) -> bool:
            want = torch.zeros(16, 8, dtype=torch.bfloat16)
            want[:, 0:4] = st_["w"][:, 4:8]
            return torch.equal(eng.w.view(torch.int16), want.view(torch.int16))

        kw = dict(
            engine=ColumnSwap(),
            twin=ColumnSwap,
            capture=lambda twin, manifest: capture_geometry(twin, manifest, default_weight_loader),
            max_reads_per_copy=1,
            allow_unwritten=["w"],
        )
        return ColumnTrainer(client, "m"), state, kw, columns_ok
    cfg = (moe_toy_config if kind == "moe" else dense_toy_config)(torch.bfloat16)
    ep = 2 if kind == "moe" else 1
    par = EngineParallel(4, 1, ep)
    state = full_state(cfg, seed=7)
    trainer = DoubleBuffered(client, "m", lambda st_: megatron_tp_ep(cfg, 2, ep, st_))
    kw = dict(
        engine=zeroed_engine(cfg, par),
        twin=lambda: ToyEngine(cfg, par),
        capture=capture_for(megatron_tp_ep(cfg, 2, ep, state)),
        max_reads_per_copy=2,  # pack specs and full reads as well as rows
    )
    return trainer, state, kw, lambda eng, st_: mismatched(eng, cfg, par, st_) == []


async def _deltas(changes: list[Change], kind: str) -> None:
    async with served(deltas=True) as s:
        trainer, state, kw, exact = _setup(kind, s.client)
        await trainer.publish(1, state)
        r = DeltaReceiver(local=s.client, source=s.client, model="m", **kw)
        first = await r.refit(1)
        # Each kind takes the path it is here for.
        assert kind != "columns" or first.scattered >= 1
        assert kind != "moe" or first.full_reads >= 1
        for v, change in enumerate(changes, start=2):
            state = changed(state, change)
            await trainer.publish(v, state)
            await r.refit(v)
            assert r.last is not None and r.last.kind == "delta", r.last
            assert exact(kw["engine"], state)
            if change.kind == "none":
                assert r.last.changed == 0
        await r.close()


@given(
    unit=UNITS,
    words=st.integers(1, 3000),
    data=st.data(),
)
@settings(max_examples=100, deadline=None)
def test_the_lane_digest_kept_up_to_date_from_writes_equals_one_taken_afresh(
    unit: int, words: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    buf = rng.integers(0, 256, words * 8, dtype=np.uint8)
    lanes = lanes_of(buf)
    units = buf.view(unit_dtype(unit))
    n = data.draw(st.integers(0, len(units)))
    idx = rng.choice(len(units), size=n, replace=False).astype(np.int64)
    new = rng.integers(0, 2 ** (8 * unit), n, dtype=np.uint64).astype(unit_dtype(unit))
    old = units[idx].copy()
    units[idx] = new
    update_lanes(lanes, idx * unit, old, new)
    assert np.array_equal(lanes, lanes_of(buf))
