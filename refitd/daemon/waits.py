"""Long polls: how long one request may wait, and how many one principal holds open.

A long poll (``/ready``, a pull's ``/wait``, a delta record's ``wait``, a drain) holds
its request, its connection (a file descriptor) and a task of the daemon until it is
answered. Without a bound on how many one principal holds at once, one tenant opening
thousands of them would spend the daemon's descriptors, and the other tenants' next
connection (and the next segment the daemon opens) would be refused. A client that
disconnects leaves its wait running until it is answered or its timeout passes, so
the timeouts are bounded too (:data:`MAX_WAIT_S`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from aiohttp import web

from refitd.errors import QuotaExceeded

__all__ = ["MAX_WAITS_PER_PRINCIPAL", "MAX_WAIT_S", "WAITS", "Waits"]

MAX_WAIT_S = 60.0
"""The longest a long poll holds its request, s (a longer ``timeout`` is cut to it): a
client waiting longer asks again."""

MAX_WAITS_PER_PRINCIPAL = 64
"""Long polls one principal holds open at once (429 past it). An engine waits for
one pull per rank, a trainer for one version: far fewer."""


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
                f"the most one principal may ({self.limit}); wait for one to be answered"
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
