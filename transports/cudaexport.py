"""The client side of the ``cuda`` memory kind: a GPU allocation exported for a daemon to open.

:func:`export_allocation` names the whole allocation around a device pointer
(``cuMemGetAddressRange``), its IPC handle (``cuIpcGetMemHandle``) and its
device's UUID, as the text ``<uuid hex>:<handle hex>`` that `transports.cuda`
opens. :class:`DeviceAllocation` is an allocation refitd makes itself. Every
driver call here pushes the device's context and pops it after, so the caller's
thread keeps the context it had.

NOTE: never run on a GPU yet; its first run is ``tests/gpu/run-on-device.sh``.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Any

from refitd.errors import ProtocolError

from .cudadriver import CudaError, IpcHandle, _Driver, driver

__all__ = ["DeviceAllocation", "Exported", "export_allocation", "parse_handle"]

CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10

_u64 = ctypes.c_uint64


@dataclass(frozen=True)
class Exported:
    """A whole allocation as its owner registers it: ``handle`` is the text a daemon
    opens (``<device uuid hex>:<IPC handle hex>``; a capability, keep it private),
    ``base`` its device address here, ``size`` its bytes, ``ordinal`` its device."""

    handle: str
    base: int
    size: int
    ordinal: int


def export_allocation(pointer: int, ordinal: int | None = None) -> Exported:
    """The allocation holding device address ``pointer`` (a tensor's ``data_ptr()``)
    on device ``ordinal`` (the tensor's ``device.index``; None: asked of the driver),
    exported once for a daemon to open. Raises :class:`CudaError` (named) for memory
    without an IPC handle (PyTorch's expandable segments and vLLM's sleep-mode pool,
    both mapped with ``cuMemCreate``; host memory) or on another device than
    ``ordinal``. The calling thread's current context is left as it was."""
    drv = driver()
    if ordinal is None:
        ordinal = _device_of(drv, pointer)
    with drv.current(ordinal):
        on = _device_of(drv, pointer)
        if on != ordinal:
            raise CudaError(f"device address {pointer:#x} is on GPU {on}, not on GPU {ordinal}")
        capable = ctypes.c_uint(1)
        rc = drv.lib.cuPointerGetAttribute(
            ctypes.byref(capable), CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, _u64(pointer)
        )
        if rc == 0 and not capable.value:
            raise CudaError(
                f"device address {pointer:#x} refused: its memory has no CUDA IPC handle "
                "(mapped with cuMemCreate: PyTorch's expandable segments, vLLM's sleep-mode "
                "pool); register a tensor of a plain cudaMalloc allocation (device_buffer "
                "makes one, or run without expandable_segments / sleep mode)"
            )
        base, size = _u64(0), ctypes.c_size_t(0)
        rc = drv.fn("cuMemGetAddressRange_v2", "cuMemGetAddressRange")(
            ctypes.byref(base), ctypes.byref(size), _u64(pointer)
        )
        drv.check(rc, f"cuMemGetAddressRange({pointer:#x})")
        h = IpcHandle()
        drv.check(
            drv.lib.cuIpcGetMemHandle(ctypes.byref(h), base),
            f"cuIpcGetMemHandle(allocation at {base.value:#x}; expandable segments have none)",
        )
    text = f"{drv.uuid(ordinal)}:{bytes(h.reserved).hex()}"
    return Exported(text, int(base.value), int(size.value), ordinal)


def _device_of(drv: _Driver, pointer: int) -> int:
    """The device ordinal of device address ``pointer``; asked with device 0's
    context pushed where the thread has none current (and popped after)."""
    ordinal = ctypes.c_int(-1)

    def ask() -> int:
        return int(
            drv.lib.cuPointerGetAttribute(
                ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, _u64(pointer)
            )
        )

    rc = ask()
    if rc != 0:
        with drv.current(0):
            rc = ask()
    drv.check(rc, f"cuPointerGetAttribute(device of {pointer:#x})")
    return ordinal.value


def parse_handle(text: str) -> tuple[str, bytes]:
    """``(device uuid hex, 64 handle bytes)`` of an exported handle, or ProtocolError."""
    uuid, _, hexed = text.partition(":")
    try:
        raw = bytes.fromhex(hexed)
        int(uuid, 16)
    except ValueError:
        raw = b""
    if len(uuid) != 32 or len(raw) != 64:
        raise ProtocolError(
            "CUDA IPC handle refused: expected '<32 hex of the device UUID>:<128 hex of "
            "the IPC handle>' (refitd.client's export_allocation makes it)"
        )
    return uuid, raw


class DeviceAllocation:
    """``nbytes`` of GPU memory refitd allocates itself (``cuMemAlloc``): one whole
    allocation, so its region is exactly it (no neighbour of the caching allocator
    inside). PyTorch imports it without a copy (``torch.as_tensor(a, device=...)``,
    through ``__cuda_array_interface__``) and holds this object while any view of it
    lives; the memory is freed when the last one goes."""

    def __init__(self, ordinal: int, nbytes: int) -> None:
        drv = driver()
        ptr = _u64(0)
        with drv.current(ordinal):
            rc = drv.fn("cuMemAlloc_v2", "cuMemAlloc")(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        drv.check(rc, f"cuMemAlloc({nbytes} bytes on GPU {ordinal})")
        self.ordinal = ordinal
        self.nbytes = nbytes
        self.pointer = int(ptr.value)
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.pointer, False),
            "version": 3,
            "strides": None,
        }

    def export(self) -> Exported:
        """The allocation's handle for a daemon (see :func:`export_allocation`)."""
        return export_allocation(self.pointer, self.ordinal)

    def __del__(self) -> None:
        # Any thread the collector runs in: pushed and popped, its context stays.
        pointer, self.pointer = getattr(self, "pointer", 0), 0
        if pointer:
            drv = driver()
            with contextlib.suppress(CudaError), drv.current(self.ordinal):
                drv.fn("cuMemFree_v2", "cuMemFree")(_u64(pointer))
