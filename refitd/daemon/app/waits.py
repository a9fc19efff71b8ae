"""Long polls: how long one request may wait, and how many one principal holds open.

A long poll (``/ready``, a pull's ``/wait``, a delta record's ``wait``, a mirror's
state with ``after=``, a drain) holds
its request, its connection (a file descriptor) and a task of the daemon until it is
answered. Without a bound on how many one principal holds at once, one tenant opening
thousands of them would spend the daemon's descriptors, and the other tenants' next
connection (and the next segment the daemon opens) would be refused. The timeouts are
bounded too (:data:`MAX_WAIT_S`: a route's ``Wait`` parameter is cut to it as
:mod:`refitd.wire.args` decodes it), and a wait whose client has gone ends within
:data:`GONE_CHECK_S` and gives its place back (:func:`long_poll`): a tenant that opens
and drops long polls in a loop never holds more than it has open.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from aiohttp import web

from refitd.daemon.access.auth import principal_of
from refitd.errors import QuotaExceeded
from refitd.wire.args import MAX_WAIT_S  # declared with the parameters it cuts

__all__ = ["GONE_CHECK_S", "MAX_WAITS_PER_PRINCIPAL", "MAX_WAIT_S", "WAITS", "Waits", "long_poll"]

MAX_WAITS_PER_PRINCIPAL = 64
"""Long polls one principal holds open at once by default (429 past it;
``limits.max_long_polls_per_principal``). An engine waits for one pull per rank, a
trainer for one version: far fewer."""

GONE_CHECK_S = 0.5
"""How often a long poll looks whether its client is still connected, s. aiohttp
tells a handler nothing when its client goes (cancelling every handler on a
disconnect, ``handler_cancellation``, would also cut a publish or a pull submit in
the middle), so only the waits look."""


class Waits:
    """The long polls each principal holds open now."""

    def __init__(self, limit: int = MAX_WAITS_PER_PRINCIPAL) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def open(self, principal: str) -> int:
        """How many long polls ``principal`` holds open now."""
        return self._open.get(principal, 0)

    @contextlib.contextmanager
    def held(self, principal: str, what: str) -> Iterator[None]:
        """Count one long poll of ``principal`` (``what`` names it) for the block;
        refused (:class:`QuotaExceeded`, 429) when it already holds :attr:`limit`."""
        n = self._open.get(principal, 0)
        if n >= self.limit:
            raise QuotaExceeded(
                f"{what} refused: principal {principal!r} already holds {n} long polls open, "
                f"the most one principal may (limits.max_long_polls_per_principal = "
                f"{self.limit}); wait for one to be answered"
            )
        self._open[principal] = n + 1
        try:
            yield
        finally:
            left = self._open[principal] - 1
            if left:
                self._open[principal] = left
            else:
                del self._open[principal]


WAITS: web.AppKey[Waits] = web.AppKey("waits", Waits)


@contextlib.asynccontextmanager
async def long_poll(request: web.Request, what: str) -> AsyncIterator[None]:
    """Hold ``request`` as one long poll of its principal (``what`` names it) for the
    block: counted against :data:`MAX_WAITS_PER_PRINCIPAL` (429 past it), and ended
    (the handler cancelled, its place given back) within :data:`GONE_CHECK_S` of its
    client disconnecting. Only waiting belongs in the block: what it changes is
    changed before it or after it."""
    with request.app[WAITS].held(principal_of(request).name, what):
        handler = asyncio.current_task()
        assert handler is not None, "a long poll runs in its request's task"
        watcher = asyncio.create_task(_cancel_when_gone(request, handler))
        try:
            yield
        finally:
            watcher.cancel()


async def _cancel_when_gone(request: web.Request, handler: asyncio.Task[object]) -> None:
    """Cancel ``handler`` once ``request``'s connection is closed."""
    while True:
        await asyncio.sleep(GONE_CHECK_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            handler.cancel(f"the client of {request.method} {request.path} disconnected")
            return
