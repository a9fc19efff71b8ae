"""Three tiny C helpers, built into the package when it is built (setup.py).

- ``_copy``: a batched memcpy the `local` transport calls with the GIL released,
  guarded: a bus error in it (a shared file shrunk under the mapping, a full tmpfs)
  ends that copy with an error instead of the process.
- ``_delta``: the delta refit's per-change kernels (``refitd.delta.native``): the
  source's comparison and encoding, the engine's placing and digest update, each
  one pass over the changes.
- ``_ucx``: the UCX RMA calls (mem map, rkey pack/unpack, batched GET + flush with a
  deadline) that ucxx's Python layer does not expose, built against the headers of
  the ``libucx`` wheel and linked (by soname, runpath into that wheel) to the same
  ``libucp`` ucxx loads.

They are extension modules only so that pip builds and installs them: their
functions are called through ctypes on the module's own file. Nothing is compiled
at run time and no compiler is needed. A libucp of another API version than the
headers the helper was built against, or two different libucp libraries in one
process, are refused with :class:`~refitd.errors.ConfigError` before any UCX call.
"""

from __future__ import annotations

import ctypes
import importlib
from functools import cache
from pathlib import Path
from types import ModuleType

from refitd.errors import ConfigError

__all__ = ["copy_lib", "delta_lib", "libucx_root", "loaded_libucp", "ucx_lib"]


def _extension(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:
        raise ConfigError(
            f"the native helper transports.native.{name} is not built ({exc}); it is "
            "compiled when the package is installed: reinstall refitd with pip (in a source "
            "checkout: make install)"
        ) from exc


def _cdll(name: str) -> ctypes.CDLL:
    path = _extension(name).__file__
    assert path is not None
    return ctypes.CDLL(path)


@cache
def copy_lib() -> ctypes.CDLL:
    lib = _cdll("_copy")
    p = ctypes.c_void_p
    lib.rfx_copy_batch.argtypes = [ctypes.c_int64, p, p, p]
    lib.rfx_copy_batch.restype = None
    lib.rfx_copy_batch_guarded.argtypes = [ctypes.c_int64, p, p, p, p]
    lib.rfx_copy_batch_guarded.restype = ctypes.c_int64
    i64 = ctypes.c_int64
    lib.rfx_gather_guarded.argtypes = [i64, p, p, i64, i64, i64, p]
    lib.rfx_gather_guarded.restype = ctypes.c_int64
    lib.rfx_pvr_batch.argtypes = [ctypes.c_int64, ctypes.c_int64, p, p, p]
    lib.rfx_pvr_batch.restype = ctypes.c_int
    return lib


@cache
def delta_lib() -> ctypes.CDLL:
    lib = _cdll("_delta")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    sig: dict[str, tuple[list[object], object]] = {
        "rfx_lanes": ([i64, p, p], None),
        "rfx_compare": ([i64, p, p, i64, p, p, p, p], i64),
        "rfx_compare_pieces": ([i64, p, p, p, p, i64, p, p, p, p, p, p], i64),
        "rfx_encode": ([i64, p, p, p, p, p, p, i64, i64, p, i64, p, p, p, i64, p], i64),
        "rfx_place": ([i64, p, p, i64, p, p, i64, i64, p, p, i64, p, i64, p, p, p, i64], i64),
        "rfx_place_write": (
            [i64, p, p, i64, p, p, i64, i64, p, p, i64, p, i64, p, p, i64, p, i64, i64],
            i64,
        ),
        "rfx_scatter": ([i64, p, p, i64, p], None),
        "rfx_digest_update": ([i64, p, p, p, i64, i64, i64, p], i64),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


def libucx_root() -> Path:
    """The libucx wheel's directory (headers in include/, libraries in lib/)."""
    import libucx

    return Path(libucx.__file__).parent


def loaded_libucp() -> set[str]:
    """Paths of every libucp mapped into this process (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {
        line.split(maxsplit=5)[-1].strip()
        for line in maps.splitlines()
        if "/libucp.so" in line and len(line.split()) >= 6
    }


def check_versions(loaded: tuple[int, int, int], built_api: int, built_wheel: str) -> None:
    """Refuse a libucp whose API version is not the one the helper was built for.

    ``loaded`` is ``ucp_get_version``'s (major, minor, release); ``built_api`` is
    ``(major << 16) | minor`` from the build's headers; ``built_wheel`` names them."""
    built = (built_api >> 16, built_api & 0xFFFF)
    if tuple(loaded[:2]) != built:
        raise ConfigError(
            f"UCX version mismatch refused: the loaded libucp is {'.'.join(map(str, loaded))} "
            f"but transports.native._ucx was built against UCX {built[0]}.{built[1]} "
            f"(libucx wheel {built_wheel}); struct layouts would not match. Install the "
            "libucx-cu12 version refitd was built with, or rebuild refitd against the "
            "loaded one (pip install --force-reinstall --no-binary refitd)"
        )


@cache
def ucx_lib() -> ctypes.CDLL:
    """The UCX helper, bound to the libucp instance ucxx loads.

    The libucx wheel's libraries are loaded first (as ucxx does, by soname), so the
    helper's dependency is satisfied by that same instance. Refuses (ConfigError) a
    loaded libucp of another API version than the build's, or two different libucp
    libraries mapped at once."""
    try:
        import libucx

        libucx.load_library()
    except ImportError as exc:
        raise ConfigError(f"the libucx-cu12 wheel is not installed ({exc})") from exc
    lib = _cdll("_ucx")
    paths = loaded_libucp()
    real = {str(Path(p).resolve()) for p in paths}
    if len(real) > 1:
        raise ConfigError(
            "two different libucp libraries are loaded in one process, refused: "
            + ", ".join(sorted(real))
            + " (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY and LD_LIBRARY_PATH must agree)"
        )
    p, i64, u = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint
    c_int, sz = ctypes.c_int, ctypes.c_size_t
    sig: dict[str, list[object]] = {
        "rfx_version": [ctypes.POINTER(u)] * 3,
        "rfx_mem_map": [p, p, sz, ctypes.POINTER(p)],
        "rfx_mem_unmap": [p, p],
        "rfx_rkey_pack": [p, p, p, sz, ctypes.POINTER(sz)],
        "rfx_rkey_unpack": [p, p, ctypes.POINTER(p)],
        "rfx_worker_efd": [p, ctypes.POINTER(c_int)],
        "rfx_idle": [p, c_int, c_int, c_int],
        # ..., deadline (CLOCK_MONOTONIC ns, absolute), *posted
        "rfx_get_batch": [p, c_int, p, i64, p, p, p, p, i64, ctypes.POINTER(i64)],
        "rfx_timed_out": [],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    lib.rfx_rkey_destroy.argtypes = [p]
    lib.rfx_rkey_destroy.restype = None
    lib.rfx_built_libucx.argtypes = []
    lib.rfx_built_libucx.restype = ctypes.c_char_p
    major, minor, release = u(), u(), u()
    built_api = lib.rfx_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    check_versions(
        (major.value, minor.value, release.value),
        built_api,
        lib.rfx_built_libucx().decode(),
    )
    return lib
