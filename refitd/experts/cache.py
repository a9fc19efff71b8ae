"""The expert cache: which MoE experts sit in a bounded pool of slots, and what to copy.

One pool of ``cache_size`` slots is shared by every layer; an expert is addressed by
its global key ``layer * num_experts + expert``. ``ensure(layer, routed)`` is the
decode hot path: it returns where each routed expert lives and the copies that make
that true. Nothing here moves bytes — the plan is the whole output, and
``refitd.experts.slots`` executes it.

The cache records the residency a plan describes *before* the caller executes it. A
caller whose copy fails must hand the slots the executor names to ``forget_slot``, so
the next step fetches them again instead of reading garbage.

``prefetch(layer, predicted, budget)`` takes a prediction of an upcoming layer's
routing (ids, or scores such as the next layer's router applied to the current hidden
state) and returns the copies that bring the predicted experts in ahead of time. Slots
a prediction holds are kept apart from the eviction policy until the predicted layer
runs (see ``prefetch``).

State lives in flat lists indexed by key and by slot, so a warm step is a handful of
list reads per routed expert and a victim is chosen without scanning the pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from refitd.errors import ConfigError, PlanError
from refitd.experts.density import HitDensityPolicy
from refitd.experts.lookahead import Lookahead
from refitd.experts.plans import (
    CacheStats,
    CopyPlan,
    EnsurePlan,
    ExpertId,
    GatherPlan,
    PrefetchPlan,
)
from refitd.experts.policy import EvictionPolicy

__all__ = [
    "CacheStats",
    "CopyPlan",
    "EnsurePlan",
    "ExpertCache",
    "ExpertId",
    "GatherPlan",
    "PrefetchPlan",
]

_NONE = -1


_EMPTY = CopyPlan()


class ExpertCache(Lookahead):
    """A global pool of expert slots with a pluggable eviction policy.

    The default policy is ``HitDensityPolicy`` (evict the least learned hits per
    slot-step; it beats LRU and ``ExpectedReusePolicy`` on ``refitd bench experts``);
    pass ``policy=LruPolicy()`` for the ferrox behaviour, least recent use with ties to
    the lowest slot.

    ``cache_size`` must be at least ``num_experts``: one step may route every expert
    of a layer, and all of a step's experts must be resident at once. ``max_fetch``
    turns on hybrid mode: at most that many misses are fetched per step, and the rest
    are left to CPU compute (their slots are ``None``); when misses exceed the cap,
    the most recently routed ones are fetched first, ties to the lower expert id.

    Prefetch (``prefetch``) keeps three kinds of slot outside the policy's books, so
    no policy needs to know about predictions: slots *held* by a still-valid
    prediction (filled by a prefetch, or resident experts the policy offered as
    victims while a prediction needed them), and *unused* slots, prefetched copies
    whose layer ran without routing them. A miss takes a free slot first, then the
    oldest unused one, then the policy's victim.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        cache_size: int,
        *,
        policy: EvictionPolicy | None = None,
        max_fetch: int | None = None,
    ) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ConfigError(
                f"expert cache needs at least one layer and one expert, got "
                f"{num_layers} layers of {num_experts} experts"
            )
        if max_fetch is not None and max_fetch < 0:
            raise ConfigError(f"max_fetch must be non-negative or None, got {max_fetch}")
        self._layers = num_layers
        self._experts = num_experts
        self._max_fetch = max_fetch
        self._policy: EvictionPolicy = policy if policy is not None else HitDensityPolicy()
        self._step = 0
        self._last_routed = [0] * (num_layers * num_experts)
        self._routes = [0] * num_layers
        self._hits = [0] * num_layers
        self._fetched = [0] * num_layers
        self._cpu = [0] * num_layers
        self._calls = [0] * num_layers
        self._evictions = 0
        self._materialized = 0
        self._size = 0
        self._slot_of: list[int] = []
        self._resident: list[int] = []
        self._touched: list[int] = []
        self._free: list[int] = []
        self._is_free: list[bool] = []
        self._n_free = 0
        # Prefetch state, see the class docstring. ``_owned[s]``: outside the policy's
        # books (held or unused); ``_held_by[s]``: the layer whose prediction holds it,
        # -1 otherwise; ``_pinned[s]``: in the books but needed by a prediction;
        # ``_fresh[s]``: a prefetched copy no step has used yet.
        self._owned: list[bool] = []
        self._held_by: list[int] = []
        self._pinned: list[bool] = []
        self._fresh: list[bool] = []
        self._n_owned = 0
        self._unused: list[tuple[int, int]] = []  # (seq, slot), oldest first
        self._unused_seq: list[int] = []
        self._seq = 0
        self._predicted: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]
        self._pred_order: list[int] = []
        self._step_in_books = 0
        self._prefetched = self._prefetch_used = self._prefetch_wasted = 0
        self.rebuild(cache_size)

    # -- the view policies read -------------------------------------------------

    @property
    def resident(self) -> Sequence[int]:
        """Key held by each slot, ``-1`` when empty. Read-only."""
        return self._resident

    @property
    def touched(self) -> Sequence[int]:
        """Last step that touched each slot. Read-only."""
        return self._touched

    @property
    def num_experts(self) -> int:
        return self._experts

    @property
    def num_layers(self) -> int:
        return self._layers

    @property
    def cache_size(self) -> int:
        return self._size

    @property
    def owned(self) -> Sequence[bool]:
        """Per slot: held by a prediction or an unused prefetched copy, i.e. outside
        the eviction policy's books (the policy cannot return it). Read-only."""
        return self._owned

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def step(self) -> int:
        """Steps taken so far (``ensure`` and ``materialize_layer`` calls)."""
        return self._step

    # -- lifecycle -----------------------------------------------------------

    def rebuild(self, cache_size: int) -> None:
        """Resize to ``cache_size`` slots, dropping all residency; counters survive.

        Slot ids are positions in an allocation that no longer exists, so keeping the
        map would point at other experts' bytes. The executor must be resized with it.
        """
        if cache_size < self._experts:
            raise ConfigError(
                f"cache_size {cache_size} is smaller than one layer's {self._experts} "
                "experts: a step routing every expert of a layer could not be placed"
            )
        self._size = cache_size
        self._slot_of = [_NONE] * (self._layers * self._experts)
        self._resident = [_NONE] * cache_size
        self._touched = [0] * cache_size
        self._free = list(range(cache_size))
        self._is_free = [True] * cache_size
        self._n_free = cache_size
        self._owned = [False] * cache_size
        self._held_by = [_NONE] * cache_size
        self._pinned = [False] * cache_size
        self._fresh = [False] * cache_size
        self._n_owned = 0
        self._unused = []
        self._unused_seq = [_NONE] * cache_size
        self._predicted = [[] for _ in range(self._layers)]
        self._pred_order = []
        self._step_in_books = 0
        self._policy.reset(self, cache_size)

    # -- queries ---------------------------------------------------------------

    def resident_in(self, slot: int) -> ExpertId | None:
        """The expert the cache believes ``slot`` holds; ``None`` if empty or unknown."""
        if not 0 <= slot < self._size:
            return None
        key = self._resident[slot]
        if key < 0:
            return None
        return ExpertId(key // self._experts, key % self._experts)

    def slot_of(self, layer: int, expert: int) -> int | None:
        """Where ``(layer, expert)`` is resident, or ``None``."""
        if not (0 <= layer < self._layers and 0 <= expert < self._experts):
            return None
        slot = self._slot_of[layer * self._experts + expert]
        return slot if slot >= 0 else None

    def occupied(self) -> int:
        """Slots holding an expert."""
        return self._size - self._n_free

    def stats(self) -> CacheStats:
        """Totals over all layers."""
        return CacheStats(
            steps=sum(self._calls),
            routes=sum(self._routes),
            hits=sum(self._hits),
            misses=sum(self._routes) - sum(self._hits),
            fetched=sum(self._fetched),
            cpu=sum(self._cpu),
            evictions=self._evictions,
            materialized=self._materialized,
            prefetched=self._prefetched,
            prefetch_used=self._prefetch_used,
            prefetch_wasted=self._prefetch_wasted,
        )

    def layer_stats(self, layer: int) -> CacheStats:
        """Counts for one layer (evictions and materializations are pool-wide: 0)."""
        self._check_layer(layer)
        return CacheStats(
            steps=self._calls[layer],
            routes=self._routes[layer],
            hits=self._hits[layer],
            misses=self._routes[layer] - self._hits[layer],
            fetched=self._fetched[layer],
            cpu=self._cpu[layer],
        )

    def reset_stats(self) -> None:
        n = self._layers
        self._routes, self._hits, self._fetched = [0] * n, [0] * n, [0] * n
        self._cpu, self._calls = [0] * n, [0] * n
        self._evictions = self._materialized = 0
        self._prefetched = self._prefetch_used = self._prefetch_wasted = 0

    # -- the hot path ------------------------------------------------------------

    def ensure(self, layer: int, routed: Sequence[int]) -> EnsurePlan:
        """Make ``routed`` experts of ``layer`` resident; return slots and copies.

        Duplicate routes are served once. Hits are refreshed first, so no slot this
        step uses can be a victim; misses take free (never-filled or forgotten) slots,
        lowest first, then unused prefetched copies, oldest first, then the policy's
        victims, in ascending expert order. The step ends the layer's prediction, if
        any: predicted copies it routes are hits, the rest become unused.
        """
        experts = self._experts
        if not 0 <= layer < self._layers:
            self._check_layer(layer)
        uniq = set(routed)
        if uniq and (min(uniq) < 0 or max(uniq) >= experts):
            bad = min(uniq) if min(uniq) < 0 else max(uniq)
            raise PlanError(
                f"layer {layer} routed expert {bad}, outside 0..{experts - 1}: the router "
                "and the cache disagree on the expert count"
            )
        self._step = step = self._step + 1
        self._policy.begin_step(step, layer)
        released = self._end_prediction(layer) if self._predicted[layer] else None
        base = layer * experts
        slot_of = self._slot_of
        touched = self._touched
        owned = self._owned
        hit_slots: list[int] = []
        misses: list[int] = []
        adopted = False
        # Without duplicates, walking ``routed`` itself leaves a warm step's hits in
        # route order, which is the plan's slot tuple as it stands.
        distinct = len(uniq) == len(routed)
        for e in routed if distinct else uniq:
            s = slot_of[base + e]
            if s >= 0:
                touched[s] = step
                hit_slots.append(s)
                if owned[s]:
                    adopted = True
            else:
                misses.append(e)
        if adopted:
            self._adopt(hit_slots)
        if released:
            self._retire(released)
        self._calls[layer] += 1
        self._routes[layer] += len(uniq)
        self._hits[layer] += len(hit_slots)
        if not misses:
            if self._max_fetch is not None:
                last = self._last_routed
                for e in uniq:
                    last[base + e] = step
            slots = tuple(hit_slots) if distinct else tuple([slot_of[base + e] for e in routed])
            hit_slots.sort()
            self._policy.on_step(step, hit_slots)
            self._step_in_books = len(hit_slots)
            return EnsurePlan(slots, _EMPTY, len(uniq), 0, 0)
        return self._place(layer, step, routed, uniq, hit_slots, misses)

    def _place(
        self,
        layer: int,
        step: int,
        routed: Sequence[int],
        uniq: set[int],
        touched_slots: list[int],
        misses: list[int],
    ) -> EnsurePlan:
        base = layer * self._experts
        cap = self._max_fetch
        last = self._last_routed
        if cap is not None and len(misses) > cap:
            misses.sort(key=lambda e: (-last[base + e], e))
            fetch = misses[:cap]
        else:
            misses.sort()
            fetch = misses
        if cap is not None:
            for e in uniq:
                last[base + e] = step
        slot_of = self._slot_of
        resident = self._resident
        touched = self._touched
        policy = self._policy
        dst: list[int] = []
        for e in fetch:
            # Every slot this step touched so far is in the books and off limits.
            slot = self._take_slot(step, len(touched_slots))
            while slot < 0:
                # Only slots held for other layers' predictions are left: demand wins,
                # the oldest prediction is dropped (its copies become unused).
                if not self._pred_order:
                    raise PlanError(
                        f"no slot left for layer {layer}: every slot is used by this step"
                    )
                self._end_prediction(self._pred_order[0], cancel=True)
                slot = self._take_slot(step, len(touched_slots))
            key = base + e
            resident[slot] = key
            slot_of[key] = slot
            touched[slot] = step
            dst.append(slot)
            touched_slots.append(slot)
        if len(fetch) < len(misses):
            # Routed but left to the CPU: still routing the policy should learn from.
            policy.on_unplaced(step, sorted(base + e for e in misses[len(fetch) :]))
        touched_slots.sort()
        policy.on_step(step, touched_slots)
        self._step_in_books = len(touched_slots)
        self._fetched[layer] += len(fetch)
        self._cpu[layer] += len(misses) - len(fetch)
        slots = tuple([s if (s := slot_of[base + e]) >= 0 else None for e in routed])
        return EnsurePlan(
            slots, CopyPlan(tuple(dst), tuple(fetch)), len(uniq), len(misses), len(fetch)
        )

    # -- recovery and whole-layer loads ---------------------------------------------

    def forget_slot(self, slot: int) -> ExpertId | None:
        """Mark ``slot`` empty; it becomes the first candidate for the next miss.

        Returns the expert it held. Idempotent: an empty or unknown slot is a no-op
        returning ``None``, so fault recovery need not know how far a copy got.
        """
        if not 0 <= slot < self._size:
            return None
        key = self._resident[slot]
        if key < 0:
            return None
        self._release(slot)
        return ExpertId(key // self._experts, key % self._experts)

    def _release(self, slot: int) -> None:
        if self._owned[slot]:
            self._owned[slot] = False
            self._n_owned -= 1
            self._held_by[slot] = _NONE
            self._unused_seq[slot] = _NONE
            if self._fresh[slot]:
                self._fresh[slot] = False
                self._prefetch_wasted += 1
        elif self._touched[slot] == self._step and self._step_in_books > 0:
            self._step_in_books -= 1
        self._pinned[slot] = False
        self._slot_of[self._resident[slot]] = _NONE
        self._resident[slot] = _NONE
        self._policy.on_remove(slot)
        self._is_free[slot] = True
        self._n_free += 1
        heapq.heappush(self._free, slot)

    def materialize_layer(self, layer: int) -> CopyPlan:
        """Load the whole layer into slots ``0..num_experts-1``, slot ``e`` = expert ``e``.

        Whoever lived in those slots is displaced, and a copy of one of this layer's
        experts elsewhere in the pool is released, so no expert is resident twice. The
        plan always names every expert: it is one whole-layer copy, the one shape a
        layer without pinned host rows accepts.
        """
        self._check_layer(layer)
        experts = self._experts
        base = layer * experts
        self._step = step = self._step + 1
        self._policy.begin_step(step, layer)
        if self._predicted[layer]:
            self._end_prediction(layer)  # the whole layer is loaded: every copy is used
        for e in range(experts):
            other = self._slot_of[base + e]
            if other >= 0 and other != e:
                self._release(other)
        for e in range(experts):
            key = self._resident[e]
            if key >= 0 and key != base + e:
                self._release(e)
                self._evictions += 1
        self._adopt(range(experts))
        for e in range(experts):
            if self._is_free[e]:
                self._is_free[e] = False
                self._n_free -= 1
            self._resident[e] = base + e
            self._slot_of[base + e] = e
            self._touched[e] = step
        # Stale heap entries for slots 0..E-1 are skipped on pop via ``_is_free``.
        self._policy.on_step(step, range(experts))
        self._step_in_books = experts
        self._materialized += 1
        ids = tuple(range(experts))
        return CopyPlan(ids, ids)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._layers:
            raise PlanError(f"layer {layer} is outside the cache's 0..{self._layers - 1}")
