"""The ``cuda`` memory kind: a GPU allocation, opened once from its owner's CUDA IPC handle.

Written against the CUDA driver API through ctypes (`transports.cudadriver`), so
it needs no CUDA toolkit and no Python CUDA package. Nothing here runs at import:
the driver is loaded, and a context made current, only when the first allocation
is opened or exported (:func:`missing` only asks whether it could be).

NOTE: never run on a GPU yet; its first run is ``tests/gpu/run-on-device.sh``.

- **Export** (the client, :func:`export_allocation`): the whole allocation around a
  device pointer (``cuMemGetAddressRange``), its IPC handle (``cuIpcGetMemHandle``)
  and its device's UUID, as the text ``<uuid hex>:<handle hex>``. Registered once
  per allocation: a caching-allocator segment holds many tensors, each one an
  offset inside it. Memory of PyTorch's expandable segments (VMM) has no IPC handle
  and is refused by the driver, named.
- **Open** (the daemon, :meth:`CudaIpcMemory.open`): the handle opened on the
  device of that UUID (``cuIpcOpenMemHandle``, lazy peer access), once per
  allocation in this process; its size must be exactly what the client stated. The
  handle is a bearer capability: the memory proves no owner (``owner_uid`` None),
  so who may register it is decided before it is opened (docs/trust.md, "GPU
  memory"). Its public name is a digest, never the handle.
- **Copies** (:class:`CudaEngine`, one per device): GPU to GPU and host to/from GPU
  with unified addressing (``cuMemcpyAsync`` on the engine's stream), each host
  region registered once (``cuMemHostRegister``: page-locked copies at PCIe rate
  instead of the pageable 1/6) and unregistered before it is unmapped; small pieces
  GPU to GPU gathered by one indexed copy on the device (PyTorch's kernels, loaded
  only then) instead of one call each. A CUDA error raises
  :class:`~transports.memory.DeviceFault` naming the call and the error: it fails
  the batch that met it. (A "sticky" error, such as an illegal address, poisons the
  context: every later GPU copy of the process fails, named, until it restarts.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import mmap
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from refitd.errors import ConflictError, ProtocolError

from .cudadriver import CudaError, IpcHandle, device_count, driver, missing
from .memory import HOST, CopyEngine, DeviceMemory, add_engine

if TYPE_CHECKING:
    import torch

    from .interface import MappedMemory

__all__ = [
    "KIND",
    "CudaEngine",
    "CudaError",
    "CudaIpcMemory",
    "DeviceAllocation",
    "Exported",
    "device_count",
    "export_allocation",
    "gather_units",
    "missing",
    "strided_runs",
]

KIND = "cuda"
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_STREAM_NON_BLOCKING = 1
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p

SMALL_PIECE = 64 << 10
"""Bytes: GPU-to-GPU reads up to this size are gathered by one indexed device copy."""
GATHER_UNIT = 8
"""Bytes per element of the indexed gather: a read's offsets and size must be multiples."""

# ---------------------------------------------------------------- export (client side)


@dataclass(frozen=True)
class Exported:
    """A whole allocation as its owner registers it: ``handle`` is the text a daemon
    opens (``<device uuid hex>:<IPC handle hex>``; a capability, keep it private),
    ``base`` its device address here, ``size`` its bytes, ``ordinal`` its device."""

    handle: str
    base: int
    size: int
    ordinal: int


def export_allocation(pointer: int) -> Exported:
    """The allocation holding device address ``pointer`` (a tensor's ``data_ptr()``),
    exported once for a daemon to open. Raises :class:`CudaError` (named) for memory
    without an IPC handle (PyTorch's expandable segments, host memory)."""
    drv = driver()
    ordinal = ctypes.c_int(-1)

    def device_of() -> int:
        return int(
            drv.lib.cuPointerGetAttribute(
                ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, _u64(pointer)
            )
        )

    rc = device_of()
    if rc != 0:  # a thread with no current context yet: the first device's, then ask again
        drv.use(0)
        rc = device_of()
    drv.check(rc, f"cuPointerGetAttribute(device of {pointer:#x})")
    drv.use(ordinal.value)
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
    text = f"{drv.uuid(ordinal.value)}:{bytes(h.reserved).hex()}"
    return Exported(text, int(base.value), int(size.value), ordinal.value)


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
            "cuda_ipc handle refused: expected '<32 hex of the device UUID>:<128 hex of "
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
        drv.use(ordinal)
        ptr = _u64(0)
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
        return export_allocation(self.pointer)

    def __del__(self) -> None:
        pointer, self.pointer = getattr(self, "pointer", 0), 0
        if pointer:
            drv = driver()
            with contextlib.suppress(CudaError):
                drv.use(self.ordinal)
                drv.fn("cuMemFree_v2", "cuMemFree")(_u64(pointer))


# ---------------------------------------------------------------- open (daemon side)

#: allocations opened in this process: handle bytes -> [device address, users]. The
#: driver maps one allocation once per context, so a second registration of the same
#: handle shares the mapping (and the store then refuses it as memory it holds).
_OPENED: dict[bytes, list[int]] = {}
_OPEN_LOCK = threading.Lock()


class CudaIpcMemory(DeviceMemory):
    """A GPU allocation of another process, opened here from its IPC handle."""

    kind: ClassVar[str] = KIND

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
        """Open ``handle`` (:func:`export_allocation`'s text); the allocation must be
        exactly ``nbytes`` bytes. A device not on this host, a handle the driver
        refuses, or another size are refused, named, and nothing stays open."""
        uuid, raw = parse_handle(handle)
        drv = driver()
        ordinal = drv.ordinal_of(uuid)
        drv.use(ordinal)
        with _OPEN_LOCK:
            entry = _OPENED.get(raw)
            if entry is None:
                ptr = _u64(0)
                h = IpcHandle.from_buffer_copy(raw)
                rc = drv.fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")(
                    ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                )
                drv.check(rc, f"cuIpcOpenMemHandle(GPU {uuid})")
                entry = _OPENED[raw] = [int(ptr.value), 0]
            entry[1] += 1
        mem = cls(uuid, raw, ordinal, entry[0], nbytes)
        try:
            base, size = _u64(0), ctypes.c_size_t(0)
            rc = drv.fn("cuMemGetAddressRange_v2", "cuMemGetAddressRange")(
                ctypes.byref(base), ctypes.byref(size), _u64(entry[0])
            )
            drv.check(rc, "cuMemGetAddressRange(opened allocation)")
            if size.value != nbytes:
                raise ProtocolError(
                    f"cuda_ipc region refused: the allocation holds {size.value} bytes, "
                    f"expected {nbytes}; register the whole allocation"
                )
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
        return (KIND, self._uuid, self._address)

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
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _OPENED[self._raw]
        drv = driver()
        with contextlib.suppress(CudaError):
            drv.use(self._ordinal)
            drv.check(drv.lib.cuIpcCloseMemHandle(_u64(self._address)), "cuIpcCloseMemHandle")

    def __repr__(self) -> str:
        return f"CudaIpcMemory({self.name}, {self._size} bytes)"


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


# ---------------------------------------------------------------- copies


class CudaEngine(CopyEngine):
    """Copies to and from one GPU's memory on a stream of its own; one per device
    per process (:meth:`for_device`), made when the first allocation is opened."""

    kind: ClassVar[str] = KIND
    _by_device: ClassVar[dict[int, CudaEngine]] = {}

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self._drv = driver()
        self._drv.use(ordinal)
        s = _vp()
        self._drv.check(
            self._drv.lib.cuStreamCreate(ctypes.byref(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate"
        )
        self._stream = s
        self._lock = asyncio.Lock()
        #: host memory registered with the driver (page-locked): base address -> bytes
        self.pinned: dict[int, int] = {}

    @classmethod
    def for_device(cls, ordinal: int) -> CudaEngine:
        engine = cls._by_device.get(ordinal)
        if engine is None:
            engine = cls._by_device[ordinal] = cls(ordinal)
            add_engine(engine)
        return engine

    def moves(self, dst_kind: str, src_kind: str) -> bool:
        return {dst_kind, src_kind} <= {KIND, HOST} and KIND in (dst_kind, src_kind)

    # -- host registration

    def pin(self, memory: MappedMemory) -> None:
        """Register host ``memory`` with the driver once (in this thread's context):
        later copies to and from it run page-locked. A region the driver will not
        register is copied pageable (slower, never wrong)."""
        if memory.address in self.pinned:
            return
        # Whole pages: a mapping is page-granular, and its size (exact bytes) need not be.
        pages = -(-memory.size // mmap.PAGESIZE) * mmap.PAGESIZE
        rc = self._drv.fn("cuMemHostRegister_v2", "cuMemHostRegister")(
            _vp(memory.address), ctypes.c_size_t(pages), CU_MEMHOSTREGISTER_PORTABLE
        )
        if rc in (0, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            self.pinned[memory.address] = memory.size

    def forget_host(self, address: int) -> None:
        if self.pinned.pop(address, None) is not None:
            self._drv.use(self.ordinal)
            self._drv.check(self._drv.lib.cuMemHostUnregister(_vp(address)), "cuMemHostUnregister")

    # -- copying

    def copy_now(self, dst: int, src: int, nbytes: int) -> None:
        """One synchronous copy in this thread (unified addresses)."""
        self._drv.use(self.ordinal)
        self._drv.check(
            self._drv.lib.cuMemcpyAsync(
                _u64(dst), _u64(src), ctypes.c_size_t(nbytes), self._stream
            ),
            "cuMemcpyAsync",
        )
        self._drv.check(self._drv.lib.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    async def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[MappedMemory],
    ) -> None:
        async with self._lock:  # one batch on the stream at a time
            work = asyncio.ensure_future(
                asyncio.to_thread(self._copy_batch, dst.copy(), src.copy(), nbytes.copy(), host)
            )
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                # A copy on the device cannot be recalled: the caller may free the
                # memory the moment it returns, so wait for the batch, then cancel.
                while not work.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(work)
                raise

    def _copy_batch(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[MappedMemory],
    ) -> None:
        """Regular runs of reads (a strided block read row by row) as one 2-D copy
        each; then small GPU-to-GPU reads as one indexed gather; the rest one
        ``cuMemcpyAsync`` each; all on the engine's stream, synchronised."""
        self._drv.use(self.ordinal)
        for m in host:
            self.pin(m)
        left = np.ones(len(dst), dtype=bool)
        for start, count, dpitch, spitch in strided_runs(dst, src, nbytes):
            self._copy_2d(
                int(dst[start]), int(src[start]), int(nbytes[start]), count, dpitch, spitch, start
            )
            left[start : start + count] = False
        on_host = np.zeros(len(dst), dtype=bool)
        for m in host:
            lo, hi = m.address, m.address + m.size
            on_host |= ((lo <= dst) & (dst < hi)) | ((lo <= src) & (src < hi))
        aligned = ((dst | src | nbytes) % GATHER_UNIT) == 0
        small = left & ~on_host & aligned & (nbytes <= SMALL_PIECE)
        if int(small.sum()) <= 1:
            small[:] = False
        copy = self._drv.lib.cuMemcpyAsync
        for i in np.flatnonzero(left & ~small).tolist():
            rc = copy(
                _u64(int(dst[i])), _u64(int(src[i])), ctypes.c_size_t(int(nbytes[i])), self._stream
            )
            if rc != 0:
                self._drv.check(rc, f"cuMemcpyAsync of read #{i}", i)
        if small.any():
            self._gather(dst[small], src[small], nbytes[small])
        self._drv.check(self._drv.lib.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    def _copy_2d(
        self, dst: int, src: int, width: int, height: int, dpitch: int, spitch: int, first: int
    ) -> None:
        """``height`` rows of ``width`` bytes, ``spitch`` apart at ``src`` and ``dpitch``
        apart at ``dst`` (unified addresses), as one copy on the stream."""
        c = _Memcpy2D()
        c.srcMemoryType = c.dstMemoryType = CU_MEMORYTYPE_UNIFIED
        c.srcDevice, c.srcPitch = src, spitch
        c.dstDevice, c.dstPitch = dst, dpitch
        c.WidthInBytes, c.Height = width, height
        rc = self._drv.fn("cuMemcpy2DAsync_v2", "cuMemcpy2DAsync")(ctypes.byref(c), self._stream)
        self._drv.check(rc, f"cuMemcpy2DAsync of reads #{first}..#{first + height - 1}", first)

    def _gather(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        """Small GPU-to-GPU reads as one indexed copy (:func:`gather_units`) over the
        device address space they span."""
        import torch

        try:
            with torch.cuda.device(self.ordinal):
                lo = int(min(dst.min(), src.min()))
                hi = int(max((dst + nbytes).max(), (src + nbytes).max()))
                space = torch.as_tensor(_Span(lo, (hi - lo) // GATHER_UNIT), device="cuda")
                gather_units(space, lo, dst, src, nbytes)
                torch.cuda.current_stream().synchronize()
        except RuntimeError as exc:  # PyTorch reports CUDA errors as RuntimeError
            raise CudaError(f"indexed GPU gather of {len(dst)} reads failed: {exc}") from exc


def gather_units(
    space: torch.Tensor,
    base: int,
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (every one a
    multiple of :data:`GATHER_UNIT`, inside ``space``: int64 units of memory starting
    at address ``base``; reads validated, destinations disjoint) with one indexed copy
    on ``space``'s device. The indices are built there from one start and one count
    per read, so a 4 KiB read costs 24 bytes of upload, not a call of its own."""
    import torch

    dev = space.device
    counts = torch.from_numpy(nbytes // GATHER_UNIT).to(dev)
    d0 = torch.from_numpy((dst - base) // GATHER_UNIT).to(dev)
    s0 = torch.from_numpy((src - base) // GATHER_UNIT).to(dev)
    total = int(nbytes.sum()) // GATHER_UNIT
    first = torch.cumsum(counts, 0) - counts
    step = torch.arange(total, device=dev) - torch.repeat_interleave(
        first, counts, output_size=total
    )
    di = torch.repeat_interleave(d0, counts, output_size=total) + step
    si = torch.repeat_interleave(s0, counts, output_size=total) + step
    space[di] = space[si]


CU_MEMORYTYPE_UNIFIED = 4
MAX_PITCH = (1 << 31) - 1
"""Bytes: the widest row pitch a 2-D copy is given (the driver's limit is of this order)."""
MIN_RUN = 4
"""Reads: a regular run shorter than this is copied read by read."""


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` of the driver API (cuda.h), field for field."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


def strided_runs(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    min_count: int = MIN_RUN,
) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive reads that are one 2-D copy: ``(first read, count, dst
    pitch, src pitch)``, every read of a run ``nbytes`` long, each ``dst pitch``
    after the last at the destination and ``src pitch`` at the source, both pitches
    at least the width (rows do not overlap) and at most :data:`MAX_PITCH`. A pack
    spec read directly (a strided block, row by row) is one run. Runs shorter than
    ``min_count`` are not listed."""
    d, s, b = dst.tolist(), src.tolist(), nbytes.tolist()
    n, runs, i = len(d), [], 0
    while i < n:
        end = i + 1
        if end < n and b[end] == b[i] and b[i] > 0:
            dp, sp = d[end] - d[i], s[end] - s[i]
            if b[i] <= dp <= MAX_PITCH and b[i] <= sp <= MAX_PITCH:
                end += 1
                while (
                    end < n
                    and b[end] == b[i]
                    and d[end] - d[end - 1] == dp
                    and s[end] - s[end - 1] == sp
                ):
                    end += 1
                if end - i >= min_count:
                    runs.append((i, end - i, dp, sp))
                    i = end
                    continue
        i += 1
    return runs


class _Span:
    """``count`` int64 units of device memory at ``base``, as PyTorch imports it
    (``__cuda_array_interface__``): no copy, no ownership."""

    def __init__(self, base: int, count: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (count,),
            "typestr": "<i8",
            "data": (base, False),
            "version": 3,
            "strides": None,
        }
