"""Waiting for a version's leases to drain, or for a version to become READY, on
events, never by polling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from refitd.daemon.state.registry import Registry
from refitd.errors import ConflictError, NotFoundError
from refitd.wire import VersionInfo, VersionState

__all__ = ["LeaseDrain"]


class LeaseDrain:
    """Drain waiters on the leases of ``registry``, woken by :meth:`changed` (a lease
    was released or a version changed) and by the next expiry deadline (``clock``);
    waiters for a version to become READY (:meth:`ready`), woken by the same event.

    ``freed``, given at construction, is told of the same event: what else waits for
    leases and versions to let go of memory (the region store's reaper, an exited
    client's regions a lease or version pinned). One call, :meth:`changed`, is then
    what any part that ends a lease or changes a version makes, whichever part it is
    (the daemon's leasing, the delta book's hold on a base)."""

    def __init__(
        self,
        registry: Registry,
        clock: Callable[[], float],
        freed: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.clock = clock
        self._freed = freed
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Wake every drain waiter, and ``freed``: the lease set may have shrunk."""
        self._changed.set()
        self._changed = asyncio.Event()
        if self._freed is not None:
            self._freed()

    async def wait(self, model: str, version: int, timeout_s: float) -> VersionInfo:
        """Return once no live lease remains on the version (released or expired).

        A publisher about to rewrite the version's memory retires it first
        (:meth:`Registry.retire`: no new lease), as :meth:`Leases.drain` does. Waits
        on release events and on the next expiry deadline, never by polling.
        :class:`ConflictError` if leases remain after ``timeout_s`` seconds.
        """
        self.registry.version(model, version)  # NotFound for an unknown version
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

    async def ready(self, model: str, version: int, timeout_s: float) -> VersionInfo:
        """Return once ``model`` ``version`` is no longer pending (READY, or retired),
        woken by each publish; after ``timeout_s`` seconds, its state then (still
        pending). :class:`NotFoundError` when by then no part of it was published."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            event = self._changed
            try:
                info: VersionInfo | None = self.registry.version(model, version)
            except NotFoundError:
                info = None
            if info is not None and info.state is not VersionState.PENDING:
                return info
            left = deadline - loop.time()
            if left <= 0:
                return info if info is not None else self.registry.version(model, version)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await event.wait()
