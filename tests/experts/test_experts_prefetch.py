"""ExpertCache.prefetch: predictions of an upcoming layer's routing, and the rules that
keep every ferrox invariant true with prefetches mixed in."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_experts_cache import EXPERTS, LAYERS, Op, check_invariants, op_lists
from test_experts_policy import checked_density, checked_reuse

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


def test_a_prefetch_fills_free_slots_most_confident_first_and_the_step_then_hits() -> None:
    cache = ExpertCache(2, 8, 8)
    plan = cache.prefetch(1, [6, 2, 6])
    assert plan.copy == CopyPlan((0, 1), (6, 2))
    assert (plan.resident, plan.skipped) == (0, 0)
    assert cache.predicted(1) == (0, 1)
    step = cache.ensure(1, [2, 6])
    assert (step.missing, step.fetched) == (0, 0)
    assert step.copy.is_empty()
    assert cache.predicted(1) == ()
    assert cache.stats().prefetched == 2
    assert cache.stats().prefetch_used == 2


def test_a_prefetch_is_not_a_step() -> None:
    cache = ExpertCache(2, 4, 4)
    cache.ensure(0, [0])
    cache.prefetch(1, [1, 2])
    assert cache.step == 1
    assert cache.stats().steps == 1 and cache.stats().routes == 1


def test_scores_are_taken_highest_first_and_low_confidence_predictions_skipped() -> None:
    cache = ExpertCache(1, 6, 6)
    plan = cache.prefetch(0, {4: 0.1, 1: 0.7, 3: 0.7, 5: 0.05}, min_score=0.08)
    assert plan.copy.src_rows == (1, 3, 4)  # ties to the lower id; 5 is below the floor
    cache = ExpertCache(1, 6, 6)
    scores = np.array([0.0, 0.2, 0.9, 0.2, 0.01, 0.5])
    plan = cache.prefetch(0, scores, budget=3, min_score=0.1)
    assert plan.copy.src_rows == (2, 5, 1)
    assert plan.skipped == 1  # expert 3 scored high enough but the budget was spent


def test_the_budget_caps_copies_and_resident_predictions_cost_nothing() -> None:
    cache = ExpertCache(2, 8, 8)
    cache.ensure(1, [0, 1])
    plan = cache.prefetch(1, [0, 5, 1, 6, 7], budget=2)
    assert plan.copy.src_rows == (5, 6)
    assert (plan.resident, plan.skipped) == (2, 1)
    assert cache.prefetch(0, [1], budget=0).skipped == 1
    with pytest.raises(ConfigError, match="budget"):
        cache.prefetch(0, [1], budget=-1)


def test_a_prediction_naming_an_expert_outside_the_layer_is_refused_before_any_change() -> None:
    cache = ExpertCache(2, 4, 4)
    with pytest.raises(PlanError, match="prediction names expert 4"):
        cache.prefetch(0, [1, 4])
    with pytest.raises(PlanError, match="one score per expert"):
        cache.prefetch(0, np.zeros(3))
    with pytest.raises(PlanError, match="layer 2"):
        cache.prefetch(2, [0])
    assert cache.occupied() == 0 and cache.predicted(0) == ()


@pytest.mark.parametrize("make_policy", [LruPolicy, ExpectedReusePolicy, HitDensityPolicy])
def test_a_prefetch_never_evicts_a_slot_the_current_step_uses(
    make_policy: type[EvictionPolicy],
) -> None:
    cache = ExpertCache(2, 4, 4, policy=make_policy())
    cache.ensure(0, [0, 1, 2, 3])  # the whole pool is this step's
    plan = cache.prefetch(1, [0, 1])
    assert plan.copy.is_empty() and plan.skipped == 2
    assert [cache.slot_of(0, e) for e in range(4)] == [0, 1, 2, 3]
    cache.ensure(0, [0, 1])
    plan = cache.prefetch(1, [0, 1, 2])
    assert sorted(plan.copy.dst_slots) == [2, 3]  # experts 2 and 3 of layer 0 go
    assert plan.skipped == 1
    assert cache.slot_of(0, 0) == 0 and cache.slot_of(0, 1) == 1


@pytest.mark.parametrize("make_policy", [LruPolicy, ExpectedReusePolicy, HitDensityPolicy])
def test_a_prefetch_never_evicts_what_an_earlier_still_valid_prediction_needs(
    make_policy: type[EvictionPolicy],
) -> None:
    cache = ExpertCache(4, 2, 4, policy=make_policy())
    for layer in range(4):
        cache.ensure(layer, [0])  # slots 0..3 hold expert 0 of every layer
    cache.ensure(3, [0])
    first = cache.prefetch(1, [1, 0])  # expert 0 of layer 1 is resident: protected
    assert first.resident == 1 and len(first.copy.dst_slots) == 1
    needed = set(cache.predicted(1))
    assert len(needed) == 2
    second = cache.prefetch(2, [1, 0])
    assert not needed & set(second.copy.dst_slots)
    assert set(cache.predicted(1)) == needed
    # Layer 3 just stepped and layers 1 and 2 are predicted: nothing is left to take.
    third = cache.prefetch(0, [1])
    assert third.copy.is_empty() and third.skipped == 1
    assert set(cache.predicted(1)) == needed
    assert cache.ensure(1, [1, 0]).missing == 0


def test_a_victim_the_policy_offers_while_a_prediction_needs_it_is_kept() -> None:
    cache = ExpertCache(3, 2, 3, policy=LruPolicy())
    for layer in range(3):
        cache.ensure(layer, [0])  # slot `layer` holds expert 0 of that layer
    assert cache.prefetch(0, [0]).resident == 1  # layer 0's expert 0 is now needed
    plan = cache.prefetch(1, [1])
    # LRU offers slot 0 first (oldest); the prediction needs it, so slot 1 goes.
    assert plan.copy.dst_slots == (1,)
    assert cache.slot_of(0, 0) == 0 and cache.predicted(0) == (0,)
    assert cache.ensure(0, [0]).missing == 0


def test_a_prefetch_never_evicts_an_expert_it_predicts_to_make_room_for_another() -> None:
    for policy in (LruPolicy(), ExpectedReusePolicy(), HitDensityPolicy()):
        cache = ExpertCache(3, 5, 7, policy=policy)
        cache.materialize_layer(0)  # slots 0-4
        cache.prefetch(2, [2, 1])  # slots 5 and 6
        cache.ensure(2, [])  # both copies go unused
        # Expert 0 needs a slot; expert 2's unused copy (slot 5) is named too, so the
        # copy takes slot 6 and expert 2 stays where it is.
        plan = cache.prefetch(2, [0, 2])
        assert plan.copy == CopyPlan((6,), (0,)), type(policy).__name__
        assert plan.resident == 1
        assert cache.slot_of(2, 2) == 5 and cache.predicted(2) == (5, 6)


def test_unused_prefetched_experts_are_the_first_to_leave() -> None:
    cache = ExpertCache(3, 4, 4, policy=LruPolicy())
    cache.ensure(0, [0, 1])  # slots 0, 1
    cache.prefetch(1, [2, 3])  # slots 2, 3
    cache.ensure(1, [2])  # expert 3 of layer 1 went unused
    assert cache.unused() == (3,)
    # LRU alone would evict slot 0 (oldest); the unused copy goes first.
    plan = cache.ensure(2, [0])
    assert plan.copy.dst_slots == (3,)
    assert cache.stats().prefetch_wasted == 1
    assert cache.resident_in(0) == ExpertId(0, 0)


def test_forgotten_slots_are_taken_before_unused_prefetched_copies() -> None:
    cache = ExpertCache(2, 4, 4)
    cache.ensure(0, [0, 1])
    cache.prefetch(1, [2, 3])
    cache.ensure(1, [])
    cache.forget_slot(0)
    assert cache.unused() == (2, 3)
    plan = cache.ensure(0, [0, 2])
    assert plan.copy == CopyPlan((0, 2), (0, 2))
    assert cache.unused() == (3,)


def test_an_unused_copy_that_a_later_step_routes_is_a_hit() -> None:
    cache = ExpertCache(2, 4, 8)
    cache.prefetch(1, [3])
    cache.ensure(1, [0])
    assert cache.unused() == (0,)
    assert cache.ensure(1, [3]).missing == 0
    assert cache.unused() == ()
    assert cache.stats().prefetch_used == 1


def test_a_step_with_no_other_slot_left_drops_the_oldest_prediction() -> None:
    cache = ExpertCache(3, 2, 2)
    cache.prefetch(1, [0])  # slot 0
    cache.prefetch(2, [1])  # slot 1
    plan = cache.ensure(0, [0, 1])  # needs both slots: both predictions give way
    assert sorted(plan.copy.dst_slots) == [0, 1]
    assert cache.predicted(1) == () and cache.predicted(2) == ()
    assert cache.stats().prefetch_wasted == 2


def test_a_step_drops_a_prediction_only_when_no_other_slot_is_left() -> None:
    cache = ExpertCache(3, 2, 3)
    cache.ensure(0, [0])  # slot 0
    cache.prefetch(1, [0])  # slot 1
    cache.prefetch(2, [1])  # slot 2
    plan = cache.ensure(0, [1])  # expert 0 of layer 0 is not routed now: it goes
    assert plan.copy.dst_slots == (0,)
    assert cache.predicted(1) == (1,) and cache.predicted(2) == (2,)


def test_materialize_consumes_the_layers_prediction() -> None:
    cache = ExpertCache(2, 4, 8)
    cache.prefetch(0, [3, 2])
    cache.materialize_layer(0)
    assert cache.predicted(0) == ()
    assert [cache.slot_of(0, e) for e in range(4)] == [0, 1, 2, 3]
    assert cache.unused() == ()
    assert cache.occupied() == 4


def test_rebuild_drops_predictions() -> None:
    cache = ExpertCache(2, 4, 8)
    cache.prefetch(0, [3, 2])
    cache.rebuild(8)
    assert cache.predicted(0) == () and cache.unused() == () and cache.occupied() == 0


# -- properties: every invariant with prefetches mixed in -----------------------------

prefetch_ops = op_lists(prefetch=True)


def snapshot(cache: ExpertCache) -> dict[str, Any]:
    last = cache.step
    return {
        "keys": [cache.resident_in(s) for s in range(cache.cache_size)],
        "free": [s for s in range(cache.cache_size) if cache.resident_in(s) is None],
        "unused": list(cache.unused()),
        "step": {
            s
            for s in range(cache.cache_size)
            if cache.touched[s] == last and last > 0 and cache.resident_in(s) is not None
        },
        "predicted": {m: set(cache.predicted(m)) for m in range(cache.num_layers)},
    }


def check_take_order(dst: tuple[int, ...], before: dict[str, Any], hits: set[int]) -> None:
    """Fills take free slots (lowest first), then unused copies (oldest first) the step
    does not route, and only then anything else."""
    expected = before["free"] + [s for s in before["unused"] if s not in hits]
    head = list(dst[: len(expected)])
    assert head == expected[: len(head)], "a victim was taken before a free or unused slot"


def apply_op(cache: ExpertCache, op: str, arg: int, routed: list[int], budget: int | None) -> None:
    before = snapshot(cache)
    if op == "prefetch":
        named = {cache.slot_of(arg, e) for e in routed} - {None}
        plan = cache.prefetch(arg, routed, budget)
        dst = plan.copy.dst_slots
        protected = set(before["step"])
        for slots in before["predicted"].values():
            protected |= slots
        assert not protected & set(dst), "a prefetch evicted what a step or prediction needs"
        check_take_order(dst, before, named)  # type: ignore[arg-type]
        if budget is not None:
            assert len(dst) <= budget
        for s in before["predicted"][arg]:
            assert s in cache.predicted(arg)
        for e, s in zip(plan.copy.src_rows, dst):
            assert cache.slot_of(arg, e) == s
    elif op == "ensure":
        hits = {cache.slot_of(arg, e) for e in routed} - {None}
        ensured = cache.ensure(arg, routed)
        dst = ensured.copy.dst_slots
        assert not hits & set(dst), "a hit's slot was overwritten"
        assert all(s is not None for s in ensured.slots)
        check_take_order(dst, before, hits)  # type: ignore[arg-type]
        others: set[int] = set()
        for m, slots in before["predicted"].items():
            if m != arg:
                others |= slots
        if others & set(dst):
            # A prediction gave way: only once nothing unprotected was left.
            spare = set(range(cache.cache_size)) - hits - others
            assert spare <= set(dst), "a prediction was dropped while another slot was free"
        assert cache.predicted(arg) == ()
    elif op == "forget":
        cache.forget_slot(arg)
    else:
        cache.materialize_layer(arg)
    check_invariants(cache)


@pytest.mark.parametrize("make_policy", [LruPolicy, ExpectedReusePolicy, HitDensityPolicy])
@settings(max_examples=300, deadline=None)
@given(ops=prefetch_ops, size=st.integers(EXPERTS, 3 * EXPERTS))
def test_every_invariant_holds_with_prefetches_mixed_in(
    make_policy: type[EvictionPolicy],
    ops: list[Op],
    size: int,
) -> None:
    cache = ExpertCache(LAYERS, EXPERTS, size, policy=make_policy())
    for op, arg, routed, budget in ops:
        apply_op(cache, op, arg, routed, budget)


@pytest.mark.parametrize("make_checked", [checked_reuse, checked_density])
@settings(max_examples=200, deadline=None)
@given(ops=prefetch_ops, size=st.integers(EXPERTS, 2 * EXPERTS))
def test_policy_victims_match_a_scan_of_the_pool_with_prefetches_mixed_in(
    make_checked: Any, ops: list[Op], size: int
) -> None:
    # Each victim the policy gives, for a step or a prefetch, is checked against a scan
    # of every slot in its books.
    policy = make_checked()
    cache = ExpertCache(LAYERS, EXPERTS, size, policy=policy)
    for op, arg, routed, budget in ops:
        apply_op(cache, op, arg, routed, budget)


@settings(max_examples=40, deadline=None)
@given(ops=prefetch_ops, size=st.integers(EXPERTS, 2 * EXPERTS))
def test_prefetch_decides_identically_on_identical_input(ops: list[Op], size: int) -> None:
    def plans() -> list[object]:
        cache = ExpertCache(LAYERS, EXPERTS, size)
        out: list[object] = []
        for op, arg, routed, budget in ops:
            if op == "prefetch":
                out.append(cache.prefetch(arg, routed, budget))
            elif op == "ensure":
                out.append(cache.ensure(arg, routed))
            elif op == "forget":
                out.append(cache.forget_slot(arg))
            else:
                out.append(cache.materialize_layer(arg))
        return out

    assert plans() == plans()


class ReferencePrefetchLru:
    """The slow, obvious model of LRU with predictions: every rule written out by
    scanning the pool, to check the cache's flat bookkeeping against."""

    def __init__(self, size: int, experts: int) -> None:
        self.e = experts
        self.key: list[int | None] = [None] * size
        self.touched = [0] * size
        self.held: list[int | None] = [None] * size  # layer whose prediction holds it
        self.unused: list[int] = []  # oldest first
        self.pinned: set[int] = set()
        self.preds: dict[int, list[tuple[int, int]]] = {}  # layer -> (slot, key), in order
        self.step = 0

    def owned(self, s: int) -> bool:
        return self.held[s] is not None or s in self.unused

    def in_books(self, s: int) -> bool:
        return self.key[s] is not None and not self.owned(s)

    def slot_of(self, key: int) -> int | None:
        return next((s for s, k in enumerate(self.key) if k == key), None)

    def end_prediction(self, layer: int) -> list[int]:
        released = []
        for s, key in self.preds.pop(layer, []):
            if self.key[s] != key:
                continue
            if s in self.pinned:
                self.pinned.discard(s)
            elif self.held[s] == layer:
                self.held[s] = None
                released.append(s)
        return released

    def retire(self, slots: list[int]) -> None:
        self.unused += sorted(s for s in slots if s not in self.unused)

    def take(self) -> int | None:
        free = [s for s, k in enumerate(self.key) if k is None]
        if free:
            return free[0]
        if self.unused:
            return self.unused.pop(0)
        books = [s for s in range(len(self.key)) if self.in_books(s)]
        for s in sorted(books, key=lambda s: (self.touched[s], s)):
            if self.touched[s] == self.step:
                continue
            if s in self.pinned:
                self.pinned.discard(s)
                self.held[s] = self.key[s] // self.e  # type: ignore[operator]
                continue
            return s
        return None

    def ensure(self, layer: int, routed: list[int]) -> list[int]:
        self.step += 1
        released = self.end_prediction(layer)
        base = layer * self.e
        for e in set(routed):
            s = self.slot_of(base + e)
            if s is not None:
                self.touched[s] = self.step
                self.held[s] = None
                if s in self.unused:
                    self.unused.remove(s)
        self.retire([s for s in released if self.held[s] is None and self.touched[s] != self.step])
        dst = []
        for e in sorted(set(routed)):
            if self.slot_of(base + e) is not None:
                continue
            s = self.take()
            while s is None:
                oldest = next(iter(self.preds))
                self.retire(self.end_prediction(oldest))
                s = self.take()
            self.key[s], self.touched[s], self.held[s] = base + e, self.step, None
            self.pinned.discard(s)
            dst.append(s)
        return dst

    def prefetch(self, layer: int, predicted: list[int], budget: int | None) -> list[int]:
        base = layer * self.e
        entries = self.preds.setdefault(layer, [])
        dst: list[int] = []
        full = False
        missing = []
        for e in dict.fromkeys(predicted):  # the resident ones first: none is a victim
            s = self.slot_of(base + e)
            if s is None:
                missing.append(e)
            elif self.owned(s):
                if self.held[s] != layer:
                    self.unused.remove(s)
                    self.held[s] = layer
                    entries.append((s, base + e))
            elif s not in self.pinned:
                self.pinned.add(s)
                entries.append((s, base + e))
        for e in missing:
            if full or (budget is not None and len(dst) >= budget):
                continue
            s = self.take()
            if s is None:
                full = True
                continue
            self.key[s], self.held[s] = base + e, layer
            entries.append((s, base + e))
            dst.append(s)
        if not entries:
            del self.preds[layer]
        return dst

    def forget(self, slot: int) -> None:
        if 0 <= slot < len(self.key) and self.key[slot] is not None:
            self.key[slot] = self.held[slot] = None
            self.pinned.discard(slot)
            if slot in self.unused:
                self.unused.remove(slot)


lru_ops = op_lists(prefetch=True, materialize=False)


@settings(max_examples=500, deadline=None)
@given(ops=lru_ops, size=st.integers(EXPERTS, 3 * EXPERTS))
def test_lru_with_prefetch_matches_the_reference_model_on_any_sequence(
    ops: list[Op], size: int
) -> None:
    cache = ExpertCache(LAYERS, EXPERTS, size, policy=LruPolicy())
    model = ReferencePrefetchLru(size, EXPERTS)
    for op, arg, routed, budget in ops:
        if op == "ensure":
            assert list(cache.ensure(arg, routed).copy.dst_slots) == model.ensure(arg, routed)
        elif op == "prefetch":
            plan = cache.prefetch(arg, routed, budget)
            assert list(plan.copy.dst_slots) == model.prefetch(arg, routed, budget)
        else:
            cache.forget_slot(arg)
            model.forget(arg)
        assert [cache.resident_in(s) for s in range(size)] == [
            None if k is None else ExpertId(k // EXPERTS, k % EXPERTS) for k in model.key
        ]
        assert list(cache.unused()) == model.unused
