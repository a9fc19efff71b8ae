"""The slot executor: one test per behaviour of the ferrox seed, plus our additions."""

from __future__ import annotations

import pytest

from refitd.errors import ConfigError, PlanError, TransportError
from refitd.experts import (
    BankResidency,
    CopyPlan,
    CopyRoute,
    DegenerateGeometry,
    DeviceFault,
    DeviceFlushFault,
    ExpertCache,
    ExpertId,
    ExpertSlots,
    GatherPlan,
    HostExpertRows,
    HostResidency,
    HostSlotMemory,
    LayerOutOfRange,
    PlanHalvesDisagree,
    ResidencyRefused,
    RowMissing,
    RowSizeMismatch,
    SlotDevice,
    SlotDeviceError,
    SlotFault,
    SlotGeometry,
    SlotOutOfRange,
    SlotRemapOnUnpinnedLayer,
    SlotWrittenTwice,
    UnknownGatherSource,
)

LAYERS = 3
EXPERTS = 8
WIDTHS = (6, 6, 4)  # gate, up, down: banks differ in width on purpose
EXPERT_BYTES = sum(WIDTHS)


def geometry(slots: int, layers: int = LAYERS) -> SlotGeometry:
    return SlotGeometry(num_layers=layers, slots=slots, row_bytes=WIDTHS)


def signature(bank: int, layer: int, row: int, width: int) -> bytes:
    """Bytes that say which expert row they are, so a slot can be checked for *who*."""
    return bytes(((bank * 59 + layer * 17 + row * 5 + i * 3) % 251) for i in range(width))


def named_rows(layers: int = LAYERS, experts: int = EXPERTS) -> HostExpertRows:
    rows = HostExpertRows(layers, experts, WIDTHS)
    for bank, width in enumerate(WIDTHS):
        for layer in range(layers):
            buf = rows.buffer(bank, layer)
            for row in range(experts):
                buf[row * width : (row + 1) * width] = signature(bank, layer, row, width)
    return rows


class FailingWrites(SlotDevice):
    """A device whose copy engine refuses writes into one bank (a fault no host
    memcpy produces)."""

    def __init__(self, bank: int) -> None:
        self.bank = bank

    def write_slot(self, bank: int, dst_slot: int, src: bytes | bytearray | memoryview) -> None:
        if bank == self.bank:
            raise SlotDeviceError("out of device memory")

    def copy_slot(self, bank: int, dst_slot: int, src_slot: int) -> None:
        pass


class FailingFlush(HostSlotMemory):
    """Host memory whose deferred-completion step reports failure."""

    def flush(self) -> None:
        raise SlotDeviceError("copy engine reported an error")


class ShortLastBank:
    """Host rows whose last bank is one byte short."""

    def row(self, bank: int, layer: int, row: int) -> bytes | None:
        width = WIDTHS[bank] - (1 if bank == len(WIDTHS) - 1 else 0)
        return bytes(width)


# -- the seed's behaviours ---------------------------------------------------------


def test_a_warm_step_copies_nothing_and_the_counters_show_it() -> None:
    cache = ExpertCache(LAYERS, EXPERTS, 32)
    slots = ExpertSlots(geometry(32))
    rows = named_rows()
    device = HostSlotMemory(slots.geometry)
    routed = [1, 4, 6]
    first = slots.apply_copy_plan(0, cache.ensure(0, routed).copy, rows, device)
    assert not first.warm
    assert first.rows == 3 * 3
    assert first.bytes == 3 * EXPERT_BYTES
    before = slots.stats()
    for _ in range(10):
        plan = cache.ensure(0, routed)
        assert plan.copy.is_empty()
        applied = slots.apply_copy_plan(0, plan.copy, rows, device)
        assert applied.warm and applied.bytes == 0
    after = slots.stats()
    assert after.host_bytes == before.host_bytes
    assert after.warm_plans == before.warm_plans + 10
    assert after.warm_plan_rate == pytest.approx(10 / 11)


def test_each_slot_holds_the_bytes_of_the_expert_the_plan_named() -> None:
    cache = ExpertCache(LAYERS, EXPERTS, 16)
    slots = ExpertSlots(geometry(16))
    rows = named_rows()
    device = HostSlotMemory(slots.geometry)
    for layer in range(LAYERS):
        routed = [(e + layer) % EXPERTS for e in range(4)]
        plan = cache.ensure(layer, routed)
        slots.apply_copy_plan(layer, plan.copy, rows, device)
        for expert, slot in zip(routed, plan.slots):
            assert slot is not None
            assert slots.occupant(slot) == ExpertId(layer, expert)
            for bank, width in enumerate(WIDTHS):
                assert device.slot(bank, slot) == signature(bank, layer, expert, width)
    assert slots.occupied() == 12


def test_an_eviction_rewrites_the_slot_bytes_not_just_its_label() -> None:
    cache = ExpertCache(2, 2, 2)
    slots = ExpertSlots(SlotGeometry(2, 2, WIDTHS))
    rows = named_rows(layers=2, experts=2)
    device = HostSlotMemory(slots.geometry)
    slots.apply_copy_plan(0, cache.ensure(0, [0, 1]).copy, rows, device)
    second = cache.ensure(1, [0, 1])
    assert second.missing == 2
    slots.apply_copy_plan(1, second.copy, rows, device)
    for expert, slot in zip([0, 1], second.slots):
        assert slot is not None
        assert slots.occupant(slot) == ExpertId(1, expert)
        assert device.slot(0, slot) == signature(0, 1, expert, WIDTHS[0])
    assert cache.slot_of(0, 0) is None


def test_a_plan_whose_halves_differ_in_length_is_refused_before_any_write() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    with pytest.raises(PlanHalvesDisagree) as info:
        slots.apply_copy_plan(0, CopyPlan((0, 1, 2), (0, 1)), named_rows(), device)
    assert (info.value.dst_slots, info.value.src_rows) == (3, 2)
    assert "into each other's slots" in str(info.value)
    assert slots.occupied() == 0
    assert slots.stats().plans == 0


def test_a_plan_writing_one_slot_twice_is_refused() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    with pytest.raises(SlotWrittenTwice) as info:
        slots.apply_copy_plan(0, CopyPlan((3, 1, 3), (0, 1, 2)), named_rows(), device)
    assert info.value.slot == 3
    assert slots.occupied() == 0


def test_a_slot_beyond_the_pool_is_refused_rather_than_clamped() -> None:
    slots = ExpertSlots(geometry(4))
    device = HostSlotMemory(slots.geometry)
    with pytest.raises(SlotOutOfRange) as info:
        slots.apply_copy_plan(0, CopyPlan((0, 9), (0, 1)), named_rows(), device)
    assert (info.value.slot, info.value.slots) == (9, 4)
    assert "different cache sizes" in str(info.value)
    assert slots.occupied() == 0


def test_a_row_one_byte_short_is_refused_with_its_bank_and_sizes() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    with pytest.raises(RowSizeMismatch) as info:
        slots.apply_copy_plan(0, CopyPlan((0,), (5,)), ShortLastBank(), device)
    e = info.value
    assert (e.bank, e.layer, e.row, e.expected, e.got) == (2, 0, 5, WIDTHS[2], WIDTHS[2] - 1)
    assert "previous occupant" in str(e)
    assert slots.occupied() == 0
    assert device.slot(0, 0) == bytes(WIDTHS[0])


def test_a_missing_host_row_is_refused_naming_the_bank_that_lacks_it() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    with pytest.raises(RowMissing) as info:
        slots.apply_copy_plan(0, CopyPlan((0,), (EXPERTS,)), named_rows(), device)
    assert (info.value.bank, info.value.layer, info.value.row) == (0, 0, EXPERTS)


def test_an_unpinned_layer_refuses_a_slot_remap_but_accepts_a_whole_layer_load() -> None:
    residency = BankResidency.build(
        [HostResidency.PINNED, HostResidency.PAGEABLE, HostResidency.PINNED],
        LAYERS,
        cpu_layers={1},
    )
    slots = ExpertSlots(geometry(EXPERTS * LAYERS), residency)
    rows = named_rows()

    class RouteRecorder(HostSlotMemory):
        def __init__(self, geometry: SlotGeometry) -> None:
            super().__init__(geometry)
            self.routes: list[CopyRoute] = []

        def begin_plan(self, route: CopyRoute) -> None:
            self.routes.append(route)

    device = RouteRecorder(slots.geometry)
    remap = CopyPlan((0,), (3,))
    with pytest.raises(ResidencyRefused) as info:
        slots.apply_copy_plan(1, remap, rows, device)
    assert isinstance(info.value.error, SlotRemapOnUnpinnedLayer)
    assert info.value.error.layer == 1

    whole = CopyPlan(tuple(range(EXPERTS)), tuple(range(EXPERTS)))
    applied = slots.apply_materialize(1, whole, rows, device)
    assert applied.rows == EXPERTS * 3
    assert device.routes == [CopyRoute.WHOLE_LAYER_PAGEABLE]
    slots.apply_copy_plan(0, remap, rows, device)
    assert device.routes[-1] is CopyRoute.INDEXED


def test_an_empty_plan_for_an_unpinned_layer_is_still_refused() -> None:
    residency = BankResidency.build(
        [HostResidency.PINNED, HostResidency.LOCKED, HostResidency.PINNED], LAYERS, {1}
    )
    slots = ExpertSlots(geometry(8), residency)
    with pytest.raises(ResidencyRefused):
        slots.apply_copy_plan(1, CopyPlan(), named_rows(), HostSlotMemory(slots.geometry))
    assert slots.stats().plans == 0


def test_a_refused_device_write_leaves_its_slot_unknown_and_names_it() -> None:
    slots = ExpertSlots(geometry(8))
    rows = named_rows()
    host = HostSlotMemory(slots.geometry)
    slots.apply_copy_plan(0, CopyPlan((5,), (1,)), rows, host)
    assert slots.occupant(5) == ExpertId(0, 1)
    with pytest.raises(DeviceFault) as info:
        slots.apply_copy_plan(0, CopyPlan((5, 6), (2, 3)), rows, FailingWrites(bank=2))
    e = info.value
    assert (e.bank, e.slot, e.detail) == (2, 5, "out of device memory")
    assert e.suspect == (5, 6)
    assert isinstance(e, TransportError) and isinstance(e, SlotFault)
    assert slots.occupant(5) is None
    assert slots.occupant(6) is None


def test_a_failed_flush_forgets_every_slot_the_plan_wrote() -> None:
    slots = ExpertSlots(geometry(8))
    device = FailingFlush(slots.geometry)
    with pytest.raises(DeviceFlushFault) as info:
        slots.apply_copy_plan(0, CopyPlan((1, 4, 6), (0, 2, 3)), named_rows(), device)
    assert info.value.slots == (1, 4, 6)
    assert info.value.detail == "copy engine reported an error"
    assert "[1, 4, 6]" in str(info.value)
    assert slots.occupied() == 0
    assert slots.stats().host_bytes == 0


def test_a_gather_is_billed_to_the_device_and_not_to_the_host_link() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    slots.apply_copy_plan(0, CopyPlan((4,), (6,)), named_rows(), device)
    applied = slots.apply_gather_plan(GatherPlan((1,), (4,)), device)
    assert applied.rows == 3
    assert applied.bytes == EXPERT_BYTES
    stats = slots.stats()
    assert stats.device_bytes == EXPERT_BYTES
    assert stats.host_bytes == EXPERT_BYTES
    assert slots.occupant(1) == ExpertId(0, 6)
    assert device.slot(1, 1) == signature(1, 0, 6, WIDTHS[1])


def test_a_gather_from_a_slot_with_no_known_expert_is_refused() -> None:
    slots = ExpertSlots(geometry(8))
    with pytest.raises(UnknownGatherSource) as info:
        slots.apply_gather_plan(GatherPlan((0,), (7,)), HostSlotMemory(slots.geometry))
    assert info.value.slot == 7
    assert slots.stats().plans == 0


def test_a_resize_drops_residency_but_keeps_the_counters() -> None:
    slots = ExpertSlots(geometry(8))
    device = HostSlotMemory(slots.geometry)
    slots.apply_copy_plan(0, CopyPlan((0, 1), (0, 1)), named_rows(), device)
    before = slots.stats()
    assert slots.occupied() == 2
    slots.resize(64)
    assert slots.occupied() == 0
    assert slots.geometry.slots == 64
    assert slots.stats() == before
    with pytest.raises(DegenerateGeometry):
        slots.resize(0)


@pytest.mark.parametrize(
    "bad",
    [
        SlotGeometry(LAYERS, 0, WIDTHS),
        SlotGeometry(0, 4, WIDTHS),
        SlotGeometry(1, 4, (6, 0)),
        SlotGeometry(1, 4, ()),
    ],
)
def test_a_geometry_no_plan_could_be_valid_against_is_refused_at_construction(
    bad: SlotGeometry,
) -> None:
    with pytest.raises(DegenerateGeometry) as info:
        ExpertSlots(bad)
    assert isinstance(info.value, ConfigError)


def test_the_geometry_reports_the_device_bytes_the_pool_needs() -> None:
    g = geometry(1024)
    assert g.bytes == 1024 * EXPERT_BYTES
    assert g.banks == 3


def test_a_forgotten_slot_is_refetched_into_the_same_slot_by_the_next_step() -> None:
    cache = ExpertCache(1, EXPERTS, 8)
    slots = ExpertSlots(SlotGeometry(1, 8, WIDTHS))
    rows = named_rows(layers=1)
    device = HostSlotMemory(slots.geometry)
    plan = cache.ensure(0, [2])
    slots.apply_copy_plan(0, plan.copy, rows, device)
    slot = plan.slots[0]
    assert slot is not None
    assert cache.forget_slot(slot) == ExpertId(0, 2)
    slots.invalidate_slot(slot)
    again = cache.ensure(0, [2])
    assert again.missing == 1
    assert not again.copy.is_empty()
    slots.apply_copy_plan(0, again.copy, rows, device)
    assert again.slots[0] == slot
    assert slots.occupant(slot) == ExpertId(0, 2)
    empty = next(s for s in range(8) if cache.resident_in(s) is None)
    assert cache.forget_slot(empty) is None
    assert cache.forget_slot(9_999) is None


# -- beyond the seed ------------------------------------------------------------------


def test_a_layer_the_pool_was_not_built_for_is_refused() -> None:
    slots = ExpertSlots(geometry(8))
    with pytest.raises(LayerOutOfRange) as info:
        slots.apply_copy_plan(
            LAYERS, CopyPlan((0,), (0,)), named_rows(), HostSlotMemory(slots.geometry)
        )
    assert (info.value.layer, info.value.num_layers) == (LAYERS, LAYERS)


def test_every_slot_fault_is_a_plan_error_so_callers_can_catch_one_branch() -> None:
    for cls in (PlanHalvesDisagree, SlotWrittenTwice, SlotOutOfRange, DeviceFault):
        assert issubclass(cls, SlotFault)
        assert issubclass(cls, PlanError)


def test_a_device_fault_recovered_through_the_cache_refetches_every_suspect_slot() -> None:
    cache = ExpertCache(1, EXPERTS, 8)
    slots = ExpertSlots(SlotGeometry(1, 8, WIDTHS))
    rows = named_rows(layers=1)
    plan = cache.ensure(0, [1, 2, 3])
    with pytest.raises(DeviceFault) as info:
        slots.apply_copy_plan(0, plan.copy, rows, FailingWrites(bank=1))
    for s in info.value.suspect:
        cache.forget_slot(s)
    host = HostSlotMemory(slots.geometry)
    again = cache.ensure(0, [1, 2, 3])
    assert again.missing == 3
    slots.apply_copy_plan(0, again.copy, rows, host)
    for expert, slot in zip([1, 2, 3], again.slots):
        assert slot is not None and slots.occupant(slot) == ExpertId(0, expert)


def test_a_device_that_refuses_the_route_fails_the_plan_before_any_write() -> None:
    class GraphCapturing(HostSlotMemory):
        def begin_plan(self, route: CopyRoute) -> None:
            if route is CopyRoute.WHOLE_LAYER_PAGEABLE:
                raise SlotDeviceError("a captured graph cannot replay a pageable copy")

    residency = BankResidency.build([HostResidency.PINNED, HostResidency.PAGEABLE], 2, {1})
    slots = ExpertSlots(SlotGeometry(2, EXPERTS, WIDTHS), residency)
    device = GraphCapturing(slots.geometry)
    whole = CopyPlan(tuple(range(EXPERTS)), tuple(range(EXPERTS)))
    with pytest.raises(DeviceFlushFault) as info:
        slots.apply_materialize(1, whole, named_rows(layers=2), device)
    assert info.value.slots == tuple(range(EXPERTS))
    assert "whole_layer_pageable" in str(info.value)
    assert device.slot(0, 0) == bytes(WIDTHS[0])
    assert slots.occupied() == 0


def test_the_package_exports_exactly_its_public_names() -> None:
    import pkgutil

    import refitd.experts as pkg

    # Submodules appear as attributes once anything imports them (bench-only ones too).
    submodules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    public = {n for n in dir(pkg) if not n.startswith("_") and n not in submodules}
    public.discard("annotations")
    assert set(pkg.__all__) == public
    for name in (
        "ExpertId",
        "CopyPlan",
        "GatherPlan",
        "ExpertCache",
        "HostResidency",
        "BankResidency",
        "CopyRoute",
        "ExpertSlots",
        "SlotGeometry",
        "SlotDevice",
        "HostSlotMemory",
        "SlotStats",
        "Applied",
        "SlotFault",
    ):
        assert name in pkg.__all__, f"{name} is part of the design's public API"
