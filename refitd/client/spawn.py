"""Start a ``refitd serve`` child process and learn its address (tests, demo, bench).

The child prints one JSON ready line once its listener and data plane are up;
:func:`spawn_daemon` reads that line (no polling) and, on exit, sends SIGTERM and
waits for the child's orderly shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from refitd.errors import TransportError

__all__ = ["SpawnedDaemon", "serve_command", "spawn_daemon"]


@dataclass(frozen=True)
class SpawnedDaemon:
    url: str
    node_id: str
    pid: int


def serve_command(*options: str) -> list[str]:
    """The argv that runs ``refitd serve OPTIONS`` with this interpreter (so a child
    sees the same installed refitd as its parent, virtualenv or not)."""
    return [sys.executable, "-m", "refitd.cli", "serve", *options]


@contextlib.asynccontextmanager
async def spawn_daemon(
    *,
    secret_file: str,
    transport: str = "auto",
    node_id: str = "",
    unix_path: str | None = None,
    start_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    log_level: str = "warning",
    host: str | None = None,
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    peers: Sequence[str] = (),
) -> AsyncIterator[SpawnedDaemon]:
    """Run a daemon on ``127.0.0.1:0`` in a child process for the ``with`` block.

    Its logs (stderr, inherited) are kept to ``log_level`` and above, so a demo's
    console is not flooded with access lines. ``host`` binds another address (it
    then needs ``server.token_file``, e.g. through ``extra_args``), ``extra_args``
    are more ``refitd serve`` options, and ``prefix`` wraps the command (e.g. an
    ``nsenter`` into a simulated host, see :mod:`refitd.bench.simhosts`). ``peers``
    are the base URLs of the daemons it may read from (``[peers] allow``)."""
    argv = serve_command(
        "--port",
        "0",
        "--transport",
        transport,
        "--secret-file",
        secret_file,
        "--grace",
        "2",
        "--set",
        f"logging.level={log_level}",
    )
    if node_id:
        argv += ["--node-id", node_id]
    if unix_path:
        argv += ["--unix", unix_path]
    if host:
        argv += ["--host", host]
    if peers:
        argv += ["--set", "peers.allow=" + ",".join(peers)]
    argv += list(extra_args)
    proc = await asyncio.create_subprocess_exec(
        *prefix,
        *argv,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    try:
        try:
            async with asyncio.timeout(start_timeout_s):
                line = await proc.stdout.readline()
        except TimeoutError:
            raise TransportError(
                f"daemon {node_id!r} did not report ready in {start_timeout_s}s: check its log on "
                "stderr, and raise start_timeout_s if it is only slow"
            ) from None
        if not line:
            code = await proc.wait()
            raise TransportError(
                f"daemon {node_id!r} exited with status {code} before ready: its log on "
                "stderr says why"
            )
        record = json.loads(line)
        yield SpawnedDaemon(record["url"], record["node_id"], record["pid"])
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
