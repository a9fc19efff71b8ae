"""What the cluster registry says, held in memory: pure, no I/O.

A :class:`Directory` is fed the registry's keys and values (a snapshot, then one
put or delete at a time from a watch) and answers from memory: which daemons are
registered (the trusted peers), where each version's parts live, and which version
is the newest whose parts are all READY somewhere. Every value is checked against
the deployment secret as it arrives; one that does not verify is refused, counted
and never trusted.

Keys, under the deployment's ``prefix``::

    {prefix}/daemons/{node_id}                         -> DaemonRecord
    {prefix}/sources/{model}/{version:012d}/{node_id}  -> SourceRecord

(``model`` and ``node_id`` percent-encoded, so a ``/`` in a name cannot forge a key.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import msgspec

from refitd.errors import NotFoundError, ProtocolError
from refitd.wire import ClusterVersion, DaemonRecord, SourceRecord, VersionState

__all__ = ["Change", "Directory", "daemon_key", "source_key", "sources_prefix"]


def _q(name: str) -> str:
    return quote(name, safe="")


def daemon_key(prefix: str, node_id: str) -> str:
    return f"{prefix}/daemons/{_q(node_id)}"


def sources_prefix(prefix: str, model: str | None = None) -> str:
    return f"{prefix}/sources/" + (f"{_q(model)}/" if model is not None else "")


def source_key(prefix: str, model: str, version: int, node_id: str) -> str:
    return f"{sources_prefix(prefix, model)}{version:012d}/{_q(node_id)}"


@dataclass(frozen=True)
class Change:
    """What one update did: daemons that left (their records, for failing pulls
    from them) and models whose sources changed (for waiters on new versions)."""

    gone: tuple[DaemonRecord, ...] = ()
    models: frozenset[str] = frozenset()


@dataclass
class Directory:
    prefix: str
    secret: bytes
    daemons: dict[str, DaemonRecord] = field(default_factory=dict)
    #: model -> version -> node id -> record
    sources: dict[str, dict[int, dict[str, SourceRecord]]] = field(default_factory=dict)
    refused: int = 0  # values that did not decode or verify

    # ------------------------------------------------------------ updates

    def replace(self, items: Iterable[tuple[str, bytes]]) -> Change:
        """Load a whole snapshot (after a (re)connect); reports daemons that are
        no longer there and every model whose sources may have changed."""
        old_daemons = self.daemons
        old_models = set(self.sources)
        self.daemons, self.sources = {}, {}
        for key, value in items:
            self._put(key, value)
        gone = tuple(r for n, r in old_daemons.items() if self._replaced(n, r))
        return Change(gone, frozenset(old_models | set(self.sources)))

    def _replaced(self, node_id: str, rec: DaemonRecord) -> bool:
        now = self.daemons.get(node_id)
        return now is None or now.incarnation != rec.incarnation

    def put(self, key: str, value: bytes) -> Change:
        before = self.daemons.get(self._node_of(key) or "")
        model = self._put(key, value)
        after = self.daemons.get(self._node_of(key) or "")
        gone = (
            (before,)
            if before is not None and (after is None or after.incarnation != before.incarnation)
            else ()
        )
        return Change(gone, frozenset({model} if model else ()))

    def delete(self, key: str) -> Change:
        node = self._node_of(key)
        if node is not None:
            rec = self.daemons.pop(node, None)
            return Change((rec,) if rec is not None else ())
        parsed = self._source_of(key)
        if parsed is None:
            return Change()
        model, version, node = parsed
        versions = self.sources.get(model, {})
        holders = versions.get(version, {})
        holders.pop(node, None)
        if not holders:
            versions.pop(version, None)
        if not versions:
            self.sources.pop(model, None)
        return Change(models=frozenset({model}))

    def _node_of(self, key: str) -> str | None:
        head = f"{self.prefix}/daemons/"
        return unquote(key[len(head) :]) if key.startswith(head) else None

    def _source_of(self, key: str) -> tuple[str, int, str] | None:
        head = f"{self.prefix}/sources/"
        if not key.startswith(head):
            return None
        parts = key[len(head) :].split("/")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        return unquote(parts[0]), int(parts[1]), unquote(parts[2])

    def _put(self, key: str, value: bytes) -> str | None:
        """Record one key; returns the model it concerns (None for a daemon key)."""
        try:
            node = self._node_of(key)
            if node is not None:
                rec = msgspec.msgpack.decode(value, type=DaemonRecord)
                rec.verify(self.secret)
                if rec.node_id != node:
                    raise ProtocolError(f"record of {rec.node_id!r} stored under {node!r}")
                self.daemons[node] = rec
                return None
            parsed = self._source_of(key)
            if parsed is None:
                return None
            src = msgspec.msgpack.decode(value, type=SourceRecord)
            src.verify(self.secret)
            if (src.model, src.version, src.node_id) != parsed:
                raise ProtocolError(f"source record stored under another key: {key}")
        except (msgspec.DecodeError, msgspec.ValidationError, ProtocolError):
            self.refused += 1
            return None
        self.sources.setdefault(src.model, {}).setdefault(src.version, {})[src.node_id] = src
        return src.model

    # ------------------------------------------------------------ answers

    def trusted(self, url: str) -> DaemonRecord | None:
        """The registered (verified) daemon serving at ``url``, or None."""
        url = url.rstrip("/")
        for rec in self.daemons.values():
            if rec.url.rstrip("/") == url:
                return rec
        return None

    def holders(self, model: str, version: int) -> list[SourceRecord]:
        """Records of the version from daemons that are registered now, by node id.
        A record whose daemon's registration is gone (or is of another incarnation)
        is not listed: its regions are gone with it."""
        out = []
        for node, src in sorted(self.sources.get(model, {}).get(version, {}).items()):
            d = self.daemons.get(node)
            if d is not None and d.incarnation == src.incarnation:
                out.append(src)
        return out

    def version(self, model: str, version: int) -> ClusterVersion:
        holders = self.holders(model, version)
        if not holders:
            raise NotFoundError(f"no registered daemon holds {model!r} version {version}")
        expected = holders[0].expected_parts
        ready = {
            s
            for h in holders
            if h.state is VersionState.READY or h.state is VersionState.PENDING
            for s in h.parts
        }
        complete = ready >= set(range(expected)) and all(
            h.state is not VersionState.RETIRED and h.expected_parts == expected for h in holders
        )
        return ClusterVersion(model, version, expected, complete, holders)

    def latest(self, model: str, after: int = -1) -> ClusterVersion | None:
        """The newest complete version of ``model`` newer than ``after``, or None."""
        for version in sorted(self.sources.get(model, {}), reverse=True):
            if version <= after:
                break
            if not self.holders(model, version):
                continue
            found = self.version(model, version)
            if found.complete:
                return found
        return None

    def models(self) -> list[str]:
        return sorted(self.sources)
