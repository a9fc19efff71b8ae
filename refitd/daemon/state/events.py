"""What listens to a daemon's versions: a part published, a version drained before its
publisher rewrites it, a version retired.

The daemon's publish (:meth:`refitd.daemon.app.node.Daemon.publish`) and a publisher's
drain (:meth:`refitd.daemon.app.leasing.Leases.drain`) make these changes; the parts
that follow them (the delta book, the cluster registry's records of this daemon) are
:class:`VersionListener`\\ s of the daemon's one :class:`VersionEvents`, added once
when the app is built, and told in the order they were added:

- ``published(info)``, awaited once a part's publish has succeeded (``info``: the
  version's state after it; READY once its last part is in). A refused publish tells
  nothing.
- ``draining(model, version)``, a plain call as a drain begins, before it waits or
  retires anything: the version's memory is about to be rewritten. It does not await,
  so what it changes is changed even when the drain's client leaves at its first await.
- ``retired(model, version)``, awaited once a drain that retired the version ended,
  however it ended (drained, timed out, or its client gone): the version takes no new
  lease since the drain began.

A listener that raises stops the telling there, and its error is the request's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from refitd.wire import VersionInfo

__all__ = ["VersionEvents", "VersionListener"]


class VersionListener(Protocol):
    """Told of one daemon's versions (see the module docstring); each method does
    nothing unless a listener overrides it."""

    async def published(self, info: VersionInfo) -> None:
        """A part of ``info``'s version was published; ``info`` is its state now."""
        return None

    def draining(self, model: str, version: int) -> None:
        """``version``'s publisher drains it, to rewrite its memory. No await."""
        return None

    async def retired(self, model: str, version: int) -> None:
        """A drain that retired ``version`` ended."""
        return None


class VersionEvents(VersionListener):
    """The listeners of one daemon's versions, told in the order they were added."""

    def __init__(self, listeners: Iterable[VersionListener] = ()) -> None:
        self.listeners: list[VersionListener] = list(listeners)

    def listen(self, listener: VersionListener) -> None:
        """Tell ``listener`` of every version event from now on (after the others)."""
        self.listeners.append(listener)

    async def published(self, info: VersionInfo) -> None:
        for listener in self.listeners:
            await listener.published(info)

    def draining(self, model: str, version: int) -> None:
        for listener in self.listeners:
            listener.draining(model, version)

    async def retired(self, model: str, version: int) -> None:
        for listener in self.listeners:
            await listener.retired(model, version)
