"""Builds the three C helpers of transports/native into the package.

Metadata lives in pyproject.toml; this file only declares the extension modules:

- ``transports.native._copy``: the batched memcpy of the ``local`` transport.
- ``transports.native._delta``: the delta refit's per-change kernels (compare, encode,
  place, digest update), one pass over the changes where numpy made a dozen.
- ``transports.native._ucx``: the UCX RMA calls, compiled against the headers of the
  ``libucx`` wheel (a build requirement) and linked with a runpath into that wheel as
  installed next to this package (``site-packages/libucx/lib``), the way ucxx links.

All use the limited C API (abi3): one wheel serves every CPython >= 3.11. Nothing
is compiled at run time.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup


def _libucx() -> tuple[Path, str]:
    import libucx  # the libucx-cu12 wheel named in [build-system] requires

    root = Path(libucx.__file__).parent
    stamp = root / "VERSION.txt"
    return root, stamp.read_text().strip() if stamp.exists() else "unknown"


def _extensions() -> list[Extension]:
    root, version = _libucx()
    limited = [("Py_LIMITED_API", "0x030B0000")]
    return [
        Extension(
            "transports.native._copy",
            ["transports/native/copy.c"],
            define_macros=limited,
            extra_compile_args=["-O2", "-Wall"],
            py_limited_api=True,
        ),
        Extension(
            "transports.native._delta",
            ["transports/native/delta.c"],
            define_macros=limited,
            extra_compile_args=["-O3", "-Wall"],
            py_limited_api=True,
        ),
        Extension(
            "transports.native._ucx",
            ["transports/native/ucx.c"],
            define_macros=[*limited, ("RFX_LIBUCX_VERSION", f'"{version}"')],
            include_dirs=[str(root / "include")],
            library_dirs=[str(root / "lib")],
            libraries=["ucp", "ucs"],
            # site-packages/transports/native/_ucx.abi3.so -> site-packages/libucx/lib
            runtime_library_dirs=["$ORIGIN/../../libucx/lib"],
            extra_compile_args=["-O2", "-Wall"],
            py_limited_api=True,
        ),
    ]


setup(ext_modules=_extensions(), options={"bdist_wheel": {"py_limited_api": "cp311"}})
