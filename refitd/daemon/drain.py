"""Waiting for a version's leases to drain, on events, never by polling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from refitd.daemon.registry import Registry
from refitd.errors import ConflictError
from refitd.wire import VersionInfo

__all__ = ["LeaseDrain"]


class LeaseDrain:
    """Drain waiters on the leases of ``registry``, woken by :meth:`changed` (a lease
    was released or a version changed) and by the next expiry deadline (``clock``)."""

    def __init__(self, registry: Registry, clock: Callable[[], float]) -> None:
        self.registry = registry
        self.clock = clock
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Wake every drain waiter: the lease set may have shrunk."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(
        self, model: str, version: int, timeout_s: float, retire: bool = False
    ) -> VersionInfo:
        """Return once no live lease remains on the version (released or expired).

        With ``retire`` the version first stops accepting new leases (a publisher
        about to rewrite its memory must ask for that). Waits on release events and
        on the next expiry deadline, never by polling. :class:`ConflictError` if
        leases remain after ``timeout_s`` seconds.
        """
        self.registry.version(model, version)  # NotFound for an unknown version
        if retire:
            self.registry.retire(model, version)
        deadline = self.clock() + timeout_s
        while (nxt := self.registry.next_expiry(model, version)) is not None:
            left = deadline - self.clock()
            if left <= 0:
                n = len(self.registry.active_leases(model, version))
                raise ConflictError(
                    f"{model!r} version {version} still holds {n} lease(s) after {timeout_s}s"
                )
            event = self._changed
            try:
                async with asyncio.timeout(min(nxt, left) + 1e-3):
                    await event.wait()
            except TimeoutError:
                pass  # an expiry deadline passed: re-read the lease set
        return self.registry.version(model, version)
