"""ExpertCache: placement, eviction order, recovery, whole-layer loads, hybrid mode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.errors import ConfigError, PlanError
from refitd.experts import (
    CopyPlan,
    EvictionPolicy,
    ExpectedReusePolicy,
    ExpertCache,
    ExpertId,
    HitDensityPolicy,
    LruPolicy,
)


def test_a_pool_smaller_than_one_layer_is_refused() -> None:
    with pytest.raises(ConfigError, match="smaller than one layer"):
        ExpertCache(2, 8, 7)


def test_misses_fill_free_slots_in_ascending_expert_order() -> None:
    cache = ExpertCache(2, 8, 8)
    plan = cache.ensure(0, [5, 2, 7])
    assert plan.copy == CopyPlan((0, 1, 2), (2, 5, 7))
    assert plan.slots == (1, 0, 2)
    assert (plan.active, plan.missing, plan.fetched) == (3, 3, 3)


def test_duplicate_routes_are_served_once_and_reported_in_caller_order() -> None:
    cache = ExpertCache(1, 8, 8)
    plan = cache.ensure(0, [3, 1, 3, 1])
    assert plan.copy.src_rows == (1, 3)
    assert plan.slots == (1, 0, 1, 0)
    assert plan.active == 2


def test_the_default_policy_is_ours_and_lru_is_one_argument_away() -> None:
    assert type(ExpertCache(1, 2, 2).policy) is HitDensityPolicy
    assert isinstance(ExpertCache(1, 2, 2, policy=LruPolicy()).policy, LruPolicy)


def test_the_least_recently_used_slot_is_evicted_first() -> None:
    cache = ExpertCache(2, 2, 2, policy=LruPolicy())
    cache.ensure(0, [0])  # slot 0
    cache.ensure(0, [1])  # slot 1
    cache.ensure(0, [0])  # refresh slot 0, so slot 1 is now oldest
    plan = cache.ensure(1, [0])
    assert plan.copy == CopyPlan((1,), (0,))
    assert cache.slot_of(0, 1) is None
    assert cache.slot_of(0, 0) == 0


def test_slots_last_used_in_the_same_step_are_evicted_lowest_slot_first() -> None:
    cache = ExpertCache(3, 2, 4, policy=LruPolicy())
    cache.ensure(0, [1, 0])  # slots 0, 1 in one step
    cache.ensure(1, [1, 0])  # slots 2, 3 in the next
    plan = cache.ensure(2, [0])
    assert plan.copy.dst_slots == (0,)
    plan = cache.ensure(2, [1])
    assert plan.copy.dst_slots == (1,)


@pytest.mark.parametrize("make_policy", [LruPolicy, ExpectedReusePolicy, HitDensityPolicy])
def test_a_step_never_evicts_a_slot_it_uses_itself(make_policy: type[EvictionPolicy]) -> None:
    cache = ExpertCache(2, 4, 4, policy=make_policy())
    cache.ensure(0, [0, 1, 2, 3])
    cache.ensure(1, [0, 1])  # evicts two of layer 0's experts
    hits = {s for e in range(4) if (s := cache.slot_of(0, e)) is not None}
    assert len(hits) == 2
    plan = cache.ensure(0, [2, 3, 0, 1])  # the two left hit; two misses need victims
    assert not hits & set(plan.copy.dst_slots)
    assert all(s is not None for s in plan.slots)
    assert len(set(plan.slots)) == 4


def test_a_forgotten_slot_is_the_next_victim_even_if_recently_used() -> None:
    cache = ExpertCache(2, 4, 4)
    cache.ensure(0, [0, 1, 2, 3])
    assert cache.forget_slot(3) == ExpertId(0, 3)
    assert cache.forget_slot(3) is None
    assert cache.resident_in(3) is None
    plan = cache.ensure(1, [2])
    assert plan.copy.dst_slots == (3,)


def test_forgotten_slots_are_reused_lowest_first() -> None:
    cache = ExpertCache(1, 4, 4)
    cache.ensure(0, [0, 1, 2, 3])
    cache.forget_slot(2)
    cache.forget_slot(1)
    assert cache.ensure(0, [0, 1, 2]).copy.dst_slots == (1, 2)


def test_resident_in_and_slot_of_answer_none_outside_the_pool() -> None:
    cache = ExpertCache(1, 4, 4)
    cache.ensure(0, [2])
    assert cache.resident_in(0) == ExpertId(0, 2)
    assert cache.resident_in(1) is None
    assert cache.resident_in(99) is None
    assert cache.slot_of(0, 2) == 0
    assert cache.slot_of(5, 0) is None
    assert cache.slot_of(0, 9) is None


def test_an_expert_outside_the_layer_or_a_layer_outside_the_model_is_refused() -> None:
    cache = ExpertCache(2, 4, 4)
    with pytest.raises(PlanError, match="routed expert 4"):
        cache.ensure(0, [1, 4])
    with pytest.raises(PlanError, match="routed expert -1"):
        cache.ensure(0, [-1])
    with pytest.raises(PlanError, match="layer 2"):
        cache.ensure(2, [0])
    assert cache.stats().routes == 0


def test_materialize_places_expert_e_in_slot_e_and_displaces_the_occupants() -> None:
    cache = ExpertCache(2, 4, 6)
    cache.ensure(1, [0, 1])  # slots 0, 1 hold layer 1
    cache.ensure(0, [3])  # slot 2 holds layer 0 expert 3
    plan = cache.materialize_layer(0)
    assert plan == CopyPlan((0, 1, 2, 3), (0, 1, 2, 3))
    for e in range(4):
        assert cache.resident_in(e) == ExpertId(0, e)
        assert cache.slot_of(0, e) == e
    assert cache.slot_of(1, 0) is None and cache.slot_of(1, 1) is None
    assert cache.occupied() == 4
    assert cache.ensure(0, [0, 1, 2, 3]).copy.is_empty()
    assert cache.ensure(1, [0]).copy.dst_slots == (4,)


def test_rebuild_drops_residency_and_keeps_counters() -> None:
    cache = ExpertCache(1, 4, 4)
    cache.ensure(0, [0, 1])
    before = cache.stats()
    cache.rebuild(8)
    assert cache.cache_size == 8
    assert cache.occupied() == 0
    assert cache.stats() == before
    assert cache.ensure(0, [0]).missing == 1
    with pytest.raises(ConfigError):
        cache.rebuild(3)


def test_statistics_are_kept_per_layer_and_summed_globally() -> None:
    cache = ExpertCache(2, 4, 8)
    cache.ensure(0, [0, 1])
    cache.ensure(0, [1, 2])
    cache.ensure(1, [3])
    l0, l1, total = cache.layer_stats(0), cache.layer_stats(1), cache.stats()
    assert (l0.steps, l0.routes, l0.hits, l0.misses, l0.fetched) == (2, 4, 1, 3, 3)
    assert (l1.steps, l1.routes, l1.hits) == (1, 1, 0)
    assert (total.steps, total.routes, total.hits, total.misses) == (3, 5, 1, 4)
    assert total.hit_rate == pytest.approx(0.2)
    cache.reset_stats()
    assert cache.stats().routes == 0


def test_hybrid_mode_fetches_up_to_the_cap_and_leaves_the_rest_to_the_cpu() -> None:
    cache = ExpertCache(1, 8, 8, max_fetch=2)
    plan = cache.ensure(0, [6, 1, 4, 3])
    assert plan.fetched == 2 and plan.missing == 4
    assert plan.copy.src_rows == (1, 3)  # no history yet: ties to the lower ids
    assert plan.slots.count(None) == 2
    assert plan.slots[0] is None and plan.slots[2] is None
    assert cache.stats().cpu == 2


def test_hybrid_mode_fetches_the_most_recently_routed_misses_first() -> None:
    cache = ExpertCache(1, 8, 8, max_fetch=1)
    cache.ensure(0, [5, 6])  # fetches 5; 6 is routed but left to the CPU
    cache.ensure(0, [7, 5])  # hit 5, fetch 7
    plan = cache.ensure(0, [2, 6])  # 6 was routed more recently than 2
    assert plan.copy.src_rows == (6,)
    assert plan.slots == (None, cache.slot_of(0, 6))


def test_a_policy_that_offers_a_slot_the_step_uses_is_refused() -> None:
    class Reckless(EvictionPolicy):
        name = "reckless"

        def reset(self, pool: object, slots: int) -> None:  # type: ignore[override]
            self.last: list[int] = []

        def on_step(self, step: int, slots: object) -> None:  # type: ignore[override]
            self.last = list(slots)  # type: ignore[call-overload]

        def choose_victim(self, step: int) -> int:
            return self.last[0]

        def on_remove(self, slot: int) -> None:
            pass

    cache = ExpertCache(2, 2, 2, policy=Reckless())
    cache.ensure(0, [0, 1])
    # The policy offers slot 0, which layer 1 is about to fill in this very step.
    cache.ensure(1, [0])
    with pytest.raises(PlanError, match="already uses"):
        cache.ensure(1, [0, 1])


# -- properties ----------------------------------------------------------------------

LAYERS, EXPERTS = 3, 5

# One drawn operation: (kind, layer or slot, experts, prefetch budget or None).
Op = tuple[str, int, list[int], int | None]


def op_lists(*, prefetch: bool = False, materialize: bool = True) -> st.SearchStrategy[list[Op]]:
    """Up to 60 operations on a ``LAYERS`` × ``EXPERTS`` cache: steps (repeated experts
    allowed), forgotten slots (some out of range) and, as asked, prefetches (with or
    without a budget) and whole-layer loads."""
    kinds = [
        st.tuples(
            st.just("ensure"),
            st.integers(0, LAYERS - 1),
            st.lists(st.integers(0, EXPERTS - 1), max_size=EXPERTS + 2),
            st.none(),
        )
    ]
    if prefetch:
        kinds.append(
            st.tuples(
                st.just("prefetch"),
                st.integers(0, LAYERS - 1),
                st.lists(st.integers(0, EXPERTS - 1), max_size=EXPERTS),
                st.none() | st.integers(0, 4),
            )
        )
    kinds.append(st.tuples(st.just("forget"), st.integers(-1, 12), st.just([]), st.none()))
    if materialize:
        kinds.append(
            st.tuples(st.just("materialize"), st.integers(0, LAYERS - 1), st.just([]), st.none())
        )
    return st.lists(st.one_of(*kinds), max_size=60)


ops = op_lists()


class ReferenceLru:
    """The slow, obvious model: victims by minimum ``(last step, slot)``, free first."""

    def __init__(self, size: int) -> None:
        self.slot_key: list[int | None] = [None] * size
        self.stamp = [0] * size
        self.step = 0

    def ensure(self, layer: int, routed: list[int]) -> list[int]:
        self.step += 1
        keys = {layer * EXPERTS + e for e in routed}
        where = {k: s for s, k in enumerate(self.slot_key) if k is not None}
        for k in keys & where.keys():
            self.stamp[where[k]] = self.step
        dst = []
        for k in sorted(keys - where.keys()):
            free = [s for s, k2 in enumerate(self.slot_key) if k2 is None]
            if free:
                s = free[0]
            else:
                s = min(
                    (s for s in range(len(self.slot_key)) if self.stamp[s] != self.step),
                    key=lambda s: (self.stamp[s], s),
                )
            self.slot_key[s] = k
            self.stamp[s] = self.step
            dst.append(s)
        return dst

    def forget(self, slot: int) -> None:
        if 0 <= slot < len(self.slot_key):
            self.slot_key[slot] = None

    def materialize(self, layer: int) -> None:
        self.step += 1
        base = layer * EXPERTS
        for s, k in enumerate(self.slot_key):
            if k is not None and base <= k < base + EXPERTS and s != k - base:
                self.slot_key[s] = None
        for e in range(EXPERTS):
            self.slot_key[e] = base + e
            self.stamp[e] = self.step


def check_invariants(cache: ExpertCache) -> None:
    """The whole pool, scanned: the map is consistent, no expert is resident twice,
    owned slots hold experts, predictions name slots that hold their layer."""
    seen: dict[ExpertId, int] = {}
    for slot in range(cache.cache_size):
        who = cache.resident_in(slot)
        if who is not None:
            assert who not in seen, f"{who} resident twice"
            seen[who] = slot
            assert cache.slot_of(who.layer, who.expert) == slot
        else:
            assert not cache.owned[slot]
    assert cache.occupied() == len(seen)
    for layer in range(cache.num_layers):
        for slot in cache.predicted(layer):
            who = cache.resident_in(slot)
            assert who is not None and who.layer == layer
    for slot in cache.unused():
        assert cache.owned[slot]


def replay_forgetting(
    cache: ExpertCache,
    steps: list[tuple[int, tuple[int, ...]]],
    forget_every: int,
    prefetch_every: int = 0,
) -> None:
    """Replay ``steps``, forgetting a slot every ``forget_every`` steps, and check the
    ferrox invariants after each: a slot the step hits is never overwritten, every
    route is placed, a forgotten slot is taken before any victim, the map stays
    consistent. Every ``prefetch_every`` steps (0: never) the next step's routes are
    prefetched after the step, a perfect prediction: it must take no slot the step
    used, and the predicted experts it placed must be hits when that step runs."""
    size = cache.cache_size
    predicted: set[int] = set()
    for i, (layer, routed) in enumerate(steps, start=1):
        before = {e: cache.slot_of(layer, e) for e in routed}
        forgotten = None
        if i % forget_every == 0:
            forgotten = i % size if cache.resident_in(i % size) is not None else None
            cache.forget_slot(i % size)
        evictions = cache.stats().evictions
        plan = cache.ensure(layer, routed)
        hits = {s for s in before.values() if s is not None} - {forgotten}
        assert not hits & set(plan.copy.dst_slots)
        assert all(s is not None for s in plan.slots)
        if forgotten is not None and cache.stats().evictions > evictions:
            assert forgotten in plan.copy.dst_slots, "a victim was taken before a forgotten slot"
        assert not (predicted - {forgotten}) & set(plan.copy.dst_slots), (
            "a prefetched expert was fetched again by its own step"
        )
        predicted = set()
        check_invariants(cache)
        if prefetch_every and i % prefetch_every == 0 and i < len(steps):
            used = {s for s in plan.slots if s is not None}
            nxt_layer, nxt = steps[i]
            pre = cache.prefetch(nxt_layer, nxt)
            assert not used & set(pre.copy.dst_slots), "a prefetch evicted the step's own slot"
            predicted = {s for e in nxt if (s := cache.slot_of(nxt_layer, e)) is not None}
            check_invariants(cache)


@settings(max_examples=150, deadline=None)
@given(ops=ops, size=st.integers(EXPERTS, 3 * EXPERTS))
def test_lru_matches_the_reference_model_on_any_sequence(ops: list[Op], size: int) -> None:
    cache = ExpertCache(LAYERS, EXPERTS, size, policy=LruPolicy())
    model = ReferenceLru(size)
    for op, arg, routed, _ in ops:
        if op == "ensure":
            plan = cache.ensure(arg, routed)
            assert list(plan.copy.dst_slots) == model.ensure(arg, routed)
        elif op == "forget":
            cache.forget_slot(arg)
            model.forget(arg)
        else:
            cache.materialize_layer(arg)
            model.materialize(arg)
        check_invariants(cache)


@pytest.mark.parametrize("make_policy", [LruPolicy, ExpectedReusePolicy, HitDensityPolicy])
@settings(max_examples=60, deadline=None)
@given(ops=ops, size=st.integers(EXPERTS, 3 * EXPERTS), cap=st.none() | st.integers(0, 3))
def test_every_policy_places_every_route_and_keeps_the_map_consistent(
    make_policy: type[EvictionPolicy], ops: list[Op], size: int, cap: int | None
) -> None:
    cache = ExpertCache(LAYERS, EXPERTS, size, policy=make_policy(), max_fetch=cap)
    for op, arg, routed, _ in ops:
        if op == "ensure":
            before = {e: cache.slot_of(arg, e) for e in routed}
            plan = cache.ensure(arg, routed)
            hits = {s for s in before.values() if s is not None}
            assert not hits & set(plan.copy.dst_slots), "a hit's slot was overwritten"
            assert len(set(plan.copy.dst_slots)) == len(plan.copy.dst_slots)
            for e, slot in zip(routed, plan.slots):
                assert slot == cache.slot_of(arg, e)
                if cap is None:
                    assert slot is not None
            assert plan.fetched <= plan.missing <= plan.active
            if cap is not None:
                assert plan.fetched <= cap
        elif op == "forget":
            cache.forget_slot(arg)
        else:
            cache.materialize_layer(arg)
        check_invariants(cache)
