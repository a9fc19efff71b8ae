"""The slot executor's refusals and failures: one class per case, each message saying
what would have gone wrong. ``SlotFault`` is the root; ``DeviceFault`` and
``DeviceFlushFault`` are also ``TransportError``s (the device failed, not the plan).
"""

from __future__ import annotations

from collections.abc import Sequence

from refitd.errors import ConfigError, PlanError, TransportError
from refitd.experts.residency import ResidencyError

__all__ = [
    "DegenerateGeometry",
    "DeviceFault",
    "DeviceFlushFault",
    "LayerOutOfRange",
    "PlanHalvesDisagree",
    "ResidencyRefused",
    "RowMissing",
    "RowSizeMismatch",
    "SlotDeviceError",
    "SlotFault",
    "SlotOutOfRange",
    "SlotWrittenTwice",
    "UnknownGatherSource",
]


class SlotFault(PlanError):
    """Root of every refusal and failure of the slot executor."""


class DegenerateGeometry(SlotFault, ConfigError):
    """A geometry no plan could be valid against."""


class PlanHalvesDisagree(SlotFault):
    def __init__(self, dst_slots: int, src_rows: int) -> None:
        self.dst_slots, self.src_rows = dst_slots, src_rows
        super().__init__(
            f"plan has {dst_slots} destination slots and {src_rows} sources: the pairs do "
            "not line up, so applying it would load experts into each other's slots"
        )


class SlotOutOfRange(SlotFault):
    def __init__(self, slot: int, slots: int) -> None:
        self.slot, self.slots = slot, slots
        super().__init__(
            f"plan names slot {slot} but the pool has {slots}: the planner and the pool "
            "were built with different cache sizes"
        )


class SlotWrittenTwice(SlotFault):
    def __init__(self, slot: int) -> None:
        self.slot = slot
        super().__init__(
            f"plan writes slot {slot} twice: one of its two experts would be missing from "
            "the slot the plan promised it"
        )


class LayerOutOfRange(SlotFault):
    def __init__(self, layer: int, num_layers: int) -> None:
        self.layer, self.num_layers = layer, num_layers
        super().__init__(f"plan names layer {layer} but the pool was built for {num_layers}")


class RowMissing(SlotFault):
    def __init__(self, bank: int, layer: int, row: int) -> None:
        self.bank, self.layer, self.row = bank, layer, row
        super().__init__(f"bank {bank} has no row {row} for layer {layer}")


class RowSizeMismatch(SlotFault):
    def __init__(self, bank: int, layer: int, row: int, expected: int, got: int) -> None:
        self.bank, self.layer, self.row = bank, layer, row
        self.expected, self.got = expected, got
        super().__init__(
            f"bank {bank} row {row} of layer {layer} is {got} bytes, not {expected}: a "
            "short row would leave the slot's tail holding the previous occupant"
        )


class ResidencyRefused(SlotFault):
    """The layer's host residency does not permit this copy; ``error`` says why."""

    def __init__(self, error: ResidencyError) -> None:
        self.error = error
        super().__init__(str(error))


class UnknownGatherSource(SlotFault):
    def __init__(self, slot: int) -> None:
        self.slot = slot
        super().__init__(
            f"gather source slot {slot} holds no known expert: its last copy failed or "
            "never happened, and gathering would copy that garbage into a second slot"
        )


class DeviceFault(SlotFault, TransportError):
    """The device refused one copy into ``slot``.

    ``suspect`` is every slot of the plan (``slot`` among them): none was confirmed by
    a flush, and those after ``slot`` were never written although the cache already
    records them as filled. All are marked unknown here; forget all of them.
    """

    def __init__(self, bank: int, slot: int, detail: str, suspect: Sequence[int] = ()) -> None:
        self.bank, self.slot, self.detail = bank, slot, detail
        self.suspect = tuple(suspect) if suspect else (slot,)
        super().__init__(
            f"device refused the copy into bank {bank} slot {slot}: {detail}; slots "
            f"{list(self.suspect)} hold no confirmed expert and must be forgotten"
        )


class DeviceFlushFault(SlotFault, TransportError):
    """The device could not confirm a plan's copies; every slot in ``slots`` is unknown."""

    def __init__(self, slots: Sequence[int], detail: str) -> None:
        self.slots, self.detail = tuple(slots), detail
        n = len(self.slots)
        super().__init__(
            f"device failed to complete {n} deferred cop{'y' if n == 1 else 'ies'}: "
            f"{detail}; slots {list(self.slots)} are all suspect, since the backend "
            "cannot say which landed"
        )


class SlotDeviceError(TransportError):
    """Raised by a ``SlotDevice`` to report a copy or flush it could not perform."""
