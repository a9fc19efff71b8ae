"""MoE expert slot pools hosted by the daemon: creating one, ``ensure`` (make a step's
routed experts resident), ``prefetch``, ``invalidate``, and a pool's statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from refitd.wire.fields import Label, NonNeg, Positive

if TYPE_CHECKING:
    from refitd.experts.cache import CacheStats
    from refitd.experts.slots import SlotStats

__all__ = [
    "EnsureRequest",
    "EnsureResult",
    "ExpertRef",
    "HostResidencyName",
    "InvalidateRequest",
    "InvalidateResult",
    "PoolCreate",
    "PoolInfo",
    "PoolName",
    "PoolStats",
    "PrefetchRequest",
    "PrefetchResult",
]

PoolName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]
HostResidencyName = Literal["pinned", "locked", "pageable"]


class PoolCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Create an MoE expert slot pool hosted by the daemon.

    ``row_bytes`` is one expert's row per bank (gate, up, down by convention), in
    bytes. ``residency`` gives each layer's host residency (empty: every layer
    pinned); a layer that is not pinned must be listed in ``cpu_layers``, since its
    experts can only be computed on the CPU. ``slots`` must be at least ``experts``.
    """

    name: PoolName
    layers: Positive
    experts: Positive
    slots: Positive
    row_bytes: list[Positive]
    residency: list[HostResidencyName] = []
    cpu_layers: list[NonNeg] = []
    owner: Label = ""


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A pool and where its bytes live (all offsets and sizes in bytes).

    Host rows, region ``host_region``: bank ``b``'s rows start at
    ``host_bank_offsets[b]``, layer-major, so row ``(layer, expert)`` of bank ``b``
    is at ``host_bank_offsets[b] + (layer * experts + expert) * row_bytes[b]``.
    Slot memory, region ``slot_region``: slot ``s`` of bank ``b`` is at
    ``slot_bank_offsets[b] + s * row_bytes[b]``. A refit writes new expert rows into
    the host region (a pull, or the trainer's own mapping followed by ``invalidate``).
    """

    name: str
    layers: int
    experts: int
    slots: int
    row_bytes: list[int]
    residency: list[HostResidencyName]
    cpu_layers: list[int]
    host_region: int
    slot_region: int
    host_bank_offsets: list[int]
    slot_bank_offsets: list[int]
    owner: str = ""
    occupied_slots: int = 0
    #: ensure calls applied, and those that moved nothing
    plans: int = 0
    warm_plans: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    #: bytes copied from host rows into slots since creation
    copied_bytes: int = 0
    #: slots dropped because a refit rewrote (or a caller invalidated) their expert
    stale_invalidations: int = 0
    #: bytes copied by prefetches (also in ``copied_bytes``), and prefetched experts
    #: a step used / that left unused
    prefetched_bytes: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    #: slots whose prefetch copy has not been seen to land yet
    in_flight_slots: int = 0


class EnsureRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Make ``routed`` experts (layer-local ids, duplicates allowed) of ``layer`` resident."""

    layer: NonNeg
    routed: list[NonNeg]


class EnsureResult(msgspec.Struct, frozen=True, kw_only=True):
    """Where each routed expert lives now (``slots[i]`` for ``routed[i]``), and what moved.

    ``copied_slots[i]`` received expert ``copied_experts[i]`` of the layer in this
    call; ``copied_bytes`` is the bytes copied from host rows (0 on a warm step).
    """

    layer: int
    slots: list[int]
    active: int
    missing: int
    fetched: int
    copied_slots: list[int] = []
    copied_experts: list[int] = []
    copied_bytes: int = 0
    warm: bool = False
    #: slots the step uses whose prefetch copy it waited for (never copied again)
    waited: int = 0


class PrefetchRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A prediction of ``layer``'s next step: ``experts`` (layer-local ids, most
    confident first) or ``scores`` (one per expert of the layer, e.g. the layer's
    router applied to the current hidden state; highest first, ``min_score`` skips
    the rest), never both. At most ``budget`` copies (``None``: one per prediction)."""

    layer: NonNeg
    experts: list[NonNeg] = []
    scores: list[float] = []
    budget: NonNeg | None = None
    min_score: float | None = None


class PrefetchResult(msgspec.Struct, frozen=True, kw_only=True):
    """Copies issued in the background: ``copied_slots[i]`` is receiving expert
    ``copied_experts[i]``; the next ``ensure`` naming them waits for them to land.
    ``resident`` predicted experts were already there (now kept for the layer's
    step); ``skipped`` were neither copied nor resident (budget, ``min_score``, or
    no slot a prefetch may take)."""

    layer: int
    copied_slots: list[int] = []
    copied_experts: list[int] = []
    copied_bytes: int = 0
    resident: int = 0
    skipped: int = 0


class ExpertRef(msgspec.Struct, frozen=True, array_like=True):
    """One expert of one layer, both zero-based; on the wire ``[layer, expert]``."""

    layer: NonNeg
    expert: NonNeg


class InvalidateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Drop the slots holding these experts (a refit rewrote their rows); ``layers``
    drops every expert of the listed layers. The next ``ensure`` fetches them again."""

    experts: list[ExpertRef] = []
    layers: list[NonNeg] = []


class InvalidateResult(msgspec.Struct, frozen=True):
    """Slots dropped, and the experts they held."""

    slots: list[int]
    experts: list[ExpertRef]


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """One expert slot pool, as the daemon's pool reports it. Counters are totals
    since the pool was created; ``copied_bytes`` in bytes."""

    pool: str
    layers: int
    slots: int
    occupied_slots: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    copied_bytes: int = 0
    #: Slots dropped because a refit rewrote the expert they held.
    stale_invalidations: int = 0

    @classmethod
    def from_pool(
        cls,
        pool: str,
        *,
        layers: int,
        slots: int,
        occupied_slots: int,
        cache: CacheStats,
        executor: SlotStats,
        stale_invalidations: int = 0,
    ) -> PoolStats:
        """Bridge from :mod:`refitd.experts`: the planner's :class:`CacheStats` (hits,
        misses, evictions) and the executor's :class:`SlotStats` (bytes copied into
        slots, from host rows and from other slots)."""
        return cls(
            pool=pool,
            layers=layers,
            slots=slots,
            occupied_slots=occupied_slots,
            hits=cache.hits,
            misses=cache.misses,
            evictions=cache.evictions,
            copied_bytes=executor.host_bytes + executor.device_bytes,
            stale_invalidations=stale_invalidations,
        )
