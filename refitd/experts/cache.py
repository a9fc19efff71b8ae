"""The expert cache: which MoE experts sit in a bounded pool of slots, and what to copy.

One pool of ``cache_size`` slots is shared by every layer; an expert is addressed by
its global key ``layer * num_experts + expert``. ``ensure(layer, routed)`` is the
decode hot path: it returns where each routed expert lives and the copies that make
that true. Nothing here moves bytes — the plan is the whole output, and
``refitd.experts.slots`` executes it.

The cache records the residency a plan describes *before* the caller executes it. A
caller whose copy fails must hand the slots the executor names to ``forget_slot``, so
the next step fetches them again instead of reading garbage.

State lives in flat lists indexed by key and by slot, so a warm step is a handful of
list reads per routed expert and a victim is chosen without scanning the pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from refitd.errors import ConfigError, PlanError
from refitd.experts.density import HitDensityPolicy
from refitd.experts.policy import EvictionPolicy

__all__ = [
    "CacheStats",
    "CopyPlan",
    "EnsurePlan",
    "ExpertCache",
    "ExpertId",
    "GatherPlan",
]

_NONE = -1


class ExpertId(msgspec.Struct, frozen=True, order=True):
    """One expert of one MoE layer (both zero-based)."""

    layer: int
    expert: int


class CopyPlan(msgspec.Struct, frozen=True):
    """Host→slot copies: row ``src_rows[i]`` of the plan's layer into ``dst_slots[i]``.

    Rows are layer-local expert ids, not global keys, so each layer's host rows can
    live in their own allocation (and so carry their own host residency).
    """

    dst_slots: tuple[int, ...] = ()
    src_rows: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return not self.dst_slots and not self.src_rows


class GatherPlan(msgspec.Struct, frozen=True):
    """Slot→slot copies inside the pool: ``src_slots[i]`` onto ``dst_slots[i]``."""

    dst_slots: tuple[int, ...] = ()
    src_slots: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return not self.dst_slots and not self.src_slots


class EnsurePlan(msgspec.Struct, frozen=True):
    """The answer to one ``ensure``.

    ``slots[i]`` is where ``routed[i]`` lives after ``copy`` is applied (caller order,
    duplicates repeated), or ``None`` when hybrid mode leaves that expert to CPU
    compute. ``active`` counts distinct routed experts, ``missing`` those not resident
    before the step, ``fetched`` those this plan copies (``fetched <= missing``).
    """

    slots: tuple[int | None, ...]
    copy: CopyPlan
    active: int
    missing: int
    fetched: int


_EMPTY = CopyPlan()


@dataclass(frozen=True)
class CacheStats:
    """Counts over ``ensure`` calls. Routes are distinct experts per call."""

    steps: int = 0
    routes: int = 0
    hits: int = 0
    misses: int = 0
    fetched: int = 0
    cpu: int = 0
    evictions: int = 0
    materialized: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of routes already resident, 0.0 before any route."""
        return self.hits / self.routes if self.routes else 0.0


class ExpertCache:
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
        return self._size - sum(self._is_free)

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

    # -- the hot path ------------------------------------------------------------

    def ensure(self, layer: int, routed: Sequence[int]) -> EnsurePlan:
        """Make ``routed`` experts of ``layer`` resident; return slots and copies.

        Duplicate routes are served once. Hits are refreshed first, so no slot this
        step uses can be a victim; misses take free (never-filled or forgotten) slots,
        lowest first, then the policy's victims, in ascending expert order.
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
        base = layer * experts
        slot_of = self._slot_of
        touched = self._touched
        hit_slots: list[int] = []
        misses: list[int] = []
        for e in uniq:
            s = slot_of[base + e]
            if s >= 0:
                touched[s] = step
                hit_slots.append(s)
            else:
                misses.append(e)
        self._calls[layer] += 1
        self._routes[layer] += len(uniq)
        self._hits[layer] += len(hit_slots)
        if not misses:
            if self._max_fetch is not None:
                last = self._last_routed
                for e in uniq:
                    last[base + e] = step
            hit_slots.sort()
            self._policy.on_step(step, hit_slots)
            return EnsurePlan(tuple([slot_of[base + e] for e in routed]), _EMPTY, len(uniq), 0, 0)
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
        free = self._free
        is_free = self._is_free
        policy = self._policy
        dst: list[int] = []
        for e in fetch:
            slot = _NONE
            while free:
                s = heapq.heappop(free)
                if is_free[s]:
                    is_free[s] = False
                    slot = s
                    break
            if slot < 0:
                slot = policy.choose_victim(step)
                if touched[slot] == step or resident[slot] < 0:
                    raise PlanError(
                        f"policy {policy.name!r} chose slot {slot}, which this step "
                        "already uses or which holds nothing: evicting it would break "
                        "the step's own placement"
                    )
                slot_of[resident[slot]] = _NONE
                self._evictions += 1
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
        self._slot_of[self._resident[slot]] = _NONE
        self._resident[slot] = _NONE
        self._policy.on_remove(slot)
        self._is_free[slot] = True
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
        for e in range(experts):
            other = self._slot_of[base + e]
            if other >= 0 and other != e:
                self._release(other)
        for e in range(experts):
            key = self._resident[e]
            if key >= 0 and key != base + e:
                self._release(e)
                self._evictions += 1
        for e in range(experts):
            self._is_free[e] = False
            self._resident[e] = base + e
            self._slot_of[base + e] = e
            self._touched[e] = step
        # Stale heap entries for slots 0..E-1 are skipped on pop via ``_is_free``.
        self._policy.on_step(step, range(experts))
        self._materialized += 1
        ids = tuple(range(experts))
        return CopyPlan(ids, ids)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._layers:
            raise PlanError(f"layer {layer} is outside the cache's 0..{self._layers - 1}")
