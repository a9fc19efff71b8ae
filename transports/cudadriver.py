"""The CUDA driver API through ctypes: loaded, initialised and asked, for `transports.cuda`.

``libcuda.so.1`` is what every host with an NVIDIA driver has, so refitd needs no
CUDA toolkit and no Python CUDA package. Nothing runs at import: :func:`missing`
loads the driver and lists devices (no context), and a device's primary context
(the one PyTorch uses) is retained only when first used, and made current only
for the block of :meth:`_Driver.current` (pushed, then popped: a caller's thread
keeps its own context).

NOTE: never run on a GPU yet; its first run is ``tests/gpu/run-on-device.sh``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator

from refitd.errors import NotFoundError

from .memory import DeviceFault

__all__ = ["LIBCUDA", "CudaError", "IpcHandle", "device_count", "driver", "missing"]

LIBCUDA = "libcuda.so.1"

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p


# Byte arrays, not c_char ones: a c_char array field reads and writes as a
# NUL-terminated string, and handles and UUIDs hold zero bytes.
class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CudaError(DeviceFault):
    """A CUDA driver call failed; the message names the call and the error."""

    def __init__(self, message: str, code: int = 0, index: int = -1) -> None:
        super().__init__(message, index)
        self.code = code


# ---------------------------------------------------------------- the driver


class _Driver:
    """``libcuda.so.1`` loaded and initialised (once per process)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(LIBCUDA)
        self.check(self.lib.cuInit(0), "cuInit")
        self._lock = threading.Lock()
        self._contexts: dict[int, int] = {}

    def fn(self, *names: str) -> Callable[..., int]:
        """The first of ``names`` the driver exports (a ``_v2`` before its original)."""
        for n in names:
            f = getattr(self.lib, n, None)
            if f is not None:
                f.restype = ctypes.c_int
                return f  # type: ignore[no-any-return]
        raise CudaError(f"the CUDA driver exports none of {', '.join(names)}")

    def error(self, rc: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        self.lib.cuGetErrorString(rc, ctypes.byref(text))
        n = (name.value or b"CUDA_ERROR").decode(errors="replace")
        t = (text.value or b"").decode(errors="replace")
        return f"{n} ({rc}): {t}"

    def check(self, rc: int, what: str, index: int = -1) -> None:
        if rc != 0:
            raise CudaError(f"{what} failed: {self.error(rc)}", rc, index)

    def batch_copy(self) -> Callable[..., int] | None:
        """``cuMemcpyBatchAsync`` in its CUDA 12.8 form (with the failed index; the
        driver keeps that symbol when a ``_v2`` without it is added), or None where
        the driver is older."""
        if not hasattr(self, "_batch"):
            f = getattr(self.lib, "cuMemcpyBatchAsync", None)
            if f is not None:
                f.restype = ctypes.c_int
            self._batch: Callable[..., int] | None = f
        return self._batch

    def count(self) -> int:
        n = ctypes.c_int(0)
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def uuid(self, ordinal: int) -> str:
        dev = ctypes.c_int(0)
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        u = _Uuid()
        rc = self.fn("cuDeviceGetUuid_v2", "cuDeviceGetUuid")(ctypes.byref(u), dev)
        self.check(rc, "cuDeviceGetUuid")
        return bytes(u.bytes).hex()

    def ordinal_of(self, uuid: str) -> int:
        for i in range(self.count()):
            if self.uuid(i) == uuid:
                return i
        raise NotFoundError(f"GPU {uuid} is not a device of this host")

    def context(self, ordinal: int) -> int:
        """Device ``ordinal``'s primary context (the one PyTorch uses), retained the
        first time it is asked for (that is when it is created)."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int(0)
                self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
                c = _vp()
                self.check(
                    self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev),
                    "cuDevicePrimaryCtxRetain",
                )
                ctx = self._contexts[ordinal] = int(c.value or 0)
            return ctx

    @contextlib.contextmanager
    def current(self, ordinal: int) -> Iterator[None]:
        """Device ``ordinal``'s primary context current in this thread for the block,
        and the thread's own context (or none) current again after it: pushed and
        popped, never set, so a caller's thread (a trainer's, the garbage
        collector's) keeps the context it had."""
        ctx = self.context(ordinal)
        self.check(self.fn("cuCtxPushCurrent_v2", "cuCtxPushCurrent")(_vp(ctx)), "cuCtxPushCurrent")
        try:
            yield
        finally:
            out = _vp()
            self.fn("cuCtxPopCurrent_v2", "cuCtxPopCurrent")(ctypes.byref(out))

    def current_context(self) -> int:
        """The context current in this thread (0: none)."""
        c = _vp()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
        return int(c.value or 0)


_MADE: list[_Driver] = []
_MAKING = threading.Lock()


def driver() -> _Driver:
    """The process's one driver, loaded and initialised by the first caller (any
    thread: the daemon opens GPU memory in worker threads, several at once)."""
    with _MAKING:
        if not _MADE:
            _MADE.append(_Driver())
        return _MADE[0]


def missing() -> str | None:
    """Why this process cannot use a CUDA device, or None when it can (the driver
    loads, initialises and lists at least one device). Creates no context."""
    try:
        drv = driver()
    except OSError as exc:
        return f"no CUDA driver here ({LIBCUDA} does not load: {exc})"
    except CudaError as exc:
        return f"the CUDA driver does not initialise: {exc}"
    try:
        n = drv.count()
    except CudaError as exc:
        return f"no CUDA device here: {exc}"
    return None if n > 0 else "no CUDA device here (the driver lists none)"


def device_count() -> int:
    """CUDA devices of this host (0 where :func:`missing` says why)."""
    return 0 if missing() is not None else driver().count()
