"""In-flight slots: prefetch plans copied in the background, fences, and what a step
does with a slot whose copy has not landed yet."""

from __future__ import annotations

import threading

import pytest
from test_experts_slots import EXPERT_BYTES, WIDTHS, FailingWrites, geometry, named_rows, signature

from refitd.experts import (
    CopyPlan,
    DeviceFlushFault,
    ExpertCache,
    ExpertId,
    ExpertSlots,
    HostSlotMemory,
    SlotDeviceError,
    SlotGeometry,
)
from refitd.experts.residency import CopyRoute
from refitd.experts.traces import generate_trace, preset_config


class GatedMemory(HostSlotMemory):
    """Host slot memory whose copier holds every write until ``gate`` opens: the
    moment between issue and landing, which a memcpy is too fast to show."""

    def __init__(self, g: SlotGeometry) -> None:
        super().__init__(g)
        self.gate = threading.Event()
        self.issued = threading.Event()

    def write_slot(self, bank: int, dst_slot: int, src: bytes | bytearray | memoryview) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.issued.set()
            assert self.gate.wait(10.0), "the test never opened the gate"
        super().write_slot(bank, dst_slot, src)


class FailingSlots(HostSlotMemory):
    """Host slot memory whose copy engine refuses writes into some slots."""

    def __init__(self, g: SlotGeometry, bad: set[int]) -> None:
        super().__init__(g)
        self.bad = bad

    def write_slot(self, bank: int, dst_slot: int, src: bytes | bytearray | memoryview) -> None:
        if dst_slot in self.bad:
            raise SlotDeviceError("copy engine error on the stream")
        super().write_slot(bank, dst_slot, src)


def holds(device: HostSlotMemory, slot: int, layer: int, expert: int) -> bool:
    return all(
        device.slot(bank, slot) == signature(bank, layer, expert, width)
        for bank, width in enumerate(WIDTHS)
    )


def test_a_prefetch_lands_in_the_background_and_names_its_occupants_once_waited() -> None:
    cache = ExpertCache(3, 8, 16)
    slots = ExpertSlots(geometry(16))
    rows = named_rows()
    device = HostSlotMemory(slots.geometry)
    plan = cache.prefetch(1, [4, 2])
    issued = slots.prefetch_copy_plan(1, plan.copy, rows, device)
    assert (issued.rows, issued.bytes) == (6, 2 * EXPERT_BYTES)
    assert slots.in_flight_slots() == (0, 1)
    assert slots.in_flight(0) == ExpertId(1, 4)
    assert slots.occupant(0) is None  # not known to have landed
    assert slots.wait_for([0, 1, None]) == 1
    assert slots.in_flight_slots() == ()
    assert slots.occupant(0) == ExpertId(1, 4) and slots.occupant(1) == ExpertId(1, 2)
    assert holds(device, 0, 1, 4) and holds(device, 1, 1, 2)
    st = slots.stats()
    assert (st.prefetch_plans, st.prefetch_bytes) == (1, 2 * EXPERT_BYTES)
    assert st.host_bytes == 2 * EXPERT_BYTES  # prefetch copies cross the link too
    device.close()


def test_a_step_on_an_in_flight_expert_waits_on_its_fence_instead_of_copying_again() -> None:
    cache = ExpertCache(3, 8, 16)
    slots = ExpertSlots(geometry(16))
    rows = named_rows()
    device = GatedMemory(slots.geometry)
    slots.prefetch_copy_plan(2, cache.prefetch(2, [5]).copy, rows, device)
    assert device.issued.wait(10.0)
    step = cache.ensure(2, [5, 1])
    assert step.copy == CopyPlan((1,), (1,))  # only the expert nobody predicted
    before = slots.stats().host_rows
    opener = threading.Timer(0.05, device.gate.set)
    opener.start()
    applied = slots.apply_ensure(2, step, rows, device)
    opener.join()
    assert applied.waited == 1
    assert slots.stats().host_rows == before + 3  # expert 1's three rows, no second copy of 5
    assert slots.stats().waits == 1
    assert slots.occupant(0) == ExpertId(2, 5) and holds(device, 0, 2, 5)
    assert slots.occupant(1) == ExpertId(2, 1) and holds(device, 1, 2, 1)
    device.close()


def test_a_device_that_refuses_a_prefetchs_route_fails_it_before_any_copy_is_issued() -> None:
    class RefusingRoutes(HostSlotMemory):
        def begin_plan(self, route: CopyRoute) -> None:
            raise SlotDeviceError("no copy stream is free")

    cache = ExpertCache(3, 8, 16)
    slots = ExpertSlots(geometry(16))
    device = RefusingRoutes(slots.geometry)
    plan = cache.prefetch(1, [4, 2])
    with pytest.raises(DeviceFlushFault) as info:
        slots.prefetch_copy_plan(1, plan.copy, named_rows(), device)
    assert info.value.slots == (0, 1)
    assert "device refused a indexed plan: no copy stream is free" in str(info.value)
    assert slots.in_flight_slots() == () and slots.occupied() == 0
    assert device.slot(0, 0) == bytes(WIDTHS[0]) and device.slot(0, 1) == bytes(WIDTHS[0])
    assert slots.stats().prefetch_rows == 0
    device.close()


def test_a_failed_async_copy_leaves_exactly_its_slots_unknown() -> None:
    cache = ExpertCache(3, 8, 16)
    slots = ExpertSlots(geometry(16))
    rows = named_rows()
    device = FailingSlots(slots.geometry, bad={3})
    good = cache.prefetch(1, [0, 1])  # slots 0, 1
    bad = cache.prefetch(2, [0, 1])  # slots 2, 3: slot 3's write fails
    slots.prefetch_copy_plan(1, good.copy, rows, device)
    slots.prefetch_copy_plan(2, bad.copy, rows, device)
    with pytest.raises(DeviceFlushFault) as info:
        slots.wait_for(range(16))
    assert info.value.slots == (2, 3)  # slot 2 landed, but the fence cannot say so
    assert "copy engine error on the stream" in str(info.value)
    assert slots.occupant(0) == ExpertId(1, 0) and slots.occupant(1) == ExpertId(1, 1)
    assert slots.occupant(2) is None and slots.occupant(3) is None
    assert slots.stats().failed_prefetches == 1
    # Recovery: forget exactly those slots; the next step fetches them again.
    for s in info.value.slots:
        cache.forget_slot(s)
    device.bad.clear()
    step = cache.ensure(2, [0, 1])
    assert sorted(step.copy.dst_slots) == [2, 3]
    slots.apply_ensure(2, step, rows, device)
    assert holds(device, 2, 2, 0) and holds(device, 3, 2, 1)
    device.close()


def test_poll_completes_landed_copies_and_reports_failed_slots_without_blocking() -> None:
    slots = ExpertSlots(geometry(8))
    rows = named_rows()
    device = FailingSlots(slots.geometry, bad={5})
    slots.prefetch_copy_plan(0, CopyPlan((4, 5), (1, 2)), rows, device)
    slots.prefetch_copy_plan(0, CopyPlan((6,), (3,)), rows, device)
    device.close()  # every issued copy has run
    assert slots.poll() == (4, 5)
    assert slots.poll() == ()
    assert slots.in_flight_slots() == ()
    assert slots.occupant(6) == ExpertId(0, 3)


def test_a_write_into_a_slot_with_a_copy_pending_waits_for_that_copy_first() -> None:
    # The prefetched expert went unused and its slot was taken again before the copy
    # landed: the late copy must not overwrite the newer expert.
    slots = ExpertSlots(geometry(8))
    rows = named_rows()
    device = GatedMemory(slots.geometry)
    slots.prefetch_copy_plan(0, CopyPlan((3,), (7,)), rows, device)
    assert device.issued.wait(10.0)
    opener = threading.Timer(0.05, device.gate.set)
    opener.start()
    slots.apply_copy_plan(1, CopyPlan((3,), (2,)), rows, device)
    opener.join()
    assert slots.occupant(3) == ExpertId(1, 2) and holds(device, 3, 1, 2)
    assert slots.in_flight_slots() == ()
    device.close()


def test_an_invalidated_in_flight_slot_stays_unknown_after_its_copy_lands() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    slots.prefetch_copy_plan(0, CopyPlan((2, 3), (1, 2)), named_rows(), device)
    slots.invalidate_slot(2)
    assert slots.in_flight(2) is None
    slots.wait_for([2, 3])
    assert slots.occupant(2) is None and slots.occupant(3) == ExpertId(0, 2)
    device.close()


def test_a_synchronous_device_completes_async_copies_before_returning_the_fence() -> None:
    slots = ExpertSlots(geometry(8))
    slots.prefetch_copy_plan(0, CopyPlan((1,), (1,)), named_rows(), FailingWrites(bank=1))
    with pytest.raises(DeviceFlushFault) as info:
        slots.wait_for([1])
    assert info.value.slots == (1,)
    assert "out of device memory" in str(info.value)


def test_a_refused_prefetch_plan_issues_nothing() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    with pytest.raises(Exception, match="writes slot 1 twice"):
        slots.prefetch_copy_plan(0, CopyPlan((1, 1), (1, 2)), named_rows(), device)
    assert slots.in_flight_slots() == () and slots.stats().prefetch_bytes == 0


@pytest.mark.parametrize("recall_every", [1, 3])
def test_decode_with_prefetch_one_layer_ahead_keeps_every_used_slot_exact(
    recall_every: int,
) -> None:
    # A generated trace replayed with the next layer's routing predicted one layer
    # ahead (every expert, or a third of them replaced by a wrong guess) through the
    # cache, the executor and the copier thread; after each step every slot the step
    # uses holds exactly the expert the cache named, and a step never copies an
    # expert a prefetch had in flight.
    trace = generate_trace(
        preset_config("mixtral-8x7b", requests=1, decode_tokens=24, prefill_tokens=4)
    )
    shape = trace.shape
    layers, experts = shape.num_layers, shape.num_experts
    size = shape.active
    cache = ExpertCache(layers, experts, size)
    slots = ExpertSlots(SlotGeometry(layers, size, WIDTHS))
    rows = named_rows(layers, experts)
    device = HostSlotMemory(slots.geometry)
    steps = trace.steps()
    for i, (layer, routed) in enumerate(steps):
        step = cache.ensure(layer, routed)
        in_flight = {slots.in_flight(s) for s in slots.in_flight_slots()}
        for e in step.copy.src_rows:
            assert ExpertId(layer, e) not in in_flight, "an in-flight expert was copied again"
        slots.apply_ensure(layer, step, rows, device)
        for e, s in zip(routed, step.slots):
            assert s is not None and slots.occupant(s) == ExpertId(layer, e)
            assert holds(device, s, layer, e)
        if i + 1 < len(steps):
            nxt_layer, nxt = steps[i + 1]
            guess = [
                (e + 1) % experts if j % recall_every == recall_every - 1 else e
                for j, e in enumerate(nxt)
            ]
            plan = cache.prefetch(nxt_layer, guess)
            slots.prefetch_copy_plan(nxt_layer, plan.copy, rows, device)
        for s in slots.poll():
            cache.forget_slot(s)
    assert cache.stats().prefetch_used > 0
    device.close()
