"""Simulated hosts for the multi-host tests (see :mod:`refitd.bench.simhosts`).

Each host is a network namespace plus a mount namespace with its own ``/dev/shm``,
joined by a bridge inside a namespace of the test's own; each runs a real ``refitd
serve`` on its own address. The tests need root, ``ip`` (iproute2), ``unshare``,
``nsenter`` and ``mount``; without them every test here skips with one line saying
which is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from refitd.bench.simhosts import Cluster, SimHost, SimNet, missing

__all__ = ["MISSING", "cluster_of", "needs_hosts", "sent_over", "tx_bytes"]

MISSING = missing()

needs_hosts = pytest.mark.skipif(MISSING is not None, reason=f"no simulated hosts: {MISSING}")


@contextlib.asynccontextmanager
async def cluster_of(workdir: Path, *names: str) -> AsyncIterator[tuple[Cluster, list]]:
    """A fresh bridge with hosts ``names`` and a :class:`Cluster` on them; everything
    (daemons, workers, namespaces) is gone when the block ends, pass or fail."""
    async with SimNet() as net:
        hosts = [await net.add_host(n) for n in names]
        async with Cluster(net, str(workdir)) as cluster:
            yield cluster, hosts


async def tx_bytes(host: SimHost) -> int:
    """Bytes ``host`` has sent on its link (the sysfs counter of its namespace): what
    crossed the simulated network, as opposed to any path through the shared kernel."""
    proc = await host.exec(
        "cat", "/sys/class/net/eth0/statistics/tx_bytes", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return int(out)


async def sent_over(
    host: SimHost, since: int, nbytes: int, unless: asyncio.Future[object], poll_s: float = 0.05
) -> bool:
    """Wait until ``host`` has sent over ``nbytes`` on its link past its counter
    ``since`` (True), or until ``unless`` is done first (False): a transfer that ended
    or failed before that many bytes crossed is seen at once, not as a timeout. The
    counter is read every ``poll_s`` s, not back to back (each read is a process)."""
    while not unless.done():
        if await tx_bytes(host) - since > nbytes:
            return True
        await asyncio.wait({unless}, timeout=poll_s)
    return False
