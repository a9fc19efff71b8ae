"""The expert cache's value types: experts, the plans it returns, its counters.

Frozen msgspec structs and dataclasses, shared by the cache (``refitd.experts.cache``),
the executor (``refitd.experts.slots``) and the daemon's pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

__all__ = [
    "CacheStats",
    "CopyPlan",
    "EnsurePlan",
    "ExpertId",
    "GatherPlan",
    "PrefetchPlan",
]


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


class PrefetchPlan(msgspec.Struct, frozen=True):
    """The answer to one ``prefetch``.

    ``copy`` brings predicted experts of ``layer`` into free or evicted slots (most
    confident first); ``resident`` counts predicted experts already resident, now
    protected until the layer runs; ``skipped`` counts predictions neither resident
    nor copied: over ``budget``, below ``min_score``, or with no slot the prefetch may
    take.
    """

    layer: int
    copy: CopyPlan
    resident: int
    skipped: int


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
    prefetched: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of routes already resident, 0.0 before any route."""
        return self.hits / self.routes if self.routes else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        """Fraction of prefetched copies a step used before they left; 0.0 before any."""
        done = self.prefetch_used + self.prefetch_wasted
        return self.prefetch_used / done if done else 0.0
