"""Where offloaded experts live off the device: every expert's rows in host memory
(``HostExpertStore``), and the slot pool when the device is the CPU
(``TorchSlotMemory``; on a GPU it is ``refitd.experts.cuda.CudaSlotMemory``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from refitd.errors import ConfigError
from refitd.experts import SlotDevice, SlotGeometry
from refitd.experts.device import Bytes
from refitd.experts.inflight import CopyFence, HostCopier

__all__ = ["DOWN", "GATE_UP", "HostExpertStore", "TorchSlotMemory"]

GATE_UP, DOWN = 0, 1
"""The two banks of an expert: ``gate_up_proj [2I, H]`` and ``down_proj [H, I]``."""


# -- host rows ------------------------------------------------------------------------


class HostExpertStore:
    """Every expert's rows in host memory: bank ``b`` is one ``uint8`` tensor
    ``[layers, experts, row_bytes[b]]``. An ``ExpertRows`` for the slot executor
    (``row`` is a zero-copy view) and the CPU's source in hybrid mode (``weight``).

    By default the store allocates its memory, page-locked with ``pin`` so a GPU
    copies from it with its DMA engine. Given a ``buffer`` (e.g. a shared-memory
    segment attached to refitd as a region, so a refit pull lands in the rows) it
    uses that instead, in a daemon expert pool's host layout: banks one after another,
    rows layer-major (``nbytes`` sizes it); ``pin`` then registers it with CUDA
    (``cudaHostRegister``) until ``close``.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        shapes: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        *,
        pin: bool = False,
        buffer: memoryview | bytearray | None = None,
    ) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.shapes = tuple(shapes)
        self.dtype = dtype
        size = torch.tensor([], dtype=dtype).element_size()
        self.row_bytes = tuple(a * b * size for a, b in self.shapes)
        self._registered: torch.Tensor | None = None
        if buffer is None:
            self._banks = [
                torch.zeros((num_layers, num_experts, w), dtype=torch.uint8, pin_memory=pin)
                for w in self.row_bytes
            ]
        else:
            self._banks = self._over(memoryview(buffer).cast("B"), pin)
        # numpy views: ``row`` is on the hot path and numpy slices are cheap.
        self._np = [b.numpy() for b in self._banks]
        self._typed = [
            b.view(dtype).view(num_layers, num_experts, *shape)
            for b, shape in zip(self._banks, self.shapes)
        ]

    @staticmethod
    def nbytes(num_layers: int, num_experts: int, row_bytes: Sequence[int]) -> int:
        """Bytes a ``buffer`` must hold for this geometry."""
        return num_layers * num_experts * sum(row_bytes)

    def _over(self, view: memoryview, pin: bool) -> list[torch.Tensor]:
        need = self.nbytes(self.num_layers, self.num_experts, self.row_bytes)
        if view.readonly or view.nbytes < need:
            raise ConfigError(
                f"expert rows need a writable buffer of {need} bytes, got "
                f"{'a read-only one' if view.readonly else f'{view.nbytes}'}"
            )
        whole = torch.frombuffer(view, dtype=torch.uint8, count=need)
        if pin:
            if not torch.cuda.is_available():
                raise ConfigError("registering expert rows with CUDA needs a GPU")
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            rc = cudart.cudaHostRegister(whole.data_ptr(), need, 0)
            if int(rc) != 0:
                raise ConfigError(f"cudaHostRegister of {need} bytes of expert rows failed: {rc}")
            self._registered = whole
        banks, at, rows = [], 0, self.num_layers * self.num_experts
        for w in self.row_bytes:
            banks.append(whole[at : at + rows * w].view(self.num_layers, self.num_experts, w))
            at += rows * w
        return banks

    def close(self) -> None:
        """Unregister a caller's buffer from CUDA (idempotent)."""
        if self._registered is not None:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self._registered.data_ptr())
            self._registered = None

    def row(self, bank: int, layer: int, row: int) -> Bytes | None:
        if not (0 <= bank < len(self._np) and 0 <= layer < self.num_layers):
            return None
        if not 0 <= row < self.num_experts:
            return None
        return memoryview(self._np[bank][layer, row])

    def weight(self, bank: int, layer: int, expert: int) -> torch.Tensor:
        """Expert ``expert``'s bank ``bank`` as the model's tensor (a view)."""
        return self._typed[bank][layer, expert]

    def typed(self, bank: int) -> torch.Tensor:
        """Bank ``bank`` as ``[layers, experts, *shape]`` in the model's dtype (a view)."""
        return self._typed[bank]

    def write(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy one expert's weights into its host rows."""
        for bank, w in ((GATE_UP, gate_up), (DOWN, down)):
            if tuple(w.shape) != self.shapes[bank] or w.dtype != self.dtype:
                raise ConfigError(
                    f"expert {expert} of layer {layer}: bank {bank} is {tuple(w.shape)} "
                    f"{w.dtype}, the store holds {self.shapes[bank]} {self.dtype}"
                )
            self.weight(bank, layer, expert).copy_(w.detach())


# -- slots on the CPU -------------------------------------------------------------------


class TorchSlotMemory(SlotDevice):
    """A slot pool in host memory as torch tensors (the CPU's ``SlotDevice``): bank
    ``b`` is ``[slots, row_bytes[b]]`` ``uint8``. Prefetch copies run on a copier
    thread in issue order (``HostCopier``); ``copy_seconds`` is the time spent copying
    on either thread."""

    def __init__(self, geometry: SlotGeometry) -> None:
        self._row_bytes = geometry.row_bytes
        self._banks = [
            torch.zeros((geometry.slots, w), dtype=torch.uint8) for w in geometry.row_bytes
        ]
        self._copier = HostCopier("refitd-offload-copier")
        self._seconds = [0.0, 0.0]  # [caller's thread, copier thread]

    def bank(self, bank: int) -> torch.Tensor:
        return self._banks[bank]

    def copy_seconds(self) -> float:
        """Seconds spent copying into slots, on either thread."""
        return self._seconds[0] + self._seconds[1]

    def prefetch_copy_seconds(self) -> float:
        """Of which asynchronous (prefetch) copies, on the copier thread."""
        return self._seconds[1]

    def _copy(self, bank: int, slot: int, src: Bytes) -> None:
        self._banks[bank][slot].copy_(torch.frombuffer(src, dtype=torch.uint8))

    def write_slot(self, bank: int, dst_slot: int, src: Bytes) -> None:
        t0 = time.perf_counter()
        self._copy(bank, dst_slot, src)
        self._seconds[0] += time.perf_counter() - t0

    def copy_slot(self, bank: int, dst_slot: int, src_slot: int) -> None:
        self._banks[bank][dst_slot].copy_(self._banks[bank][src_slot])

    def write_slots_async(self, writes: Sequence[tuple[int, int, Bytes]]) -> CopyFence:
        batch = list(writes)

        def job() -> None:
            t0 = time.perf_counter()
            for bank, slot, src in batch:
                self._copy(bank, slot, src)
            self._seconds[1] += time.perf_counter() - t0

        return self._copier.submit(job)

    def close(self) -> None:
        self._copier.close()
