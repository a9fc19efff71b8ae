"""Bench-only oracles that know the generator: sampled futures and hit density."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_experts_cache import replay_forgetting

from refitd.errors import ConfigError
from refitd.experts import ExpertCache, LruPolicy
from refitd.experts.bound import (
    RULES,
    ExactHitDensityPolicy,
    SampledFuturePolicy,
    SampledFutures,
    compare,
)
from refitd.experts.traces import ModelShape, TraceConfig, preset_config, routing_model

SMALL = ModelShape("small", 3, 6, 2)


def _small(seed: int, **kw: float) -> TraceConfig:
    cfg = TraceConfig(SMALL, requests=2, prefill_tokens=2, decode_tokens=12, seed=seed)
    return replace(cfg, **kw)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    size=st.integers(6, 14),
    forget_every=st.integers(2, 9),
    which=st.integers(0, len(RULES) + 1),
    prefetch_every=st.integers(0, 3),
)
def test_the_bound_oracles_keep_every_cache_invariant(
    seed: int, size: int, forget_every: int, which: int, prefetch_every: int
) -> None:
    model = routing_model(_small(seed))
    futures = SampledFutures(model, samples=4, horizon_tokens=2, chunk=5)
    policy = (
        SampledFuturePolicy(futures, RULES[which])
        if which < len(RULES)
        else ExactHitDensityPolicy(model, visits=1 + which - len(RULES))
    )
    cache = ExpertCache(3, 6, size, policy=policy)
    replay_forgetting(cache, model.trace.steps(), forget_every, prefetch_every)


def test_futures_are_a_function_of_the_step_alone() -> None:
    # Drawn in chunks of 1 or of 7 steps, with other steps asked for in between: the
    # same futures, so nothing but (seed, step) feeds a step's random numbers.
    model = routing_model(_small(3))
    a = SampledFutures(model, samples=8, horizon_tokens=2, chunk=1)
    b = SampledFutures(model, samples=8, horizon_tokens=2, chunk=7)
    total = a.total_steps
    for step in [*range(1, total + 1), 5, 1]:
        assert np.array_equal(a.first_use(step), b.first_use(step))
    other = SampledFutures(routing_model(_small(4)), samples=8, horizon_tokens=2)
    assert not all(np.array_equal(a.first_use(s), other.first_use(s)) for s in range(1, total + 1))


def test_futures_follow_the_revealed_routes_through_coupling_and_stickiness() -> None:
    # p_layer = 1: a decode layer routes exactly the partners of the layer below.
    model = routing_model(_small(5, p_prev=0.0, p_layer=1.0))
    fut = SampledFutures(model, samples=6, horizon_tokens=1, chunk=4)
    L, E = 3, 6
    tokens = model.trace.tokens
    t, layer = 3, 0  # a decode token; its layer 1 is revealed by nothing but layer 0
    first = fut.first_use(t * L + layer + 1)
    want = sorted(model.partner[1][e] for e in tokens[t].layers[0])
    for sample in first:
        assert sorted(np.flatnonzero(sample[E : 2 * E] == 1)) == want
    # p_prev = 1: the next token's layer repeats the current one exactly.
    model = routing_model(_small(6, p_prev=1.0))
    fut = SampledFutures(model, samples=6, horizon_tokens=1)
    tokens = model.trace.tokens
    first = fut.first_use(t * L + 1 + 1)  # token t, layer 1 placed; next is layer 2
    for sample in first:
        assert sorted(np.flatnonzero(sample[E : 2 * E] == L)) == sorted(tokens[t].layers[1])
        assert sorted(np.flatnonzero(sample[2 * E :] == 1)) == sorted(tokens[t].layers[2])


def test_decisions_are_deterministic_and_beat_lru_on_a_preset_trace() -> None:
    model = routing_model(preset_config("mixtral-8x7b", requests=1, decode_tokens=48))
    sizes = [64, 128]

    def run() -> dict[int, dict[str, float]]:
        hits, _ = compare(
            model,
            sizes,
            samples=32,
            horizon_tokens=2,
            rules=[("vote", None), ("beyond", 0.5)],
            density_visits=(1,),
        )
        return hits

    first = run()
    assert first == run()
    for size in sizes:
        h = first[size]
        assert h["belady"] >= max(h.values()) - 1e-12
        for name in ("sampled-vote", "sampled-beyond@0.5", "hit-density-1"):
            assert h[name] > h["lru"], (size, name, h)


def test_refusals() -> None:
    model = routing_model(_small(1))
    fut = SampledFutures(model, samples=2, horizon_tokens=1)
    with pytest.raises(ValueError, match="rule"):
        SampledFuturePolicy(fut, "nearest")
    with pytest.raises(ValueError, match="within"):
        SampledFuturePolicy(fut, "beyond", within=2.0)
    with pytest.raises(ConfigError, match="p_recent"):
        SampledFutures(routing_model(_small(1, p_recent=0.1)))
    with pytest.raises(ValueError, match="visits"):
        ExactHitDensityPolicy(model, visits=0)
    # A replay that is not the trace's own is refused, not silently mis-ranked.
    cache = ExpertCache(3, 6, 6, policy=SampledFuturePolicy(fut, "mean"))
    cache.ensure(0, [0, 1])
    with pytest.raises(Exception, match="off its trace"):
        cache.ensure(2, [0, 1])
    assert LruPolicy().name == "lru"
