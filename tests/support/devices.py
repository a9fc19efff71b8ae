"""A device memory kind over host memory, for the memory-kind seam on machines without a GPU.

``hostdev`` is an honest implementation of `transports.memory`'s interfaces: an
allocation (an anonymous mapping, never a /dev/shm file, so nothing can map it by
name) with an identity, an owner, and a :class:`HostDeviceEngine` of its own, a
`transports.devcopy` engine as CUDA's is, so the pins, bounces, lanes and fences
the GPU path takes run here. Its driver part models what CUDA's does, where a CPU
can show it:

- :data:`DRIVER` holds the process's host registrations as the CUDA driver does:
  "already registered" (712) for a range overlapping one it holds, and a
  registration faults every page in first, so a file shorter than its mapping is
  refused, as ``cuMemHostRegister`` refuses it;
- copies are queued on a lane's stream and run only when it is synchronised, as a
  device's do, so a batch that returned without its fence leaves work behind
  (:attr:`HostDeviceEngine.pending`);
- a host address handed to the driver that it does not hold registered is refused
  by name: libcuda would copy it pageable, unguarded, and a segment shrunk under it
  would kill the process with SIGBUS;
- :meth:`HostDeviceEngine.fail_next` makes the next batch fail as a CUDA error
  would (:class:`~transports.memory.DeviceFault`, naming the read).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from refitd.memory_kinds import MemoryKind
from transports.devcopy import DeviceEngine
from transports.local import CopyFault, copy_batch_guarded
from transports.memory import DeviceFault, DeviceMemory, add_engine
from transports.pins import ALREADY_REGISTERED

__all__ = [
    "DRIVER",
    "HostDeviceDriver",
    "HostDeviceEngine",
    "HostDeviceMemory",
    "OtherDeviceMemory",
]

_ids = itertools.count(1)
NOT_REGISTERED = 713
INVALID_VALUE = 1
TOUCH = 1 << 20  # bytes a registration faults in at a time


class HostDeviceDriver:
    """The host registrations of this process, as a device driver keeps them (one
    table for the process, whichever engine asked). ``calls`` logs each call with
    the thread it ran in: ``(call, address, thread ident)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self._scratch = bytearray(TOUCH)

    def register(self, address: int, nbytes: int) -> int:
        with self._lock:
            self.calls.append(("register", address, threading.get_ident()))
            if any(a < address + nbytes and address < a + n for a, n in self.registered.items()):
                return ALREADY_REGISTERED
            # The driver faults every page in to lock it: a page past the end of a
            # shrunk file fails the registration (the guard turns SIGBUS into a fault).
            scratch = ctypes.addressof((ctypes.c_char * TOUCH).from_buffer(self._scratch))
            for at in range(address, address + nbytes, TOUCH):
                n = min(TOUCH, address + nbytes - at)
                try:
                    copy_batch_guarded(*(np.array([x], np.int64) for x in (scratch, at, n)))
                except CopyFault:
                    return INVALID_VALUE
            self.registered[address] = nbytes
            return 0

    def unregister(self, address: int) -> int:
        with self._lock:
            self.calls.append(("unregister", address, threading.get_ident()))
            return 0 if self.registered.pop(address, None) is not None else NOT_REGISTERED

    def describe(self, rc: int) -> str:
        names = {
            ALREADY_REGISTERED: "HOST_MEMORY_ALREADY_REGISTERED",
            INVALID_VALUE: "INVALID_VALUE",
        }
        return f"HOSTDEV_ERROR_{names.get(rc, 'UNKNOWN')} ({rc})"

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies in one registration."""
        with self._lock:
            return any(
                a <= address and address + nbytes <= a + n for a, n in self.registered.items()
            )


DRIVER = HostDeviceDriver()
"""The process's one driver model (a registration is the process's, not an engine's)."""

#: live hostdev allocations of this process: base address -> bytes
_DEVICE: dict[int, int] = {}


def _on_device(address: int, nbytes: int) -> bool:
    return any(a <= address and address + nbytes <= a + n for a, n in list(_DEVICE.items()))


@dataclass
class _Stream:
    pending: list[tuple[int, int, int]] = field(default_factory=list)


class HostDeviceEngine(DeviceEngine):
    """Copies between ``hostdev`` memory and host memory (and within ``hostdev``)."""

    kind: ClassVar[str] = "hostdev"

    def __init__(self, *, lanes: int = 4, bounce_bytes: int = 1 << 20) -> None:
        super().__init__(DRIVER)
        self.lanes, self.bounce_bytes = lanes, bounce_bytes
        self.batches = 0  #: batches handed to this engine
        self.reads = 0  #: copies that ran on the device (a bounced read may be several)
        self.pinned: list[int] = []  #: host addresses its batches held registered, in order
        self.forgotten: list[int] = []  #: host addresses it was told go away
        self.streams: list[_Stream] = []  #: every stream it made
        self._bounces: list[mmap.mmap] = []
        self._fail: int | None = None
        self._gate: threading.Event | None = None
        self.waiting = 0  #: batches whose fence is held (see :meth:`hold`)
        self._held = threading.Condition()
        self._batch = threading.local()
        add_engine(self)  # as a device kind's module does: told when host memory goes

    @property
    def pending(self) -> int:
        """Copies queued on its streams that have not run (0 whenever no batch is in flight)."""
        return sum(len(s.pending) for s in self.streams)

    def moves(self, dst_kind: str, src_kind: str) -> bool:
        return {dst_kind, src_kind} <= {self.kind, MemoryKind.HOST} and self.kind in (
            dst_kind,
            src_kind,
        )

    def fail_next(self, at_read: int = 0) -> None:
        """The next batch fails at its read ``at_read`` (earlier reads land)."""
        self._fail = at_read

    def forget_host(self, address: int) -> None:
        if address in self.pinned:
            self.pinned.remove(address)
        self.forgotten.append(address)

    def copy_batch(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[Any],
    ) -> None:
        self.batches += 1
        self._batch.fail, self._fail = self._fail, None
        super().copy_batch(dst, src, nbytes, host)

    # -- the driver's part

    def _current(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _new_stream(self) -> _Stream:
        s = _Stream()
        self.streams.append(s)
        return s

    def _new_bounce(self, nbytes: int) -> int:
        m = mmap.mmap(-1, nbytes)
        self._bounces.append(m)
        address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(m))
        DRIVER.registered[address] = nbytes  # allocated page-locked, as cuMemHostAlloc does
        return address

    def _pinned(self, address: int) -> None:
        if address not in self.pinned:
            self.pinned.append(address)

    def _issue(
        self,
        stream: Any,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> None:
        fail = getattr(self._batch, "fail", None)
        for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), nbytes.tolist())):
            if fail is not None and i == fail:
                self._batch.fail = None
                raise DeviceFault(f"HOSTDEV_ERROR_LAUNCH_FAILED at read #{i} (injected)", i)
            for side, a in (("destination", d), ("source", s)):
                if not _on_device(a, n) and not DRIVER.holds(a, n):
                    raise DeviceFault(
                        f"HOSTDEV_ERROR_PAGEABLE at read #{i}: {side} {a:#x} is host memory "
                        "the driver holds no registration of (libcuda would copy it "
                        "pageable, unguarded: SIGBUS if its file was shrunk)",
                        i,
                    )
            stream.pending.append((d, s, n))

    def hold(self) -> threading.Event:
        """Every batch's fence waits, from now on, until the event returned is set
        (a device still busy with them): batches in flight stay in flight."""
        self._gate = threading.Event()
        return self._gate

    def wait_held(self, count: int, timeout: float = 30.0) -> bool:
        """Block until ``count`` batches wait at their held fence (False: timed out)."""
        with self._held:
            return self._held.wait_for(lambda: self.waiting >= count, timeout)

    def _sync(self, stream: Any) -> None:
        gate = self._gate
        if gate is not None and stream.pending:
            with self._held:
                self.waiting += 1
                self._held.notify_all()
            gate.wait(60)
            with self._held:
                self.waiting -= 1
        queued, stream.pending = stream.pending, []
        if not queued:
            return
        d, s, n = (np.array(x, dtype=np.int64) for x in zip(*queued, strict=True))
        try:
            # A device's DMA to locked pages cannot fault; a CPU's copy can, so it is
            # guarded, and a fault is the device's error, never the process's end.
            copy_batch_guarded(d, s, n)
        except CopyFault as exc:
            raise DeviceFault(f"HOSTDEV_ERROR_ILLEGAL_ADDRESS: {exc}") from exc
        self.reads += len(queued)


class HostDeviceMemory(DeviceMemory):
    """One ``hostdev`` allocation of ``size`` bytes (zeroed), copied by ``engine``."""

    kind: ClassVar[str] = "hostdev"

    def __init__(self, size: int, engine: HostDeviceEngine) -> None:
        self._size = size
        self._map: mmap.mmap | None = mmap.mmap(-1, max(size, 1))
        self._buf = (ctypes.c_char * max(size, 1)).from_buffer(self._map)
        self._address = ctypes.addressof(self._buf)
        _DEVICE[self._address] = max(size, 1)
        self._id = next(_ids)
        self._engine = engine
        self._first: HostDeviceMemory | None = None
        self._open = True

    def opened_again(self) -> HostDeviceMemory:
        """The same allocation opened a second time (as a second registration of one
        GPU allocation opens its handle again): the same identity and address;
        closing it does not unmap the first."""
        again = object.__new__(type(self))
        again.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_buf", "_map")})
        again._map, again._first, again._open = None, self, True
        return again

    @property
    def name(self) -> str:
        return f"{self.kind}:{self._id}"

    @property
    def size(self) -> int:
        return self._size

    @property
    def address(self) -> int:
        return self._address

    @property
    def identity(self) -> tuple[str | int, ...]:
        return (self.kind, self._id)

    @property
    def owner_uid(self) -> int | None:
        return os.getuid()

    @property
    def engine(self) -> HostDeviceEngine:
        return self._engine

    def read(self, offset: int, nbytes: int) -> bytes:
        return ctypes.string_at(self._address + offset, nbytes)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        raw = bytes(data)
        ctypes.memmove(self._address + offset, raw, len(raw))

    @property
    def closed(self) -> bool:
        return not self._open

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._first is not None or self._map is None:
            return  # a second opening: the first one holds the mapping
        _DEVICE.pop(self._address, None)
        del self._buf
        self._map.close()
        self._map = None


class OtherDeviceMemory(HostDeviceMemory):
    """A second device kind whose engine moves only itself and host memory: a read
    between it and ``hostdev`` memory has no engine."""

    kind: ClassVar[str] = "otherdev"
