"""One MoE expert slot pool hosted by the daemon: the operations on it (the daemon's
set of pools: :mod:`refitd.daemon.experts.pools`; their HTTP API:
:mod:`refitd.daemon.experts.routes`).

A pool is the daemon-side home of :mod:`refitd.experts`: the planner
(:class:`~refitd.experts.ExpertCache`) and the executor
(:class:`~refitd.experts.ExpertSlots`) over two daemon-owned shared-memory regions,
one holding every expert's host rows and one holding the slots. The regions are
ordinary regions: a trainer pulls new expert rows into the host region like any
other refit destination, and an engine maps the slot region by its handle.

The layouts of the two regions: :mod:`refitd.daemon.experts.memory`.

Staleness: the cache believes a slot holds an expert until told otherwise, so
every write into a host region is noted on its pool (:meth:`ExpertPool.note_rewrite`;
the pulls that write one are noted by :mod:`refitd.daemon.experts.pools`), and the
slots of the experts whose rows it touches are dropped before the next operation on
the pool. ``POST .../invalidate`` does the same for writes the daemon cannot see (a
trainer writing through its own mapping of the host region).

A plan the executor refuses changes nothing it has not already given up: the
slots the cache had promised are forgotten, so the cache never names an expert
for a slot that holds another's bytes, and the refusal is answered as 422.

Prefetch: ``POST .../prefetch`` takes a prediction of a layer's next step and
issues its copies on the pool's copier thread, answering before they land; the
next ``ensure`` that names one of those slots waits for its copy (in a worker
thread, never on the event loop) instead of copying again, so every slot an
``ensure`` answer names holds its expert's bytes when the answer is sent. Copies
still in flight are waited for before a pool or the daemon goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
import numpy as np

from refitd.daemon.experts.memory import RegionExpertRows, RegionSlotMemory, touched_rows
from refitd.errors import PlanError, ProtocolError, TransportError
from refitd.experts import (
    BankResidency,
    CopyPlan,
    DeviceFlushFault,
    EnsurePlan,
    ExpertCache,
    ExpertSlots,
    HostResidency,
    SlotFault,
    SlotGeometry,
)
from refitd.wire import (
    EnsureRequest,
    EnsureResult,
    ExpertRef,
    InvalidateRequest,
    InvalidateResult,
    PoolCreate,
    PoolInfo,
    PoolStats,
    PrefetchRequest,
    PrefetchResult,
    RegionInfo,
)
from transports.local import CopyFault

__all__ = ["THREAD_COPY_BYTES", "ExpertPool", "residency_of"]

#: A plan copying more than this many bytes runs in a worker thread, so a large
#: miss does not stall every other request of the daemon.
THREAD_COPY_BYTES = 1 << 20

A = TypeVar("A")
R = TypeVar("R")


class ExpertPool:
    """One hosted pool: planner, executor, its two regions, and rewrites not yet applied.

    Every operation that reads or changes residency runs under ``lock``; writes
    noted by :meth:`note_rewrite` (from outside the lock) are applied first.
    ``view(region_id)`` maps its two regions' bytes (the region store's view).
    """

    def __init__(
        self,
        spec: PoolCreate,
        owner: str,
        host: RegionInfo,
        slots: RegionInfo,
        view: Callable[[int], memoryview],
    ) -> None:
        self.spec, self.owner = spec, owner
        self.host, self.slot_region = host, slots
        residency = residency_of(spec)
        self.cache = ExpertCache(spec.layers, spec.experts, spec.slots)
        self.executor = ExpertSlots(
            SlotGeometry(spec.layers, spec.slots, tuple(spec.row_bytes)), residency
        )
        self.rows = RegionExpertRows(
            view(host.region_id), spec.experts, spec.layers, spec.row_bytes
        )
        self.device = RegionSlotMemory(view(slots.region_id), spec.slots, spec.row_bytes)
        self.lock = asyncio.Lock()
        self.stale = 0
        #: Set once deleted: a request that was waiting for the lock is refused.
        self.deleted = False
        self._rewrites: list[np.ndarray] = []

    @property
    def name(self) -> str:
        return self.spec.name

    # -- rewrites of host rows ------------------------------------------------------

    def note_rewrite(self, ranges: np.ndarray) -> None:
        """Record host-region writes, ``(n, 2)`` rows of ``(byte offset, nbytes)``;
        the experts they touch are invalidated before the pool's next operation."""
        if len(ranges):
            self._rewrites.append(ranges)

    def apply_rewrites(self) -> None:
        """Invalidate the experts every noted host-row write touched (under ``lock``)."""
        while self._rewrites:
            ranges = self._rewrites.pop()
            self._invalidate_keys(self._touched_keys(ranges))

    def _touched_keys(self, ranges: np.ndarray) -> np.ndarray:
        n = self.spec.layers * self.spec.experts
        return touched_rows(ranges, self.rows.bank_offsets, self.spec.row_bytes, n)

    def _invalidate_keys(self, keys: Iterable[int]) -> InvalidateResult:
        e = self.spec.experts
        slots: list[int] = []
        experts: list[ExpertRef] = []
        for key in keys:
            layer, expert = divmod(int(key), e)
            slot = self.cache.slot_of(layer, expert)
            if slot is None:
                continue
            self.cache.forget_slot(slot)
            self.executor.invalidate_slot(slot)
            slots.append(slot)
            experts.append(ExpertRef(layer, expert))
        self.stale += len(slots)
        return InvalidateResult(slots, experts)

    # -- the operations -------------------------------------------------------------

    def invalidate(self, req: InvalidateRequest) -> InvalidateResult:
        """Drop the named experts' slots; refused whole (nothing dropped) if any id is
        outside the pool."""
        L, E = self.spec.layers, self.spec.experts
        for ref in req.experts:
            if ref.layer >= L or ref.expert >= E:
                raise ProtocolError(
                    f"invalidate refused for pool {self.name!r}: expert {ref.expert} of layer "
                    f"{ref.layer} is outside its {L} layers of {E} experts; nothing was dropped"
                )
        bad = [layer for layer in req.layers if layer >= L]
        if bad:
            raise ProtocolError(
                f"invalidate refused for pool {self.name!r}: layers {bad} are outside its "
                f"{L} layers; nothing was dropped"
            )
        self.apply_rewrites()
        keys = [r.layer * E + r.expert for r in req.experts]
        keys += [layer * E + e for layer in req.layers for e in range(E)]
        return self._invalidate_keys(dict.fromkeys(keys))

    def plan(self, req: EnsureRequest) -> tuple[EnsureResult, int]:
        """Plan one step with the cache; returns the result (before copying) and the
        bytes the copy will move."""
        self.apply_rewrites()
        if req.layer >= self.spec.layers:
            raise PlanError(
                f"ensure refused for pool {self.name!r}: layer {req.layer} is outside its "
                f"{self.spec.layers} layers"
            )
        plan = self.cache.ensure(req.layer, req.routed)
        copy = plan.copy
        nbytes = len(copy.dst_slots) * sum(self.spec.row_bytes)
        result = EnsureResult(
            layer=req.layer,
            slots=[s for s in plan.slots if s is not None],
            active=plan.active,
            missing=plan.missing,
            fetched=plan.fetched,
            copied_slots=list(copy.dst_slots),
            copied_experts=list(copy.src_rows),
            copied_bytes=nbytes,
            warm=not copy.dst_slots,
        )
        return result, nbytes

    def execute(self, result: EnsureResult) -> EnsureResult:
        """Apply the planned copies into the slot region, then wait for the slots the
        step uses that a prefetch still has in flight. On a refusal or a device fault
        the slots the cache was promised (or a failed prefetch left unknown) are
        forgotten before re-raising. Blocks while copies are in flight: call it off
        the event loop then (``off_loop``)."""
        copy = CopyPlan(tuple(result.copied_slots), tuple(result.copied_experts))
        plan = EnsurePlan(tuple(result.slots), copy, result.active, result.missing, 0)
        try:
            applied = self.executor.apply_ensure(result.layer, plan, self.rows, self.device)
        except DeviceFlushFault as e:
            self._forget(set(e.slots) | set(copy.dst_slots))
            raise
        except SlotFault:
            self._forget(copy.dst_slots)
            raise
        except CopyFault as e:
            self._forget(copy.dst_slots)
            raise TransportError(
                f"ensure of pool {self.name!r} layer {result.layer} failed: a region of the "
                f"pool faulted under the copy ({e.side}): its segment was shrunk by its "
                "owner; the slots it was writing are forgotten"
            ) from e
        if applied.waited:
            return msgspec.structs.replace(result, waited=applied.waited)
        return result

    async def off_loop(self, nbytes: int, fn: Callable[[A], R], arg: A) -> R:
        """``fn(arg)`` on a worker thread when it may block the event loop: it copies
        more than ``THREAD_COPY_BYTES``, or a prefetch copy is in flight (waiting
        for one blocks). Inline otherwise."""
        if nbytes > THREAD_COPY_BYTES or self.executor.in_flight_slots():
            return await asyncio.to_thread(fn, arg)
        return fn(arg)

    def prefetch(self, req: PrefetchRequest) -> PrefetchResult:
        """Plan a prediction with the cache and issue its copies in the background.
        Refused whole (nothing planned) when the request is malformed; a plan the
        executor refuses forgets the slots the cache had promised, as ``execute``."""
        L, E = self.spec.layers, self.spec.experts
        if req.layer >= L:
            raise PlanError(
                f"prefetch refused for pool {self.name!r}: layer {req.layer} is outside its "
                f"{L} layers"
            )
        if req.experts and req.scores:
            raise ProtocolError(
                f"prefetch refused for pool {self.name!r}: give experts or scores, not both"
            )
        predicted: list[int] | np.ndarray = list(req.experts)
        if req.scores:
            if len(req.scores) != E:
                raise ProtocolError(
                    f"prefetch refused for pool {self.name!r}: {len(req.scores)} scores for "
                    f"{E} experts; one score per expert of the layer"
                )
            predicted = np.asarray(req.scores, dtype=np.float64)
        plan = self.cache.prefetch(req.layer, predicted, req.budget, min_score=req.min_score)
        try:
            issued = self.executor.prefetch_copy_plan(req.layer, plan.copy, self.rows, self.device)
        except SlotFault:
            self._forget(plan.copy.dst_slots)
            raise
        return PrefetchResult(
            layer=req.layer,
            copied_slots=list(plan.copy.dst_slots),
            copied_experts=list(plan.copy.src_rows),
            copied_bytes=issued.bytes,
            resident=plan.resident,
            skipped=plan.skipped,
        )

    def harvest(self) -> None:
        """Forget slots whose prefetch copy failed since the last operation."""
        self._forget(self.executor.poll())

    def _forget(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.cache.forget_slot(slot)
            self.executor.invalidate_slot(slot)

    def close(self) -> None:
        """Let every copy in flight land and stop the copier; blocks."""
        self.executor.invalidate_all()
        self.device.close()

    def info(self) -> PoolInfo:
        s, c = self.spec, self.cache.stats()
        x = self.executor.stats()
        return PoolInfo(
            name=s.name,
            layers=s.layers,
            experts=s.experts,
            slots=s.slots,
            row_bytes=list(s.row_bytes),
            residency=[r.value for r in self.executor.residency.layers],
            cpu_layers=sorted(self.executor.residency.cpu_layers),
            host_region=self.host.region_id,
            slot_region=self.slot_region.region_id,
            host_bank_offsets=list(self.rows.bank_offsets),
            slot_bank_offsets=list(self.device.bank_offsets),
            owner=self.owner,
            occupied_slots=self.cache.occupied(),
            plans=x.plans,
            warm_plans=x.warm_plans,
            hits=c.hits,
            misses=c.misses,
            evictions=c.evictions,
            copied_bytes=x.host_bytes + x.device_bytes,
            stale_invalidations=self.stale,
            prefetched_bytes=x.prefetch_bytes,
            prefetch_used=c.prefetch_used,
            prefetch_wasted=c.prefetch_wasted,
            in_flight_slots=len(self.executor.in_flight_slots()),
        )

    def stats(self) -> PoolStats:
        return PoolStats.from_pool(
            self.name,
            layers=self.spec.layers,
            slots=self.spec.slots,
            occupied_slots=self.cache.occupied(),
            cache=self.cache.stats(),
            executor=self.executor.stats(),
            stale_invalidations=self.stale,
        )


def residency_of(spec: PoolCreate) -> BankResidency:
    """The per-layer host residency ``spec`` asks for (all pinned when it names none)."""
    if not spec.residency:
        if spec.cpu_layers:
            return BankResidency.build(
                [HostResidency.PINNED] * spec.layers, spec.layers, spec.cpu_layers
            )
        return BankResidency.all_pinned(spec.layers)
    return BankResidency.build(
        [HostResidency(r) for r in spec.residency], spec.layers, spec.cpu_layers
    )
