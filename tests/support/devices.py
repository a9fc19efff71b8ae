"""A device memory kind over host memory, for the memory-kind seam on machines without a GPU.

``hostdev`` is an honest implementation of `transports.memory`'s interfaces: an
allocation (an anonymous mapping, never a /dev/shm file, so nothing can map it by
name) with an identity, an owner, and a :class:`HostDeviceEngine` of its own that
moves it to and from host memory in batches, registering each host region once and
forgetting it when told. What it adds is the one fault a real device produces and
a CPU cannot: :meth:`HostDeviceEngine.fail_next` makes the next batch fail as a
CUDA error would (:class:`~transports.memory.DeviceFault`, naming the read).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import mmap
import os
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from transports.interface import MappedMemory
from transports.memory import HOST, CopyEngine, DeviceFault, DeviceMemory, add_engine

__all__ = ["HostDeviceEngine", "HostDeviceMemory", "OtherDeviceMemory"]

_ids = itertools.count(1)


class HostDeviceEngine(CopyEngine):
    """Copies between ``hostdev`` memory and host memory (and within ``hostdev``)."""

    kind: ClassVar[str] = "hostdev"

    def __init__(self) -> None:
        self.batches = 0  #: batches handed to this engine
        self.reads = 0  #: reads copied
        self.pinned: list[int] = []  #: host addresses registered, in order
        self.forgotten: list[int] = []  #: host addresses it was told go away
        self._fail: int | None = None
        add_engine(self)  # as a device kind's module does: told when host memory goes

    def moves(self, dst_kind: str, src_kind: str) -> bool:
        return {dst_kind, src_kind} <= {self.kind, HOST} and self.kind in (dst_kind, src_kind)

    def fail_next(self, at_read: int = 0) -> None:
        """The next batch fails at its read ``at_read`` (earlier reads land)."""
        self._fail = at_read

    def forget_host(self, address: int) -> None:
        if address in self.pinned:
            self.pinned.remove(address)
        self.forgotten.append(address)

    async def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[MappedMemory],
    ) -> None:
        self.batches += 1
        for m in host:
            if m.address not in self.pinned:
                self.pinned.append(m.address)
        fail, self._fail = self._fail, None

        def work() -> None:
            for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), nbytes.tolist())):
                if fail is not None and i == fail:
                    raise DeviceFault(f"HOSTDEV_ERROR_LAUNCH_FAILED at read #{i} (injected)", i)
                ctypes.memmove(d, s, n)
                self.reads += 1

        await asyncio.to_thread(work)


class HostDeviceMemory(DeviceMemory):
    """One ``hostdev`` allocation of ``size`` bytes (zeroed), copied by ``engine``."""

    kind: ClassVar[str] = "hostdev"

    def __init__(self, size: int, engine: HostDeviceEngine) -> None:
        self._size = size
        self._map: mmap.mmap | None = mmap.mmap(-1, max(size, 1))
        self._buf = (ctypes.c_char * max(size, 1)).from_buffer(self._map)
        self._address = ctypes.addressof(self._buf)
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
        del self._buf
        self._map.close()
        self._map = None


class OtherDeviceMemory(HostDeviceMemory):
    """A second device kind whose engine moves only itself and host memory: a read
    between it and ``hostdev`` memory has no engine."""

    kind: ClassVar[str] = "otherdev"
