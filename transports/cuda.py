"""The ``cuda`` memory kind: a GPU allocation, opened once from its owner's CUDA IPC handle.

Written against the CUDA driver API through ctypes (`transports.cudadriver`), so
it needs no CUDA toolkit and no Python CUDA package. Nothing here runs at import:
the driver is loaded, and a context made current, only when the first allocation
is opened or exported (:func:`missing` only asks whether it could be).

NOTE: never run on a GPU yet; its first run is ``tests/gpu/run-on-device.sh``.

- **Export** (the client, `transports.cudaexport`): the whole allocation around a
  device pointer (``cuMemGetAddressRange``), its IPC handle (``cuIpcGetMemHandle``)
  and its device's UUID, as the text ``<uuid hex>:<handle hex>``. Registered once
  per allocation: a caching-allocator segment holds many tensors, each one an
  offset inside it. Memory of PyTorch's expandable segments (VMM) has no IPC handle
  and is refused by the driver, named.
- **Open** (the daemon, :meth:`CudaIpcMemory.open`): the handle opened on the
  device of that UUID (``cuIpcOpenMemHandle``, lazy peer access), once per
  allocation in this process; it must hold at least the bytes the client stated
  (the importer may see it rounded up to the driver's granularity), and the region
  is the bytes stated. The
  handle is a bearer capability: the memory proves no owner (``owner_uid`` None),
  so who may register it is decided before it is opened (docs/trust.md, "GPU
  memory"). Its public name is a digest, never the handle.
- **Copies** (:class:`CudaEngine`, one per device, a `transports.devcopy`
  engine): GPU to GPU and host to/from GPU with unified addressing
  (``cuMemcpyAsync`` on a stream of the engine's, each batch on its own and fenced
  before it returns, error or not). Host memory is registered
  (``cuMemHostRegister``: page-locked copies at PCIe rate instead of the pageable
  1/6) through the process's pin table (`transports.pins`), dropped when its
  mapping goes; host memory not registered is never handed to the driver (a bounce
  buffer and the guarded memcpy). Small pieces GPU to GPU *within this device* are
  gathered by one indexed copy on the engine's stream (PyTorch's kernels, loaded
  only then) instead of one call each; another device's memory is read with peer
  access enabled once. Every driver call made in a caller's thread pushes the
  device's context and pops it after. A CUDA error raises
  :class:`~transports.memory.DeviceFault` naming the call and the error: it fails
  the batch that met it. (A "sticky" error, such as an illegal address, poisons the
  context: every later GPU copy of the process fails, named, until it restarts.)
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from refitd.errors import ConflictError, ProtocolError
from refitd.memory_kinds import MemoryKind

from .cudacopies import (
    BATCH_MAX,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    CU_MEMORYTYPE_UNIFIED,
    GATHER_UNIT,
    MemcpyAttributes,
    gather_mask,
    gather_units,
    on_one_device,
    strided_runs,
)
from .cudacopies import Memcpy2D as _Memcpy2D
from .cudacopies import Span as _Span
from .cudadriver import CudaError, IpcHandle, _Driver, device_count, driver, missing
from .cudaexport import DeviceAllocation, Exported, export_allocation, parse_handle
from .devcopy import DeviceEngine
from .memory import DeviceMemory, add_engine

if TYPE_CHECKING:
    pass

__all__ = [
    "CudaEngine",
    "CudaError",
    "CudaIpcMemory",
    "DeviceAllocation",
    "Exported",
    "check_opened_size",
    "device_count",
    "export_allocation",
    "gather_units",
    "missing",
    "on_one_device",
    "strided_runs",
]

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_STREAM_NON_BLOCKING = 1
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTALLOC_PORTABLE = 1
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p

# ---------------------------------------------------------------- open (daemon side)


@dataclass
class _Opened:
    """An allocation opened in this process: where, how large (as the driver maps
    it here), on which device, and by how many regions."""

    address: int
    size: int
    ordinal: int
    users: int = 0


#: allocations opened in this process, by handle bytes. The driver maps one
#: allocation once per context, so a second registration of the same handle shares
#: the mapping (and the store then refuses it as memory it holds).
_OPENED: dict[bytes, _Opened] = {}
_OPEN_LOCK = threading.Lock()


def opened_ranges() -> list[tuple[int, int, int]]:
    """``(address, bytes, device ordinal)`` of every allocation opened here."""
    with _OPEN_LOCK:
        return [(o.address, o.size, o.ordinal) for o in _OPENED.values()]


def check_opened_size(opened: int, requested: int) -> None:
    """An opened allocation of ``opened`` bytes may be a region of ``requested``
    bytes: at least that many (the importer may see the allocation rounded up to the
    driver's granularity); ProtocolError, named, where it holds fewer."""
    if opened < requested:
        raise ProtocolError(
            f"cuda region refused: the allocation holds {opened} bytes, fewer than "
            f"the {requested} stated; register the whole allocation"
        )


class CudaIpcMemory(DeviceMemory):
    """A GPU allocation of another process, opened here from its IPC handle."""

    kind: ClassVar[MemoryKind] = MemoryKind.CUDA

    def __init__(self, uuid: str, raw: bytes, ordinal: int, address: int, size: int) -> None:
        self._uuid = uuid
        self._raw = raw
        self._ordinal = ordinal
        self._address = address
        self._size = size
        self._closed = False
        self._engine = CudaEngine.for_device(ordinal)

    @classmethod
    def open(cls, handle: str, nbytes: int) -> CudaIpcMemory:
        """Open ``handle`` (:func:`export_allocation`'s text) as a region of ``nbytes``
        bytes; the allocation must hold at least that many. A device not on this
        host, a handle the driver refuses, or a smaller allocation are refused,
        named, and nothing stays open. Blocking (the driver's first use initialises
        it): the daemon calls it off its event loop."""
        uuid, raw = parse_handle(handle)
        drv = driver()
        ordinal = drv.ordinal_of(uuid)
        with drv.current(ordinal):
            with _OPEN_LOCK:
                entry = _OPENED.get(raw)
                if entry is None:
                    ptr = _u64(0)
                    h = IpcHandle.from_buffer_copy(raw)
                    rc = drv.fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")(
                        ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                    )
                    drv.check(rc, f"cuIpcOpenMemHandle(GPU {uuid})")
                    entry = _OPENED[raw] = _Opened(int(ptr.value), 0, ordinal)
                entry.users += 1
            mem = cls(uuid, raw, ordinal, entry.address, nbytes)
            try:
                base, size = _u64(0), ctypes.c_size_t(0)
                rc = drv.fn("cuMemGetAddressRange_v2", "cuMemGetAddressRange")(
                    ctypes.byref(base), ctypes.byref(size), _u64(entry.address)
                )
                drv.check(rc, "cuMemGetAddressRange(opened allocation)")
                entry.size = int(size.value)
                check_opened_size(entry.size, nbytes)
            except BaseException:
                mem.close()
                raise
        return mem

    @property
    def name(self) -> str:
        digest = hashlib.sha256(self._raw).hexdigest()[:16]
        return f"cuda:{self._uuid}:{digest}"

    @property
    def size(self) -> int:
        return self._size

    @property
    def address(self) -> int:
        if self._closed:
            raise ConflictError(f"GPU region {self.name} is closed")
        return self._address

    @property
    def identity(self) -> tuple[str | int, ...]:
        """``("cuda", device uuid, device address here)``: one allocation is opened at
        one address per process, however many handles name it."""
        return (MemoryKind.CUDA, self._uuid, self._address)

    @property
    def owner_uid(self) -> int | None:
        return None  # an IPC handle is a bearer capability: it proves no owner

    @property
    def engine(self) -> CudaEngine:
        return self._engine

    def read(self, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        if nbytes:
            self._engine.copy_now(_addr(out), self.address + offset, nbytes)
        return bytes(out)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        buf = bytearray(data)
        if buf:
            self._engine.copy_now(self.address + offset, _addr(buf), len(buf))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _OPEN_LOCK:
            entry = _OPENED.get(self._raw)
            if entry is None:
                return
            entry.users -= 1
            if entry.users > 0:
                return
            del _OPENED[self._raw]
        drv = driver()
        with contextlib.suppress(CudaError), drv.current(self._ordinal):
            drv.check(drv.lib.cuIpcCloseMemHandle(_u64(self._address)), "cuIpcCloseMemHandle")

    def __repr__(self) -> str:
        return f"CudaIpcMemory({self.name}, {self._size} bytes)"


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


# ---------------------------------------------------------------- copies


class _HostRegistrar:
    """``cuMemHostRegister``/``cuMemHostUnregister`` for the pin table
    (`transports.pins`), portable (every context of the process sees it), each call
    with device ``ordinal``'s context pushed: an unregister may come from any thread
    (a mapping's close)."""

    def __init__(self, drv: _Driver, ordinal: int) -> None:
        self._drv = drv
        self._ordinal = ordinal

    def register(self, address: int, nbytes: int) -> int:
        with self._drv.current(self._ordinal):
            return self._drv.fn("cuMemHostRegister_v2", "cuMemHostRegister")(
                _vp(address), ctypes.c_size_t(nbytes), CU_MEMHOSTREGISTER_PORTABLE
            )

    def unregister(self, address: int) -> int:
        with self._drv.current(self._ordinal):
            return int(self._drv.lib.cuMemHostUnregister(_vp(address)))

    def describe(self, rc: int) -> str:
        return self._drv.error(rc)


class CudaEngine(DeviceEngine):
    """Copies to and from one GPU's memory, each batch on a stream of the engine's
    (`transports.devcopy`); one per device per process (:meth:`for_device`), made
    when the first allocation is opened (off the event loop)."""

    kind: ClassVar[MemoryKind] = MemoryKind.CUDA
    _by_device: ClassVar[dict[int, CudaEngine]] = {}
    #: use the driver's batched copy where it has one (False: the older path)
    batched: bool = True
    _making: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, ordinal: int) -> None:
        drv = driver()
        super().__init__(_HostRegistrar(drv, ordinal))
        self.ordinal = ordinal
        self._drv = drv
        self._peers: set[int] = set()  # devices whose memory this one reads directly
        self._peer_lock = threading.Lock()
        drv.context(ordinal)  # the device's primary context is made here, once

    @classmethod
    def for_device(cls, ordinal: int) -> CudaEngine:
        """The engine of device ``ordinal`` (made once, whichever thread asks first)."""
        with cls._making:
            engine = cls._by_device.get(ordinal)
            if engine is None:
                engine = cls._by_device[ordinal] = cls(ordinal)
                add_engine(engine)
            return engine

    def moves(self, dst_kind: MemoryKind, src_kind: MemoryKind) -> bool:
        kinds = {self.kind, MemoryKind.HOST}
        return {dst_kind, src_kind} <= kinds and self.kind in (dst_kind, src_kind)

    # -- the driver's part (`transports.devcopy`)

    def _current(self) -> AbstractContextManager[None]:
        return self._drv.current(self.ordinal)

    def _new_stream(self) -> Any:
        s = _vp()
        self._drv.check(
            self._drv.lib.cuStreamCreate(ctypes.byref(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate"
        )
        return s

    def _new_bounce(self, nbytes: int) -> int:
        p = _vp()
        rc = self._drv.fn("cuMemHostAlloc")(
            ctypes.byref(p), ctypes.c_size_t(nbytes), CU_MEMHOSTALLOC_PORTABLE
        )
        self._drv.check(rc, f"cuMemHostAlloc({nbytes} bytes of bounce buffer)")
        return int(p.value or 0)

    def _sync(self, stream: Any) -> None:
        self._drv.check(self._drv.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def copy_now(self, dst: int, src: int, nbytes: int) -> None:
        """One synchronous copy in this thread (unified addresses; checks only: a
        host side is this process's own buffer, not a client's)."""
        with self._current():
            lane = self._take_lane()
            try:
                rc = self._drv.lib.cuMemcpyAsync(
                    _u64(dst), _u64(src), ctypes.c_size_t(nbytes), lane.stream
                )
                self._drv.check(rc, "cuMemcpyAsync")
            finally:
                try:
                    self._sync(lane.stream)
                finally:
                    self._give_lane(lane)

    def _issue(
        self,
        stream: Any,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> None:
        """Regular runs of reads (a strided block read row by row) as one 2-D copy
        each; the rest as one batched copy of the driver (``cuMemcpyBatchAsync``,
        CUDA 12.8+: one call for thousands of reads, every pair of kinds, no kernel
        and no PyTorch in the daemon); where the driver has none, small reads
        within this device as one indexed gather and the others one
        ``cuMemcpyAsync`` each. All queued on ``stream``."""
        ranges = opened_ranges()
        self._reach(dst, src, nbytes, ranges)
        left = np.ones(len(dst), dtype=bool)
        for start, count, dpitch, spitch in strided_runs(dst, src, nbytes):
            self._copy_2d(
                stream,
                (int(dst[start]), int(src[start]), int(nbytes[start])),
                (count, dpitch, spitch),
                start,
            )
            left[start : start + count] = False
        rest = np.flatnonzero(left)
        batched = self._drv.batch_copy() if self.batched else None
        if batched is not None and len(rest) > 1:
            self._copy_batched(batched, stream, dst, src, nbytes, rest)
            return
        mine = [(a, n) for a, n, o in ranges if o == self.ordinal]
        small = gather_mask(dst, src, nbytes, left, mine)
        copy = self._drv.lib.cuMemcpyAsync
        for i in np.flatnonzero(left & ~small).tolist():
            rc = copy(_u64(int(dst[i])), _u64(int(src[i])), ctypes.c_size_t(int(nbytes[i])), stream)
            if rc != 0:
                self._drv.check(rc, f"cuMemcpyAsync of read #{i}", i)
        if small.any():
            self._gather(stream, dst[small], src[small], nbytes[small])

    def _copy_batched(
        self,
        batched: Any,
        stream: Any,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        k: npt.NDArray[np.intp],
    ) -> None:
        """Reads ``k`` as batched copies on ``stream`` (:data:`BATCH_MAX` a call),
        the source read in stream order; a refusal names the read the driver gives."""
        attrs = MemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        first = ctypes.c_size_t(0)
        for lo in range(0, len(k), BATCH_MAX):
            part = k[lo : lo + BATCH_MAX]
            d = np.ascontiguousarray(dst[part], dtype=np.uint64)
            s = np.ascontiguousarray(src[part], dtype=np.uint64)
            n = np.ascontiguousarray(nbytes[part], dtype=np.uint64)
            failed = ctypes.c_size_t(len(part))
            rc = batched(
                d.ctypes.data_as(_vp),
                s.ctypes.data_as(_vp),
                n.ctypes.data_as(_vp),
                ctypes.c_size_t(len(part)),
                ctypes.byref(attrs),
                ctypes.byref(first),
                ctypes.c_size_t(1),
                ctypes.byref(failed),
                stream,
            )
            if rc != 0:
                i = int(part[failed.value]) if failed.value < len(part) else -1
                where = f"read #{i}" if i >= 0 else f"reads #{int(part[0])}.."
                self._drv.check(rc, f"cuMemcpyBatchAsync of {where}", i)

    def _reach(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        ranges: list[tuple[int, int, int]],
    ) -> None:
        """Enable peer access from this device to every other device whose opened
        memory the reads touch (once each), so the copies go device to device
        instead of through host memory. A pair the hardware cannot connect is left
        to the driver, which then stages (slower, never wrong)."""
        others = {o for _, _, o in ranges if o != self.ordinal and o not in self._peers}
        for other in sorted(others):
            theirs = [(a, n) for a, n, o in ranges if o == other]
            if not (
                on_one_device(dst, nbytes, theirs).any() or on_one_device(src, nbytes, theirs).any()
            ):
                continue
            with self._peer_lock:
                if other in self._peers:
                    continue
                can, dev, peer = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
                self._drv.check(
                    self._drv.lib.cuDeviceGet(ctypes.byref(dev), self.ordinal), "cuDeviceGet"
                )
                self._drv.check(self._drv.lib.cuDeviceGet(ctypes.byref(peer), other), "cuDeviceGet")
                self._drv.check(
                    self._drv.lib.cuDeviceCanAccessPeer(ctypes.byref(can), dev, peer),
                    "cuDeviceCanAccessPeer",
                )
                if can.value:
                    rc = self._drv.lib.cuCtxEnablePeerAccess(_vp(self._drv.context(other)), 0)
                    if rc not in (0, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                        self._drv.check(rc, f"cuCtxEnablePeerAccess(GPU {self.ordinal} -> {other})")
                self._peers.add(other)

    def _copy_2d(
        self, stream: Any, read: tuple[int, int, int], run: tuple[int, int, int], first: int
    ) -> None:
        """``height`` rows of ``width`` bytes, ``spitch`` apart at ``src`` and ``dpitch``
        apart at ``dst`` (unified addresses), as one copy on ``stream``."""
        dst, src, width = read
        height, dpitch, spitch = run
        c = _Memcpy2D()
        c.srcMemoryType = c.dstMemoryType = CU_MEMORYTYPE_UNIFIED
        c.srcDevice, c.srcPitch = src, spitch
        c.dstDevice, c.dstPitch = dst, dpitch
        c.WidthInBytes, c.Height = width, height
        rc = self._drv.fn("cuMemcpy2DAsync_v2", "cuMemcpy2DAsync")(ctypes.byref(c), stream)
        self._drv.check(rc, f"cuMemcpy2DAsync of reads #{first}..#{first + height - 1}", first)

    def _gather(
        self,
        stream: Any,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> None:
        """Small reads within this device as one indexed copy (:func:`gather_units`)
        over the device address space they span, queued on ``stream`` (the batch's
        own: ordered with its other copies and fenced with them)."""
        import torch

        try:
            dev = torch.device("cuda", self.ordinal)
            on = torch.cuda.ExternalStream(int(stream.value or 0), device=dev)  # type: ignore[no-untyped-call]
            with torch.cuda.device(self.ordinal), torch.cuda.stream(on):
                lo = int(min(dst.min(), src.min()))
                hi = int(max((dst + nbytes).max(), (src + nbytes).max()))
                space = torch.as_tensor(_Span(lo, (hi - lo) // GATHER_UNIT), device=dev)
                gather_units(space, lo, dst, src, nbytes)
        except RuntimeError as exc:  # PyTorch reports CUDA errors as RuntimeError
            raise CudaError(f"indexed GPU gather of {len(dst)} reads failed: {exc}") from exc
