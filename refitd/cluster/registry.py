"""The registry's interface (:class:`ClusterRegistry`) and its one-host kind
(:class:`StaticRegistry`); the ``etcd`` kind subclasses it in :mod:`refitd.cluster.etcd`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from refitd.cluster.directory import Change, Directory, daemon_key, source_key
from refitd.errors import NotFoundError
from refitd.wire import ClusterVersion, DaemonRecord, SourceRecord

__all__ = ["ClusterRegistry", "StaticRegistry"]

GoneCallback = Callable[[DaemonRecord], object]


class ClusterRegistry:
    """The interface the daemon programs against, with the parts both kinds share:
    a :class:`Directory`, callbacks for daemons that leave, and waiting for new
    versions on change events (never polling)."""

    kind = "static"

    def __init__(self, prefix: str, secret: bytes) -> None:
        self.prefix = prefix.rstrip("/")
        self.secret = secret
        self.directory = Directory(self.prefix, secret)
        self.me: DaemonRecord | None = None
        self._gone: list[GoneCallback] = []
        self._listeners: list[Callable[[], object]] = []
        self._changed = asyncio.Event()
        #: this daemon's keys and values, re-written after a re-registration
        self._mine: dict[str, bytes] = {}

    # ------------------------------------------------------------ daemon side

    async def start(self, me: DaemonRecord) -> None:
        raise NotImplementedError

    async def publish(self, model: str, records: list[SourceRecord]) -> None:
        """Make ``records`` (signed here) the only ones this daemon publishes for
        ``model``: versions no longer listed are withdrawn."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def on_gone(self, callback: GoneCallback) -> None:
        """Call ``callback(record)`` when a registered daemon leaves (lease expired,
        deregistered, or re-registered as a new incarnation)."""
        self._gone.append(callback)

    def on_change(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` after every update of the directory."""
        self._listeners.append(callback)

    # ------------------------------------------------------------ answers

    def trusted(self, url: str) -> DaemonRecord | None:
        """The registered, verified daemon at ``url`` (None: not a registered peer)."""
        return self.directory.trusted(url)

    def daemons(self) -> list[DaemonRecord]:
        return [self.directory.daemons[n] for n in sorted(self.directory.daemons)]

    def version(self, model: str, version: int | str) -> ClusterVersion:
        """``model`` at ``version`` across hosts; ``"latest"``: the newest complete one."""
        if version == "latest":
            found = self.directory.latest(model)
            if found is None:
                raise NotFoundError(f"no complete version of {model!r} is registered")
            return found
        return self.directory.version(model, int(version))

    def complete(self, model: str, version: int, node_id: str) -> bool:
        """Whether ``model`` at ``version`` has all its parts published across the
        registered daemons, ``node_id`` among them."""
        try:
            found = self.directory.version(model, version)
        except NotFoundError:
            return False
        return found.complete and any(h.node_id == node_id for h in found.holders)

    async def wait_newer(self, model: str, after: int, timeout_s: float) -> ClusterVersion | None:
        """The newest complete version of ``model`` newer than ``after``, waiting up to
        ``timeout_s`` seconds for the registry to announce one; None if none came."""
        try:
            async with asyncio.timeout(timeout_s):
                while (found := self.directory.latest(model, after)) is None:
                    event = self._changed
                    await event.wait()
        except TimeoutError:
            return None
        return found

    # ------------------------------------------------------------ shared

    def _record(self, rec: SourceRecord) -> tuple[str, bytes]:
        signed = rec.signed(self.secret)
        return source_key(self.prefix, rec.model, rec.version, rec.node_id), (
            msgspec.msgpack.encode(signed)
        )

    def _me_item(self) -> tuple[str, bytes]:
        assert self.me is not None
        return daemon_key(self.prefix, self.me.node_id), msgspec.msgpack.encode(
            self.me.signed(self.secret)
        )

    def _diff(self, model: str, records: list[SourceRecord]) -> tuple[dict[str, bytes], list[str]]:
        """New values of this daemon's keys for ``model`` and the keys to delete."""
        assert self.me is not None
        head = source_key(self.prefix, model, 0, "")[: -len("000000000000/")]
        want = dict(self._record(r) for r in records)
        stale = [k for k in self._mine if k.startswith(head) and k not in want]
        for k in stale:
            del self._mine[k]
        self._mine.update(want)
        return want, stale

    def _apply(self, change: Change) -> None:
        for listener in self._listeners:
            listener()
        for rec in change.gone:
            for cb in self._gone:
                cb(rec)
        if change.models or change.gone:
            self._changed.set()
            self._changed = asyncio.Event()


class StaticRegistry(ClusterRegistry):
    """One host: the directory holds this daemon alone, and nothing leaves it."""

    async def start(self, me: DaemonRecord) -> None:
        self.me = me
        self._apply(self.directory.put(*self._me_item()))

    async def publish(self, model: str, records: list[SourceRecord]) -> None:
        want, stale = self._diff(model, records)
        for key in stale:
            self._apply(self.directory.delete(key))
        for key, value in want.items():
            self._apply(self.directory.put(key, value))

    async def close(self) -> None:
        self._changed.set()
