"""Where slot bytes live: the pool geometry, the ``SlotDevice`` interface, and the host
backend (``HostExpertRows`` for host rows, ``HostSlotMemory`` for slots in host memory).

One ``SlotDevice`` per backend; the executor (``refitd.experts.slots.ExpertSlots``)
validates plans and calls it. Asynchronous copies return a ``CopyFence``
(``refitd.experts.inflight``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from refitd.experts.faults import SlotDeviceError
from refitd.experts.inflight import CompletedFence, CopyFence, HostCopier
from refitd.experts.residency import CopyRoute

__all__ = [
    "Bytes",
    "ExpertRows",
    "HostExpertRows",
    "HostSlotMemory",
    "SlotDevice",
    "SlotGeometry",
]

Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True)
class SlotGeometry:
    """One pool's shape. ``row_bytes`` is per bank (gate, up, down by convention),
    in bytes, because banks differ in shape and may be quantized differently.
    ``slots`` must equal the planner's ``cache_size``."""

    num_layers: int
    slots: int
    row_bytes: tuple[int, ...]

    @property
    def banks(self) -> int:
        return len(self.row_bytes)

    @property
    def bytes(self) -> int:
        """Device bytes the whole pool occupies: what a VRAM budget is checked against."""
        return sum(self.row_bytes) * self.slots

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert across all banks."""
        return sum(self.row_bytes)


# -- the device and the host rows -------------------------------------------------


class SlotDevice(ABC):
    """Where slot bytes live. One implementation per backend.

    Banks and slots are indices; turning them into addresses is the backend's job.
    A backend may defer copies until ``flush``, but must then fail the flush for any
    copy that did not land. Failures are reported by raising ``SlotDeviceError``.
    """

    def begin_plan(self, route: CopyRoute) -> None:  # noqa: B027 - optional hook
        """Called once per non-empty plan before its first copy. A backend that
        captures work into a graph must refuse ``WHOLE_LAYER_PAGEABLE``: its source
        has no device address, so a replayed capture would read nothing valid."""

    @abstractmethod
    def write_slot(self, bank: int, dst_slot: int, src: Bytes) -> None:
        """Copy one host row (exactly ``row_bytes[bank]`` long) into ``dst_slot``."""

    @abstractmethod
    def copy_slot(self, bank: int, dst_slot: int, src_slot: int) -> None:
        """Copy one slot onto another inside the pool, without touching the host."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Complete deferred copies. Called once per non-empty plan, after the last."""

    def write_slots_async(self, writes: Sequence[tuple[int, int, Bytes]]) -> CopyFence:
        """Issue host-row copies ``(bank, dst_slot, src)`` to run in the background, in
        order and after every copy issued before; return the fence that completes when
        all have landed. ``src`` stays valid until then.

        Called once per non-empty prefetch plan, after ``begin_plan``. The default
        performs them now through ``write_slot`` and ``flush`` and returns a completed
        fence (failed if a copy failed): right for any synchronous backend. Raise
        ``SlotDeviceError`` only if nothing was issued.
        """
        try:
            for bank, slot, src in writes:
                self.write_slot(bank, slot, src)
            self.flush()
        except SlotDeviceError as e:
            return CompletedFence(e)
        return CompletedFence()


class ExpertRows(Protocol):
    """Host expert rows, layer-local: row ``r`` of layer ``L`` in bank ``b``."""

    def row(self, bank: int, layer: int, row: int) -> Bytes | None:
        """The row's bytes, or ``None`` if the bank has no such row."""
        ...


class HostExpertRows:
    """Expert rows in host memory, one contiguous buffer per (bank, layer).

    A real implementation: ``row`` returns a zero-copy view. ``buffer(bank, layer)``
    exposes the contiguous layer, which is what a whole-layer copy reads.
    """

    def __init__(self, num_layers: int, num_experts: int, row_bytes: Sequence[int]) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.row_bytes = tuple(row_bytes)
        self._buf = [[bytearray(w * num_experts) for _ in range(num_layers)] for w in row_bytes]

    def buffer(self, bank: int, layer: int) -> memoryview:
        return memoryview(self._buf[bank][layer])

    def row(self, bank: int, layer: int, row: int) -> Bytes | None:
        if not (0 <= bank < len(self._buf) and 0 <= layer < self.num_layers):
            return None
        if not 0 <= row < self.num_experts:
            return None
        w = self.row_bytes[bank]
        return memoryview(self._buf[bank][layer])[row * w : (row + 1) * w]


class HostSlotMemory(SlotDevice):
    """A pool whose device is host memory, and whose link is a memcpy.

    The backend a CPU-only build uses, not a stand-in; ``slot`` reads a slot back so
    a caller can check *which* expert it holds, not only that a copy was counted.
    """

    def __init__(self, geometry: SlotGeometry) -> None:
        self._row_bytes = geometry.row_bytes
        self._banks = [bytearray(w * geometry.slots) for w in geometry.row_bytes]
        self._copier = HostCopier()

    def write_slots_async(self, writes: Sequence[tuple[int, int, Bytes]]) -> CopyFence:
        """The copies run on this memory's copier thread, in issue order."""
        batch = list(writes)

        def job() -> None:
            for bank, slot, src in batch:
                self.write_slot(bank, slot, src)
            self.flush()

        return self._copier.submit(job)

    def close(self) -> None:
        """Stop the copier thread after the copies already issued."""
        self._copier.close()

    def slot(self, bank: int, slot: int) -> bytes:
        w = self._row_bytes[bank]
        return bytes(self._banks[bank][slot * w : (slot + 1) * w])

    def write_slot(self, bank: int, dst_slot: int, src: Bytes) -> None:
        w = self._row_bytes[bank]
        self._banks[bank][dst_slot * w : (dst_slot + 1) * w] = src

    def copy_slot(self, bank: int, dst_slot: int, src_slot: int) -> None:
        w = self._row_bytes[bank]
        b = self._banks[bank]
        b[dst_slot * w : (dst_slot + 1) * w] = b[src_slot * w : (src_slot + 1) * w]
