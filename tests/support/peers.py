"""A peer in a process of its own: ``python -m transports.servepeer``, for fault tests
that kill or stop it while this process reads from it (over the cma path)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from transports.interface import PeerInfo
from transports.segments import SHM_DIR, cleanup_stale
from transports.servepeer import SECRET_ENV


@asynccontextmanager
async def peer_process(
    seed: int, size: int, secret: bytes, scheme: str = "ucx"
) -> AsyncIterator[tuple[asyncio.subprocess.Process, PeerInfo]]:
    """Start a serving peer (transport ``scheme``) of one ``size``-byte region filled
    from ``seed``; yield the
    process and its signed record. On exit it is asked to stop (or killed after 30 s),
    and a killed peer's segment must be gone after the crash cleanup."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "transports.servepeer", "--size", str(size), "--seed", str(seed),
        "--scheme", scheme,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env=dict(os.environ, **{SECRET_ENV: secret.hex()}),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        yield proc, PeerInfo.decode(bytes.fromhex(line.decode()))
    finally:
        if proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()  # asks the peer to shut down cleanly
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
        await proc.wait()
        await asyncio.to_thread(cleanup_stale)
        assert not list(SHM_DIR.glob(f"refitd.{proc.pid}.*")), (
            "a dead peer's segment survived cleanup"
        )
