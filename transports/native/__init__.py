"""Two tiny C helpers, compiled with the system C compiler at first use and cached.

- ``copy``: a batched memcpy the `local` transport calls with the GIL released.
- ``ucx``: the UCX RMA calls (mem map, rkey pack/unpack, batched GET + flush) that
  ucxx's Python layer does not expose, compiled against the headers shipped in the
  ``libucx`` wheel and linked to the same ``libucp`` ucxx loads.

Builds land in ``<venv>/var/cache/refitd-native/`` (or ``~/.cache/refitd/native`` when
the environment is read-only), keyed by a hash of the source and flags; a build is
written to a temporary name and renamed, so concurrent first uses are safe.
Requirement: a C compiler (``cc``, or ``$CC``) on the machine.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from refitd.errors import ConfigError

__all__ = ["build", "copy_lib", "libucx_root", "ucx_lib"]

_HERE = Path(__file__).parent


def _cache_dirs() -> list[Path]:
    return [
        Path(sys.prefix) / "var" / "cache" / "refitd-native",
        Path.home() / ".cache" / "refitd" / "native",
    ]


def build(source: str, extra: list[str]) -> Path:
    """Compile ``source`` (a file next to this module) into a cached shared library."""
    src = (_HERE / source).read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ConfigError(
            f"building transports/native/{source} refused: no C compiler (set CC or install cc)"
        )
    flags = ["-O2", "-shared", "-fPIC", "-Wall", *extra]
    key = hashlib.sha256(src + "\0".join([cc, *flags]).encode()).hexdigest()[:16]
    errors = []
    for root in _cache_dirs():
        out = root / f"{Path(source).stem}-{key}.so"
        if out.exists():
            return out
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
            os.close(fd)
        except OSError as exc:
            errors.append(f"{root}: {exc}")
            continue
        proc = subprocess.run(
            [cc, *flags[:4], str(_HERE / source), "-o", tmp, *flags[4:]],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            os.unlink(tmp)
            raise ConfigError(
                f"compiling transports/native/{source} failed:\n{proc.stderr.strip()}"
            )
        os.replace(tmp, out)
        return out
    raise ConfigError(
        f"building transports/native/{source} refused: no writable cache ({'; '.join(errors)})"
    )


@cache
def copy_lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build("copy.c", [])))
    p = ctypes.c_void_p
    lib.rfx_copy_batch.argtypes = [ctypes.c_int64, p, p, p]
    lib.rfx_copy_batch.restype = None
    lib.rfx_pvr_batch.argtypes = [ctypes.c_int64, ctypes.c_int64, p, p, p]
    lib.rfx_pvr_batch.restype = ctypes.c_int
    return lib


def libucx_root() -> Path:
    """The libucx wheel's directory (headers in include/, libraries in lib/)."""
    import libucx

    return Path(libucx.__file__).parent


@cache
def ucx_lib() -> ctypes.CDLL:
    """The UCX helper, bound to the libucp instance already loaded by ucxx.

    Import ucxx first: it loads libucp, and the dynamic loader then satisfies the
    helper's dependency with that same instance (matched by soname).
    """
    root = libucx_root()
    # The wheel's version joins the cache key: new headers must mean a new build.
    stamp = root / "VERSION.txt"
    version = stamp.read_text().strip() if stamp.exists() else "unknown"
    path = build(
        "ucx.c",
        [
            f'-DRFX_LIBUCX_VERSION="{version}"',
            f"-I{root / 'include'}",
            f"-L{root / 'lib'}",
            f"-Wl,-rpath,{root / 'lib'}",
            "-lucp",
            "-lucs",
        ],
    )
    lib = ctypes.CDLL(str(path))
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
        "rfx_get_batch": [p, c_int, p, i64, p, p, p, p, ctypes.POINTER(i64)],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    lib.rfx_rkey_destroy.argtypes = [p]
    lib.rfx_rkey_destroy.restype = None
    return lib
