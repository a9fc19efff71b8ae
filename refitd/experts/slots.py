"""The slot executor: apply the cache's plans to a bounded pool of expert slots.

``ExpertCache`` decides residency and returns plans; ``ExpertSlots`` validates a plan
against the pool geometry it owns, performs exactly the copies it names through a
``SlotDevice``, and counts what crossed the host link.

A plan is applied whole or not at all. The cache has already recorded the residency a
plan describes, so a half-applied plan would leave it naming an expert for a slot that
holds another's bytes — a wrong answer, not an error. Every check therefore runs
before the first byte moves, and a refused plan leaves the device untouched.

Only the device can fail mid-plan. What that costs is marked unknown here and named
in the fault, so the caller can pass the same slots to ``ExpertCache.forget_slot``:
a refused write costs its own slot, a failed flush every slot the plan wrote (a
backend that batches copies cannot say which landed).

Row sizes are checked exactly: a short row would leave the slot's tail holding the
previous occupant, an expert spliced from two that yields plausible tokens.

The pool keeps its own record of each slot's occupant, separate from the cache's
map on purpose: two records can disagree, and that is how a failed copy shows.

Prefetch plans are issued asynchronously (``prefetch_copy_plan``): their slots are
*in flight* until the device's fence completes, hold no known occupant meanwhile, and
a step that uses one waits on its fence (``wait_for``, ``apply_ensure``) instead of
copying it again. A failed asynchronous copy leaves exactly the slots of its plan
unknown. Any write into a slot with a copy still pending waits for that copy first,
so a late landing can never overwrite a newer expert (the bookkeeping of slots in
flight: :mod:`refitd.experts.flights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from refitd.experts.cache import CopyPlan, EnsurePlan, ExpertId, GatherPlan
from refitd.experts.device import (
    Bytes,
    ExpertRows,
    HostExpertRows,
    HostSlotMemory,
    SlotDevice,
    SlotGeometry,
)
from refitd.experts.faults import (
    DegenerateGeometry,
    DeviceFault,
    DeviceFlushFault,
    LayerOutOfRange,
    PlanHalvesDisagree,
    ResidencyRefused,
    RowMissing,
    RowSizeMismatch,
    SlotDeviceError,
    SlotFault,
    SlotOutOfRange,
    SlotWrittenTwice,
    UnknownGatherSource,
)
from refitd.experts.flights import Flights
from refitd.experts.residency import BankResidency, CopyRoute, ResidencyError

__all__ = [
    "Applied",
    "DegenerateGeometry",
    "DeviceFault",
    "DeviceFlushFault",
    "ExpertRows",
    "ExpertSlots",
    "HostExpertRows",
    "HostSlotMemory",
    "LayerOutOfRange",
    "PlanHalvesDisagree",
    "ResidencyRefused",
    "RowMissing",
    "RowSizeMismatch",
    "SlotDevice",
    "SlotDeviceError",
    "SlotFault",
    "SlotGeometry",
    "SlotOutOfRange",
    "SlotStats",
    "SlotWrittenTwice",
    "UnknownGatherSource",
]


@dataclass(frozen=True)
class Applied:
    """What one applied plan moved. ``rows`` are summed over banks; ``warm`` is True
    when the plan asked for nothing; ``waited`` counts in-flight copies the step
    waited for (``apply_ensure``) instead of copying again."""

    rows: int = 0
    bytes: int = 0
    warm: bool = False
    waited: int = 0


@dataclass(frozen=True)
class SlotStats:
    """Running totals. Host traffic crossed the link; device traffic stayed in the pool.
    ``host_*`` include prefetch copies (counted when issued), which ``prefetch_*`` also
    count apart; ``waits`` counts fences a step waited on; ``failed_prefetches`` counts
    asynchronous plans whose fence reported failure."""

    plans: int = 0
    warm_plans: int = 0
    host_rows: int = 0
    host_bytes: int = 0
    device_rows: int = 0
    device_bytes: int = 0
    prefetch_plans: int = 0
    prefetch_rows: int = 0
    prefetch_bytes: int = 0
    waits: int = 0
    failed_prefetches: int = 0

    @property
    def warm_plan_rate(self) -> float:
        """Fraction of plans that moved nothing; 0.0 before any plan."""
        return self.warm_plans / self.plans if self.plans else 0.0

    @property
    def host_bytes_per_plan(self) -> float:
        """Link bytes per applied plan; 0.0 before any plan."""
        return self.host_bytes / self.plans if self.plans else 0.0


# -- the executor -------------------------------------------------------------------


class ExpertSlots:
    """A bounded pool of expert slots and the executor for the plans that fill it.

    Without a ``residency`` every layer is treated as pinned (device-addressable).
    """

    def __init__(self, geometry: SlotGeometry, residency: BankResidency | None = None) -> None:
        if geometry.slots <= 0:
            raise DegenerateGeometry(f"a pool of {geometry.slots} slots could hold no expert")
        if geometry.num_layers <= 0:
            raise DegenerateGeometry(f"a pool for {geometry.num_layers} layers serves nothing")
        if not geometry.row_bytes:
            raise DegenerateGeometry("a pool with no banks would copy nothing")
        zero = [b for b, w in enumerate(geometry.row_bytes) if w <= 0]
        if zero:
            raise DegenerateGeometry(
                f"banks {zero} have zero-width rows: every size check would pass and every "
                "copy would move nothing, so the pool would report warm plans while empty"
            )
        self._geometry = geometry
        self._occupant: list[ExpertId | None] = [None] * geometry.slots
        self._residency = BankResidency.all_pinned(geometry.num_layers)
        self._plans = self._warm = 0
        self._host_rows = self._host_bytes = self._dev_rows = self._dev_bytes = 0
        self._pf_plans = self._pf_rows = self._pf_bytes = 0
        self._flights = Flights()
        if residency is not None:
            self.set_residency(residency)

    def set_residency(self, residency: BankResidency) -> None:
        """Attach the per-layer host residency this pool copies from."""
        if residency.num_layers != self._geometry.num_layers:
            raise DegenerateGeometry(
                f"residency covers {residency.num_layers} layers but the pool has "
                f"{self._geometry.num_layers}"
            )
        self._residency = residency

    @property
    def geometry(self) -> SlotGeometry:
        return self._geometry

    @property
    def residency(self) -> BankResidency:
        return self._residency

    def stats(self) -> SlotStats:
        return SlotStats(
            self._plans,
            self._warm,
            self._host_rows,
            self._host_bytes,
            self._dev_rows,
            self._dev_bytes,
            self._pf_plans,
            self._pf_rows,
            self._pf_bytes,
            self._flights.waits,
            self._flights.failed_plans,
        )

    def reset_stats(self) -> None:
        self._plans = self._warm = 0
        self._host_rows = self._host_bytes = self._dev_rows = self._dev_bytes = 0
        self._pf_plans = self._pf_rows = self._pf_bytes = 0
        self._flights.waits = self._flights.failed_plans = 0

    def occupant(self, slot: int) -> ExpertId | None:
        """The expert the device holds in ``slot`` as far as the pool knows; ``None``
        for an empty slot, one whose last copy failed or is still in flight, and one
        out of range."""
        return self._occupant[slot] if 0 <= slot < len(self._occupant) else None

    def in_flight(self, slot: int) -> ExpertId | None:
        """The expert an asynchronous copy is bringing into ``slot``, or ``None``."""
        return self._flights.expert(slot)

    def in_flight_slots(self) -> tuple[int, ...]:
        """Slots with an asynchronous copy not yet known to have landed, ascending."""
        return self._flights.slots()

    def occupied(self) -> int:
        return sum(o is not None for o in self._occupant)

    def invalidate_slot(self, slot: int) -> None:
        """Mark ``slot`` as holding nothing known. Idempotent; unknown slots ignored.
        A copy in flight into it still completes, but no longer names an occupant."""
        if 0 <= slot < len(self._occupant):
            self._occupant[slot] = None
            self._flights.unname(slot)

    def invalidate_all(self) -> None:
        self._flights.drain(self._occupant)
        self._occupant = [None] * self._geometry.slots

    def resize(self, slots: int) -> None:
        """Resize the pool, dropping all residency; counters survive (the traffic they
        count happened). Resize the cache with ``rebuild`` to the same size."""
        if slots <= 0:
            raise DegenerateGeometry(f"a pool of {slots} slots could hold no expert")
        g = self._geometry
        self._flights.drain(self._occupant)
        self._geometry = SlotGeometry(g.num_layers, slots, g.row_bytes)
        self._occupant = [None] * slots

    def apply_copy_plan(
        self, layer: int, plan: CopyPlan, rows: ExpertRows, device: SlotDevice
    ) -> Applied:
        """Apply an ``ensure`` plan: per-slot copies, so the layer must be pinned."""
        return self._apply(layer, plan, False, rows, device)

    def apply_materialize(
        self, layer: int, plan: CopyPlan, rows: ExpertRows, device: SlotDevice
    ) -> Applied:
        """Apply a ``materialize_layer`` plan: the whole layer, any residency."""
        return self._apply(layer, plan, True, rows, device)

    def apply_ensure(
        self, layer: int, plan: EnsurePlan, rows: ExpertRows, device: SlotDevice
    ) -> Applied:
        """Apply an ``ensure`` answer: copy its misses, then wait for every slot it
        uses that a prefetch still has in flight (never copying those again). A warm
        step whose prefetches have landed moves nothing and waits on nothing."""
        applied = self.apply_copy_plan(layer, plan.copy, rows, device)
        waited = self.wait_for(plan.slots) if self._flights else 0
        if waited:
            return Applied(applied.rows, applied.bytes, applied.warm, waited)
        return applied

    def prefetch_copy_plan(
        self, layer: int, plan: CopyPlan, rows: ExpertRows, device: SlotDevice
    ) -> Applied:
        """Issue a ``prefetch`` plan asynchronously; its slots are in flight until the
        device's fence completes.

        Validated whole before anything is issued, exactly as ``apply_copy_plan``
        (so the layer must be pinned). A copy still pending into one of its slots is
        waited for first. If the device refuses to issue the copies, every slot of
        the plan is unknown (``DeviceFlushFault``); if they fail later, the same holds
        and is reported by ``wait_for`` or ``poll``.
        """
        route, data = self._validate(layer, plan, False, rows)
        self._pf_plans += 1
        dst, src = plan.dst_slots, plan.src_rows
        if not dst:
            return Applied(0, 0, True)
        self._begin(dst, route, device)
        writes = [(b, slot, buf) for slot, banks in zip(dst, data) for b, buf in enumerate(banks)]
        for slot in dst:
            self._occupant[slot] = None
        try:
            fence = device.write_slots_async(writes)
        except SlotDeviceError as e:
            self._forget(dst)
            raise DeviceFlushFault(dst, f"device refused to issue the copies: {e}") from e
        self._flights.issue(fence, dst, [ExpertId(layer, r) for r in src])
        n_bytes = sum(_nbytes(buf) for _, _, buf in writes)
        self._host_rows += len(writes)
        self._host_bytes += n_bytes
        self._pf_rows += len(writes)
        self._pf_bytes += n_bytes
        return Applied(len(writes), n_bytes, False)

    def wait_for(self, slots: Iterable[int | None]) -> int:
        """Block until every in-flight copy into ``slots`` has landed (``None``
        entries, hybrid mode's CPU experts, are skipped); return the fences waited on.

        A failed asynchronous plan leaves exactly its own slots unknown and raises
        ``DeviceFlushFault`` naming them, after every other named fence completed:
        forget those slots in the cache.
        """
        return self._flights.wait_for(slots, self._occupant)

    def poll(self) -> tuple[int, ...]:
        """Complete, without blocking, every asynchronous plan whose fence is done.
        Returns the slots left unknown by failed plans since the last call
        (ascending): forget them in the cache."""
        return self._flights.poll(self._occupant)

    def _validate(
        self, layer: int, plan: CopyPlan, whole_layer: bool, rows: ExpertRows
    ) -> tuple[CopyRoute, list[list[Bytes]]]:
        dst, src = plan.dst_slots, plan.src_rows
        if len(dst) != len(src):
            raise PlanHalvesDisagree(len(dst), len(src))
        g = self._geometry
        if not 0 <= layer < g.num_layers:
            raise LayerOutOfRange(layer, g.num_layers)
        # Resolved even for an empty plan: a step that hit every expert is no
        # evidence that the layer's residency allows the route.
        try:
            route = self._residency.copy_route(layer, whole_layer)
        except ResidencyError as e:
            raise ResidencyRefused(e) from e
        self._check_slots(dst)
        return route, self._collect_rows(layer, src, rows)

    def _apply(
        self,
        layer: int,
        plan: CopyPlan,
        whole_layer: bool,
        rows: ExpertRows,
        device: SlotDevice,
    ) -> Applied:
        route, data = self._validate(layer, plan, whole_layer, rows)
        dst, src = plan.dst_slots, plan.src_rows
        self._plans += 1
        if not dst:
            self._warm += 1
            return Applied(0, 0, True)
        self._begin(dst, route, device)
        n_rows = n_bytes = 0
        for i, slot in enumerate(dst):
            # Cleared before the write, so a fault in any bank leaves the slot
            # unknown rather than labelled with a half-copied expert.
            self._occupant[slot] = None
            for bank, buf in enumerate(data[i]):
                try:
                    device.write_slot(bank, slot, buf)
                except SlotDeviceError as e:
                    self._forget(dst)
                    raise DeviceFault(bank, slot, str(e), dst) from e
                n_rows += 1
                n_bytes += len(buf)
        self._flush(device, dst)
        # Occupants are set only once every bank of every slot has landed.
        for slot, row in zip(dst, src):
            self._occupant[slot] = ExpertId(layer, row)
        self._host_rows += n_rows
        self._host_bytes += n_bytes
        return Applied(n_rows, n_bytes, False)

    def apply_gather_plan(self, plan: GatherPlan, device: SlotDevice) -> Applied:
        """Copy slots onto slots inside the pool (a prefill gather). Counted as device
        traffic, never as host-link traffic. A source with no known occupant is
        refused: gathering it would launder a failed copy into a second slot."""
        dst, src = plan.dst_slots, plan.src_slots
        if len(dst) != len(src):
            raise PlanHalvesDisagree(len(dst), len(src))
        self._check_slots(dst)
        n = self._geometry.slots
        for s in src:
            if not 0 <= s < n:
                raise SlotOutOfRange(s, n)
        if self._flights:
            self.wait_for(src)  # a source still in flight is gathered once it lands
            self._flights.quiesce(dst, self._occupant)
        for s in src:
            if self._occupant[s] is None:
                raise UnknownGatherSource(s)
        self._plans += 1
        if not dst:
            self._warm += 1
            return Applied(0, 0, True)
        carried = [self._occupant[s] for s in src]
        n_rows = n_bytes = 0
        for slot, source in zip(dst, src):
            self._occupant[slot] = None
            for bank, width in enumerate(self._geometry.row_bytes):
                try:
                    device.copy_slot(bank, slot, source)
                except SlotDeviceError as e:
                    self._forget(dst)
                    raise DeviceFault(bank, slot, str(e), dst) from e
                n_rows += 1
                n_bytes += width
        self._flush(device, dst)
        for slot, who in zip(dst, carried):
            self._occupant[slot] = who
        self._dev_rows += n_rows
        self._dev_bytes += n_bytes
        return Applied(n_rows, n_bytes, False)

    def _begin(self, dst: Sequence[int], route: CopyRoute, device: SlotDevice) -> None:
        """Before a non-empty plan writes ``dst``: let copies still pending into them
        land, then tell the device how the plan's copies must be carried out."""
        self._flights.quiesce(dst, self._occupant)
        try:
            device.begin_plan(route)
        except SlotDeviceError as e:
            # Nothing was written, but the cache already records these slots as
            # filled: all of them must be forgotten, exactly as after a failed flush.
            self._forget(dst)
            raise DeviceFlushFault(dst, f"device refused a {route.value} plan: {e}") from e

    def _flush(self, device: SlotDevice, written: Sequence[int]) -> None:
        try:
            device.flush()
        except SlotDeviceError as e:
            self._forget(written)
            raise DeviceFlushFault(written, str(e)) from e

    def _forget(self, slots: Sequence[int]) -> None:
        # A slot whose async copy is being given up: its flight no longer names it.
        for s in slots:
            self._flights.unname(s)
        for s in slots:
            self._occupant[s] = None

    def _check_slots(self, slots: Sequence[int]) -> None:
        n = self._geometry.slots
        seen: set[int] = set()
        for s in slots:
            if not 0 <= s < n:
                raise SlotOutOfRange(s, n)
            if s in seen:
                raise SlotWrittenTwice(s)
            seen.add(s)

    def _collect_rows(self, layer: int, src: Sequence[int], rows: ExpertRows) -> list[list[Bytes]]:
        """Every row of every bank, size-checked, before anything is written."""
        widths = self._geometry.row_bytes
        out: list[list[Bytes]] = []
        for row in src:
            banks: list[Bytes] = []
            for bank, expected in enumerate(widths):
                buf = rows.row(bank, layer, row)
                if buf is None:
                    raise RowMissing(bank, layer, row)
                got = _nbytes(buf)
                if got != expected:
                    raise RowSizeMismatch(bank, layer, row, expected, got)
                banks.append(buf)
            out.append(banks)
        return out


def _nbytes(buf: Bytes) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)
