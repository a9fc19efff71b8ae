"""Eviction policies: Belady's optimum, our policy, and the invariants all share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.errors import PlanError
from refitd.experts import (
    BeladyPolicy,
    EvictionPolicy,
    ExpectedReusePolicy,
    ExpertCache,
    LruPolicy,
)
from refitd.experts.traces import generate_trace, preset_config

LAYERS, EXPERTS = 3, 6

traces = st.lists(
    st.tuples(
        st.integers(0, LAYERS - 1),
        st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=80,
)


def replay(steps: list[tuple[int, list[int]]], size: int, policy: EvictionPolicy) -> int:
    cache = ExpertCache(LAYERS, EXPERTS, size, policy=policy)
    for layer, routed in steps:
        cache.ensure(layer, routed)
    return cache.stats().hits


@settings(max_examples=120, deadline=None)
@given(steps=traces, size=st.integers(EXPERTS, 3 * EXPERTS))
def test_belady_never_hits_less_than_lru_or_ours(
    steps: list[tuple[int, list[int]]], size: int
) -> None:
    best = replay(steps, size, BeladyPolicy(steps, EXPERTS))
    assert best >= replay(steps, size, LruPolicy())
    assert best >= replay(steps, size, ExpectedReusePolicy())


@settings(max_examples=60, deadline=None)
@given(steps=traces, size=st.integers(EXPERTS, 2 * EXPERTS))
def test_our_policy_decides_identically_on_identical_input(
    steps: list[tuple[int, list[int]]], size: int
) -> None:
    def plans() -> list[tuple[int, ...]]:
        cache = ExpertCache(LAYERS, EXPERTS, size, policy=ExpectedReusePolicy())
        return [cache.ensure(layer, routed).copy.dst_slots for layer, routed in steps]

    assert plans() == plans()


def test_belady_evicts_the_expert_used_furthest_ahead() -> None:
    # Two layers of two experts in two slots: layer 1 needs a slot at step 3, and
    # layer 0's expert 0 returns at step 4 while expert 1 never does. LRU would evict
    # expert 0 (older); Belady keeps it.
    steps = [(0, [0]), (0, [1]), (1, [0]), (0, [0])]
    belady = ExpertCache(2, 2, 2, policy=BeladyPolicy(steps, 2))
    lru = ExpertCache(2, 2, 2)
    for layer, routed in steps:
        belady.ensure(layer, routed)
        lru.ensure(layer, routed)
    assert belady.stats().hits == 1
    assert lru.stats().hits == 0


def test_belady_refuses_a_replay_that_leaves_its_trace() -> None:
    steps = [(0, [0]), (0, [1])]
    cache = ExpertCache(1, 2, 2, policy=BeladyPolicy(steps, 2))
    cache.ensure(0, [0])
    with pytest.raises(PlanError, match="replayed off its trace"):
        cache.ensure(0, [0])


def test_our_policy_rejects_an_averaging_weight_outside_zero_and_one() -> None:
    with pytest.raises(ValueError, match="alpha"):
        ExpectedReusePolicy(alpha=1.0)


def test_our_policy_keeps_a_popular_expert_that_lru_would_evict() -> None:
    # Layer 0 routes expert 0 at every visit; between visits, layer 1 cycles through
    # its three experts. Four experts share three slots, so LRU always evicts the
    # one needed next and never hits; ours learns that expert 0 always returns.
    steps = []
    for i in range(60):
        steps.append((0, [0]))
        steps += [(1, [(3 * i + j) % 3]) for j in range(3)]
    lru = ExpertCache(2, 3, 3, policy=LruPolicy())
    ours = ExpertCache(2, 3, 3, policy=ExpectedReusePolicy())
    for layer, routed in steps:
        lru.ensure(layer, routed)
        ours.ensure(layer, routed)
    assert lru.stats().hits == 0
    assert ours.layer_stats(0).hits >= 55


def test_our_policy_estimates_a_routing_frequency_between_zero_and_one() -> None:
    policy = ExpectedReusePolicy(alpha=0.5)
    cache = ExpertCache(1, 4, 4, policy=policy)
    for _ in range(20):
        cache.ensure(0, [1])
    assert policy.q(0, 1) == pytest.approx(1.0, abs=1e-5)
    assert policy.q(0, 2) == 0.0
    for _ in range(3):
        cache.ensure(0, [2])
    assert 0.0 < policy.q(0, 1) < 0.2


def test_our_policy_beats_lru_on_a_generated_trace_with_room_for_two_tokens() -> None:
    trace = generate_trace(
        preset_config("mixtral-8x7b", requests=1, decode_tokens=96, prefill_tokens=16)
    )
    shape = trace.shape
    size = 2 * shape.active
    hits = {}
    for policy in (LruPolicy(), ExpectedReusePolicy()):
        cache = ExpertCache(shape.num_layers, shape.num_experts, size, policy=policy)
        for layer, routed in trace.steps():
            cache.ensure(layer, routed)
        hits[policy.name] = cache.stats().hit_rate
    assert hits["expected-reuse"] > hits["lru"]
