"""Slots in flight: the asynchronous plans the slot executor has issued and not yet
seen land.

A prefetch plan's copies are issued on the device's copy queue and return a
:class:`~refitd.experts.inflight.CopyFence` (``ExpertSlots.prefetch_copy_plan``).
Until the fence completes, every slot of the plan is *in flight*: it holds no known
occupant, and :class:`Flights` remembers which expert its plan brings. Landing a
plan (waiting on its fence) sets each of its slots' occupant, or, when the fence
reports failure, leaves exactly the slots of that plan unknown.

A slot invalidated or rewritten while its copy is in flight is *unnamed*: the copy
still lands, but no longer names an occupant. Any write into a slot with a copy
still pending waits for that copy first (:meth:`Flights.quiesce`), so a late landing
can never overwrite a newer expert.

The occupants themselves are the executor's record (``ExpertSlots``): every method
that lands a plan is handed that list and writes the outcome into it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from refitd.errors import TransportError
from refitd.experts.faults import DeviceFlushFault
from refitd.experts.inflight import CopyFence
from refitd.experts.plans import ExpertId

__all__ = ["Flight", "Flights"]


class Flight:
    """One asynchronous plan: its fence, and per slot the expert it brings (``None``
    once the slot was invalidated or rewritten meanwhile)."""

    __slots__ = ("experts", "fence", "slots")

    def __init__(self, fence: CopyFence, slots: tuple[int, ...], experts: list[ExpertId]) -> None:
        self.fence = fence
        self.slots = slots
        self.experts: list[ExpertId | None] = list(experts)


class Flights:
    """Per slot, the asynchronous plan still bringing an expert into it.

    ``waits`` counts fences a step waited on, ``failed_plans`` plans whose fence
    reported failure (both running totals of the executor's stats); ``failed``
    keeps the slots failed plans left unknown until :meth:`poll` reports them.
    """

    __slots__ = ("_table", "failed", "failed_plans", "waits")

    def __init__(self) -> None:
        self._table: dict[int, Flight] = {}
        self.failed: list[int] = []
        self.waits = 0
        self.failed_plans = 0

    def __bool__(self) -> bool:
        return bool(self._table)

    def expert(self, slot: int) -> ExpertId | None:
        """The expert a copy in flight is bringing into ``slot``, or ``None``."""
        flight = self._table.get(slot)
        if flight is None:
            return None
        return flight.experts[flight.slots.index(slot)]

    def slots(self) -> tuple[int, ...]:
        """Slots with a copy not yet known to have landed, ascending."""
        return tuple(sorted(self._table))

    def issue(self, fence: CopyFence, slots: Sequence[int], experts: list[ExpertId]) -> None:
        """Record one issued plan: ``experts[i]`` lands in ``slots[i]`` once ``fence``
        completes."""
        flight = Flight(fence, tuple(slots), experts)
        for slot in slots:
            self._table[slot] = flight

    def unname(self, slot: int) -> None:
        """The copy in flight into ``slot`` (if any) no longer names an occupant."""
        flight = self._table.get(slot)
        if flight is not None:
            flight.experts[flight.slots.index(slot)] = None

    def wait_for(self, slots: Iterable[int | None], occupant: list[ExpertId | None]) -> int:
        """Block until every copy in flight into ``slots`` has landed (``None``
        entries are skipped); return the fences waited on. A failed plan leaves
        exactly its own slots unknown and raises ``DeviceFlushFault`` naming them,
        after every other named fence completed."""
        flights: list[Flight] = []
        table = self._table
        for slot in slots:
            if slot is not None:
                f = table.get(slot)
                if f is not None and f not in flights:
                    flights.append(f)
        failed: list[int] = []
        detail = ""
        for f in flights:
            self.waits += 1
            error, lost = self.land(f, occupant)
            if error is not None:
                failed += lost
                detail = str(error)
        if failed:
            raise DeviceFlushFault(sorted(failed), f"an asynchronous copy failed: {detail}")
        return len(flights)

    def poll(self, occupant: list[ExpertId | None]) -> tuple[int, ...]:
        """Land, without blocking, every plan whose fence is done; return the slots
        left unknown by failed plans since the last call (ascending)."""
        done = {id(f): f for f in self._table.values() if f.fence.done()}
        for f in done.values():
            _, lost = self.land(f, occupant)
            self.failed += lost
        out, self.failed = tuple(sorted(set(self.failed))), []
        return out

    def land(
        self, flight: Flight, occupant: list[ExpertId | None]
    ) -> tuple[TransportError | None, list[int]]:
        """Wait for one plan's fence and record its outcome on the slots that still
        expect it; return the error and the slots it left unknown."""
        error: TransportError | None = None
        try:
            flight.fence.wait()
        except TransportError as e:
            error = e
            self.failed_plans += 1
        lost: list[int] = []
        table = self._table
        for slot, who in zip(flight.slots, flight.experts):
            if table.get(slot) is flight:
                del table[slot]
                if error is None:
                    occupant[slot] = who
                else:
                    occupant[slot] = None
                    if who is not None:
                        lost.append(slot)
        return error, lost

    def quiesce(self, slots: Sequence[int], occupant: list[ExpertId | None]) -> None:
        """Before rewriting ``slots``, let any copy still pending into them land, so
        it cannot overwrite the new bytes. A failure there costs the failed plan's
        other slots (kept for :meth:`poll`); the rewritten ones are being replaced."""
        table = self._table
        if not table:
            return
        rewritten = set(slots)
        for slot in slots:
            f = table.get(slot)
            if f is not None:
                _, lost = self.land(f, occupant)
                self.failed += [s for s in lost if s not in rewritten]

    def drain(self, occupant: list[ExpertId | None]) -> None:
        """Let every pending copy land; outcomes no longer matter (residency is being
        dropped)."""
        for f in list({id(f): f for f in self._table.values()}.values()):
            self.land(f, occupant)
        self.failed = []
