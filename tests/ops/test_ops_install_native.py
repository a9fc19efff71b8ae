"""The C helpers are built with the package; at run time nothing compiles.

Issue 13: they were compiled at first use into the venv or ~/.cache, so a service
with a read-only prefix and home, or a host without a compiler, could not start its
data plane, and the daemon reported only "exit status -9"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from refitd.errors import ConfigError
from transports.native import check_versions

ROOT = Path(__file__).resolve().parents[2]


def _bare_env(home: Path) -> dict[str, str]:
    """No compiler reachable (empty PATH, no CC) and an unwritable home."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH", "HOME")}
    env["PATH"] = str(home / "nothing-here")
    env["HOME"] = str(home)
    return env


def test_both_helpers_are_prebuilt_abi3_extension_modules() -> None:
    import libucx

    # An editable checkout's _ucx sits outside site-packages, so its runpath into the
    # libucx wheel does not reach; libucp is found by soname once loaded, as in ucx_lib.
    libucx.load_library()
    import transports.native._copy as copy_ext
    import transports.native._ucx as ucx_ext

    for mod in (copy_ext, ucx_ext):
        assert mod.__file__ is not None and mod.__file__.endswith(".abi3.so")
    assert not list((ROOT / "transports" / "native").glob("*.c.so"))


def test_the_helpers_load_and_a_ucx_pull_runs_with_no_compiler_and_a_read_only_home(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    script = """
import asyncio
from transports.checks import check_scattered_batch, open_pair
from transports.native import loaded_libucp

async def main():
    for scheme in ("local", "ucx"):  # local: the _copy helper; ucx: _ucx in a child
        async with open_pair(scheme, 1 << 20, 1 << 20) as pair:
            await check_scattered_batch(pair)

asyncio.run(main())
print("ok", len(loaded_libucp()))
"""
    proc = subprocess.run(
        [sys.executable, "-P", "-c", script],
        env=_bare_env(home),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "0"]  # the owner process never mapped libucp
    assert list(home.iterdir()) == []  # nothing cached in the home


def test_a_libucp_of_another_api_version_is_refused_naming_both() -> None:
    check_versions((1, 21, 3), (1 << 16) | 21, "1.21.0")  # a newer release: same layouts
    with pytest.raises(ConfigError) as err:
        check_versions((1, 19, 0), (1 << 16) | 21, "1.21.0")
    text = str(err.value)
    assert "UCX version mismatch refused" in text
    assert "1.19.0" in text and "UCX 1.21" in text and "libucx wheel 1.21.0" in text


def test_the_loaded_libucp_matches_the_build() -> None:
    script = (
        "import ctypes; from transports.native import ucx_lib; lib = ucx_lib(); "
        "u = [ctypes.c_uint() for _ in range(3)]; "
        "api = lib.rfx_version(*map(ctypes.byref, u)); "
        "print(api >> 16, api & 0xffff, *(x.value for x in u), lib.rfx_built_libucx().decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    import libucx

    wheel = (Path(libucx.__file__).parent / "VERSION.txt").read_text().strip()
    assert out[:2] == out[2:4]  # built API major.minor == loaded major.minor
    assert out[5] == wheel


def test_two_different_libucp_libraries_in_one_process_are_refused(tmp_path: Path) -> None:
    import libucx

    lib = Path(libucx.__file__).parent / "lib" / "libucp.so.0"
    other = tmp_path / "libucp.so.0"
    other.write_bytes(lib.read_bytes())
    script = (
        "import ctypes, libucx; libucx.load_library(); "
        f"ctypes.CDLL({str(other)!r}, ctypes.RTLD_LOCAL); "
        "from transports.native import ucx_lib; ucx_lib()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "two different libucp libraries are loaded in one process, refused" in proc.stderr
    assert str(other) in proc.stderr


def test_a_data_plane_child_that_dies_at_start_tells_the_log_and_the_exit_message(
    tmp_path: Path,
) -> None:
    # A real start failure of the child: UCX finds no transport it may use.
    env = dict(os.environ, UCX_TLS="no-such-transport")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "refitd"), "serve", "--port", "0", "--transport", "ucx"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("refitd serve: failed to start: ")
    assert "UCXXNoDeviceError: No such device" in last  # the child's own words
    assert "exit status 1" in last and "-9" not in last
    log = proc.stderr
    assert "refitd.dataplane: data-plane process" in log  # its traceback, in the log
    assert "ERROR refitd: failed to start:" in log
    assert '"event": "ready"' not in proc.stdout
