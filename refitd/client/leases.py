"""Holding a lease while a long operation runs: :func:`held_lease` acquires it, keeps
it alive (:class:`LeaseKeeper`) and releases it, the one keeper of every holder.

A lease has a TTL so that a reader that died cannot hold a version forever. A
healthy reader whose pull outlasts the TTL must therefore renew it, or its own pull
fails at the end (the daemon checks the lease again once the bytes have moved).
The keeper renews on a timer in a task of its own :class:`asyncio.TaskGroup`; it
never revives a lease that lapsed: once a renewal is refused the keeper stops, so a
lease that did expire still fails the pull closed.

It keeps any holder's lease: an engine's at a daemon (through
:class:`~refitd.client.RefitClient`), and a daemon's own at a peer daemon (a host
mirror's at its source and its upstream relay, through the daemon's peer client):
anything with ``renew_lease`` (:class:`Renews`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from types import TracebackType
from typing import Protocol, Self

from refitd.errors import ProtocolError, RefitError, TransportError
from refitd.wire import LeaseInfo

__all__ = ["LeaseKeeper", "Releases", "Renews", "held_lease"]


class Renews(Protocol):
    """Who a lease is renewed through: the daemon that granted it, as a client sees it."""

    async def renew_lease(self, lease_id: str, ttl_s: float) -> LeaseInfo: ...


class Releases(Renews, Protocol):
    """Who a lease is renewed and released through."""

    async def release_lease(self, lease_id: str) -> None: ...


@contextlib.asynccontextmanager
async def held_lease(
    client: Releases, acquiring: Awaitable[LeaseInfo], ttl_s: float | None = None
) -> AsyncIterator[LeaseKeeper]:
    """The lease ``acquiring`` grants (a call of ``client``'s ``acquire_lease``), kept
    alive by a :class:`LeaseKeeper` (renewed for ``ttl_s``, default its own TTL) while
    the block runs, and released when it ends, however it ends. A release that fails
    is let be, never the block's error: a daemon unreachable or restarted, or a lease
    gone already (expired and dropped), holds it no more, and any other lease runs out
    at its TTL. Yields the keeper (:attr:`LeaseKeeper.granted`: the grant as the
    daemon answered it)."""
    grant = await acquiring
    try:
        async with LeaseKeeper(client, grant, ttl_s) as keeper:
            yield keeper
    finally:
        with contextlib.suppress(RefitError):
            await asyncio.shield(client.release_lease(grant.lease_id))


RENEW_FRACTION = 1 / 3
"""Renew after this fraction of the TTL: two renewals can fail in a row (a slow
daemon, a dropped connection) before the lease runs out."""


class LeaseKeeper:
    """Renews ``lease`` (held at the daemon ``client`` talks to) every ``every_s``
    seconds, each time for ``ttl_s`` more seconds, while the ``async with`` block runs.

    ``ttl_s`` defaults to the grant's own ``expires_in_s``; ``every_s`` to a third of
    ``ttl_s`` and must be shorter than it. A renewal refused by the daemon (the lease
    expired, was released or its version retired) stops the keeper and is kept in
    :attr:`error`; a renewal that could not reach the daemon (:class:`TransportError`)
    is retried at the next tick while the lease may still be live. The block's own
    exception propagates unchanged; leaving the block stops the renewals (the lease
    itself is the caller's to release).
    """

    def __init__(
        self,
        client: Renews,
        lease: LeaseInfo,
        ttl_s: float | None = None,
        every_s: float | None = None,
    ) -> None:
        self.client = client
        self.lease = lease
        #: the grant as acquired (its records and manifest; renewals carry neither)
        self.granted = lease
        self.ttl_s = lease.expires_in_s if ttl_s is None else ttl_s
        self.every_s = self.ttl_s * RENEW_FRACTION if every_s is None else every_s
        if not 0 < self.every_s < self.ttl_s:
            raise ProtocolError(
                f"lease keeper for {lease.lease_id!r} refused: renewing every {self.every_s}s "
                f"would not keep a {self.ttl_s}s lease alive (need 0 < every_s < ttl_s)"
            )
        self.renewals = 0
        self.error: RefitError | None = None
        self._changed = asyncio.Condition()
        self._tg: asyncio.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        tg = asyncio.TaskGroup()
        await tg.__aenter__()
        self._tg = tg
        self._task = tg.create_task(self._renew(), name=f"renew {self.lease.lease_id}")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None and self._task is not None
        self._task.cancel()
        # The group is told nothing of the block's exception: it only waits for the
        # cancelled renewer, and the block's exception propagates as it was (not
        # wrapped in an ExceptionGroup).
        await self._tg.__aexit__(None, None, None)
        self._tg = self._task = None

    async def wait(self, renewals: int) -> None:
        """Return once ``renewals`` renewals succeeded in all, or renewing stopped."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.renewals >= renewals or self.stopped)

    @property
    def stopped(self) -> bool:
        """True once a renewal was refused (see :attr:`error`)."""
        return self.error is not None

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)  # the timer between renewals
            try:
                async with asyncio.timeout(self.every_s):
                    grant = await self.client.renew_lease(self.lease.lease_id, self.ttl_s)
            except (TransportError, TimeoutError):
                continue  # unreachable for now; the lease may still be live
            except RefitError as exc:
                self.error = exc
                async with self._changed:
                    self._changed.notify_all()
                return
            self.lease = grant
            self.renewals += 1
            async with self._changed:
                self._changed.notify_all()
