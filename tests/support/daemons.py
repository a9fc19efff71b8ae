"""Driving daemons in the test's own process: serve them on loopback, and two fakes.

The fakes, a settable clock and a gated copier, implement the daemon's own
interfaces (the ``clock`` callable and :class:`transports.local.Copier`);
everything else is real: HTTP on 127.0.0.1:0, shared memory, the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import numpy.typing as npt

from refitd.client.http import RefitClient
from refitd.daemon.node import Daemon
from refitd.daemon.process import listening
from transports.local import copy_addresses


@contextlib.asynccontextmanager
async def serving_daemons(*daemons: Daemon) -> AsyncIterator[list[RefitClient]]:
    """Serve each daemon on 127.0.0.1:0 for the block; yields one client per daemon.

    Each daemon trusts every other as a peer (as ``[peers] allow`` listing them
    would), so any of them may read from any other."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        urls = []
        for d in daemons:
            _, url = await stack.enter_async_context(listening(d.options, daemon=d))
            urls.append(url)
            clients.append(await stack.enter_async_context(RefitClient(url)))
        for d, own in zip(daemons, urls, strict=True):
            d.peers.replace("test", [u for u in urls if u != own])
        yield clients


class FakeClock:
    """A clock in seconds that moves only when the test sets or advances ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class GatedCopier:
    """A real copy (the data plane's own engine, on the loop) that first waits for
    the test to open ``gate``; ``entered`` is set once a copy is waiting there. It is
    the daemon's same-host copy engine (:class:`transports.local.Copier`): every
    pull a daemon makes from itself or a peer on this host ends in it.

    This is the only way to hold a pull "mid-flight" deterministically: a real memory
    copy cannot be made to pause at a chosen point."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        self.entered.set()
        await self.gate.wait()
        await copy_addresses(dst, src, nbytes, threads=1, pool=None)
