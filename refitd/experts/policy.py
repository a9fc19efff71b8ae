"""Eviction policies for the expert cache: who leaves the pool when a miss needs a slot.

The cache owns placement (free slots, forgotten slots, the same-step rule, miss order)
and asks a policy one question only: *which occupied slot goes next?* Keeping the
policy that narrow is what lets every policy inherit the ferrox invariants for free:

- decisions are deterministic: a policy sees only the cache's step counter and the
  slots it touched, never a clock or a random source;
- a slot touched in the current step is never a victim: the cache checks the slot a
  policy returns and refuses a policy that breaks this;
- forgotten and never-filled slots are taken before any victim is asked for.

Keys are global expert keys, ``layer * num_experts + expert``. A *step* is one
``ensure`` (or ``materialize_layer``) call; the cache numbers them from 1.

Policies here:

- ``LruPolicy`` — least recent use, ties to the lowest slot (the ferrox behaviour).
- ``BeladyPolicy`` — Belady's MIN, an offline oracle over a known trace: evict the
  resident expert whose next use lies furthest ahead. The ceiling for any policy.

Learned policies live in their own modules: ``refitd.experts.reuse.ExpectedReusePolicy``
(evict the expert whose next use is expected furthest ahead, from learned routing
frequency and stickiness) and the cache's default,
``refitd.experts.density.HitDensityPolicy`` (learns the same, evicts the least expected
hits per slot-step).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from refitd.errors import PlanError

__all__ = [
    "BeladyPolicy",
    "EvictionPolicy",
    "LruPolicy",
    "PoolView",
]


class PoolView(Protocol):
    """What a policy may read of the cache's state. Read-only by contract.

    ``resident[slot]`` is the key held in ``slot`` (``-1`` when empty);
    ``touched[slot]`` is the last step that routed to or filled ``slot``.
    """

    @property
    def resident(self) -> Sequence[int]: ...

    @property
    def touched(self) -> Sequence[int]: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def num_layers(self) -> int: ...


class EvictionPolicy(ABC):
    """Chooses victims among occupied slots. One instance serves one cache.

    Call order within a step: ``begin_step``, zero or more ``choose_victim`` calls
    (only when no free slot is left), in hybrid mode one ``on_unplaced`` naming the
    routed experts left to CPU compute, then exactly one ``on_step`` naming every slot
    the step hit or filled. ``on_remove`` is called when the cache empties a slot outside a step's
    fills (``forget_slot``, a displaced occupant in ``materialize_layer``).
    """

    name: str = "policy"

    @abstractmethod
    def reset(self, pool: PoolView, slots: int) -> None:
        """Forget everything: the pool now has ``slots`` empty slots."""

    def begin_step(self, step: int, layer: int) -> None:  # noqa: B027 - optional hook
        """A step for ``layer`` starts; victims for it may be asked for next."""

    @abstractmethod
    def on_step(self, step: int, slots: Sequence[int]) -> None:
        """Record a step. ``slots`` are ascending and each holds its routed key now."""

    def on_unplaced(self, step: int, keys: Sequence[int]) -> None:  # noqa: B027 - optional
        """Routed experts of this step (global keys, ascending) that hold no slot: hybrid
        mode left them to CPU compute. They were routed all the same, so a policy that
        learns routing frequency should count them; by default nothing happens."""

    @abstractmethod
    def choose_victim(self, step: int) -> int:
        """Return an occupied slot not touched in ``step``, and drop it from the books.

        Only called while every slot is occupied. The slot is refilled in the same
        step, so the next ``on_step`` names it again with its new key.
        """

    @abstractmethod
    def on_remove(self, slot: int) -> None:
        """``slot`` was emptied by the cache and is no longer a candidate."""


class LruPolicy(EvictionPolicy):
    """Least recent use over steps, ties broken toward the lowest slot.

    The order is one ``OrderedDict`` of occupied slots, oldest first: a step appends
    its slots in ascending order, so the front is always the smallest
    ``(last step, slot)`` pair and a victim costs O(1). A slot the current step
    already touched can sit at the front only while the step is being placed;
    those are skipped and put back by the ``on_step`` that follows.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._touched: Sequence[int] = ()

    def reset(self, pool: PoolView, slots: int) -> None:
        self._order = OrderedDict()
        self._touched = pool.touched

    def on_step(self, step: int, slots: Sequence[int]) -> None:
        order = self._order
        move = order.move_to_end
        for s in slots:
            order[s] = None
            move(s)

    def choose_victim(self, step: int) -> int:
        order = self._order
        touched = self._touched
        skipped: list[int] = []
        while True:
            slot, _ = order.popitem(last=False)
            if touched[slot] != step:
                break
            skipped.append(slot)
        for s in reversed(skipped):
            order[s] = None
            order.move_to_end(s, last=False)
        return slot

    def on_remove(self, slot: int) -> None:
        self._order.pop(slot, None)


class _LazyMaxHeap:
    """Slots by priority, highest first, ties to the lowest slot; O(log n) updates.

    Updates push a new entry and leave the old one to be skipped on pop (it no longer
    matches ``prio[slot]``); the heap is rebuilt when stale entries outnumber live
    ones four to one, so its size stays O(slots).
    """

    def __init__(self, slots: int) -> None:
        self.prio: list[float | None] = [None] * slots
        self.heap: list[tuple[float, int]] = []

    def set(self, slot: int, prio: float) -> None:
        self.prio[slot] = prio
        heapq.heappush(self.heap, (-prio, slot))
        if len(self.heap) > 4 * len(self.prio) + 64:
            self.heap = [(-p, s) for s, p in enumerate(self.prio) if p is not None]
            heapq.heapify(self.heap)

    def drop(self, slot: int) -> None:
        self.prio[slot] = None

    def pop_where(self, touched: Sequence[int], step: int) -> int:
        """Pop the best live slot not touched in ``step``; skipped live ones stay."""
        heap = self.heap
        prio = self.prio
        kept: list[tuple[float, int]] = []
        while heap:
            neg, slot = heapq.heappop(heap)
            if prio[slot] != -neg:
                continue
            if touched[slot] == step:
                kept.append((neg, slot))
                continue
            prio[slot] = None
            for entry in kept:
                heapq.heappush(heap, entry)
            return slot
        raise PlanError("eviction asked for a victim but no occupied slot is evictable")


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN: evict the resident expert whose next use is furthest ahead.

    An offline oracle, built from the exact sequence of ``(layer, routed)`` steps the
    cache will be asked to ``ensure``, from a fresh cache, in order. Keys never used
    again rank beyond the end of the trace (ties to the lowest slot). Replaying a
    different sequence is refused the moment it diverges, because the answers would
    silently stop being optimal.
    """

    name = "belady"

    def __init__(self, steps: Sequence[tuple[int, Sequence[int]]], num_experts: int) -> None:
        uses: dict[int, list[int]] = {}
        for i, (layer, routed) in enumerate(steps, start=1):
            base = layer * num_experts
            for e in set(routed):
                uses.setdefault(base + e, []).append(i)
        self._uses = uses
        self._horizon = float(len(steps) + 1)
        self._cursor: dict[int, int] = {}
        self._heap = _LazyMaxHeap(0)
        self._resident: Sequence[int] = ()
        self._touched: Sequence[int] = ()

    def reset(self, pool: PoolView, slots: int) -> None:
        self._heap = _LazyMaxHeap(slots)
        self._cursor = {}
        self._resident = pool.resident
        self._touched = pool.touched

    def _next_use(self, key: int, step: int) -> float:
        uses = self._uses.get(key)
        if uses is None:
            raise PlanError(f"Belady oracle replayed off its trace: key {key} never occurs")
        i = self._cursor.get(key, 0)
        while i < len(uses) and uses[i] < step:
            i += 1
        if i == len(uses) or uses[i] != step:
            raise PlanError(
                f"Belady oracle replayed off its trace: key {key} is not routed at step {step}"
            )
        self._cursor[key] = i + 1
        return float(uses[i + 1]) if i + 1 < len(uses) else self._horizon

    def on_step(self, step: int, slots: Sequence[int]) -> None:
        resident = self._resident
        for s in slots:
            self._heap.set(s, self._next_use(resident[s], step))

    def choose_victim(self, step: int) -> int:
        return self._heap.pop_where(self._touched, step)

    def on_remove(self, slot: int) -> None:
        self._heap.drop(slot)
