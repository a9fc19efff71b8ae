"""Which UCX transports this host's UCX can use: ``ucx_info -d``, parsed.

The data plane loads the libucx wheel's UCX unless
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` asks the wheel to load the system's
(a UCX built with verbs/rdmacm for InfiniBand or RoCE). :func:`ucx_transports` runs
the ``ucx_info`` of the same library, with the same environment (``UCX_TLS``,
``UCX_NET_DEVICES`` ... apply), and lists every transport and device it reports,
e.g. ``["cma/memory", "posix/memory", "rc_verbs/mlx5_0:1", "tcp/eth0"]``. The wheel
from PyPI has no verbs: between hosts it is tcp.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

__all__ = ["RDMA_TRANSPORTS", "parse_ucx_info", "ucx_transports"]

RDMA_TRANSPORTS = ("rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5", "rdmacm")
"""Transport names that mean RDMA (InfiniBand / RoCE) is usable."""

PREFER_SYSTEM = "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"


def parse_ucx_info(text: str) -> list[str]:
    """``transport/device`` for every ``Transport:`` line of ``ucx_info -d`` and the
    ``Device:`` line after it, sorted and without duplicates."""
    out: set[str] = set()
    transport = ""
    for line in text.splitlines():
        body = line.lstrip("#").strip()
        if body.startswith("Transport:"):
            transport = body.split(":", 1)[1].strip()
        elif body.startswith("Device:") and transport:
            out.add(f"{transport}/{body.split(':', 1)[1].strip()}")
            transport = ""
    return sorted(out)


def _command() -> tuple[list[str], dict[str, str]] | None:
    env = dict(os.environ)
    if env.get(PREFER_SYSTEM, "").lower() in ("1", "true", "yes", "on"):
        system = shutil.which("ucx_info")
        if system is not None:
            return [system, "-d"], env
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_info"
    if not exe.is_file():
        return None
    lib = str(root / "lib")
    env["LD_LIBRARY_PATH"] = lib + (
        ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""
    )
    return [str(exe), "-d"], env


async def ucx_transports(timeout_s: float = 20.0) -> list[str]:
    """Every ``transport/device`` the UCX the data plane loads can use here; empty
    when no ``ucx_info`` is found or it fails (the daemon still runs)."""
    found = _command()
    if found is None:
        return []
    argv, env = found
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
        )
    except OSError:
        return []
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # stuck: it is not left running behind the daemon
        await proc.wait()
        return []
    return parse_ucx_info(out.decode(errors="replace"))
