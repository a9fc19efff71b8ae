"""A source's version and lease records, and what is read from them.

:class:`Version` is one version of a model as the registry holds it (its parts'
manifests, its state, what is cached from them); :class:`Lease` is one reader's
lease on one. :class:`VersionReads` is the reading half of
:class:`~refitd.daemon.state.registry.Registry`: a version's info, its regions, its
scope and its merged manifest; publishing, expiry and leases stay in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from refitd.daemon.state.merging import merge_parts, scope_of
from refitd.errors import ConflictError, NotFoundError
from refitd.wire import ManifestIn, MergedManifest, VersionInfo, VersionState
from transports.interface import Scope

__all__ = ["Clock", "Lease", "Version", "VersionReads"]

Clock = Callable[[], float]


@dataclass
class Lease:
    lease_id: str
    model: str
    version: int
    expires_at: float
    label: str = ""
    #: the principal that acquired it: staging regions packed for it are theirs
    owner: str = ""


@dataclass
class Version:
    model: str
    version: int
    expected_parts: int
    parts: dict[int, ManifestIn] = field(default_factory=dict)
    state: VersionState = VersionState.PENDING
    merged: MergedManifest | None = None
    merged_bytes: bytes | None = None
    scope: Scope | None = None
    region_ids: frozenset[int] | None = None
    #: bytes of manifests its parts hold (:func:`manifest_cost`), by publisher, until
    #: they are let go (expired, or retired and unleased)
    charged: dict[str, int] = field(default_factory=dict)
    #: the parts it published, once its manifests were let go (retired, unleased)
    published: tuple[int, ...] = ()


class VersionReads:
    """Reading a registry's versions (mixed into
    :class:`~refitd.daemon.state.registry.Registry`, whose state it reads)."""

    node_id: str
    incarnation: int
    _clock: Clock
    _versions: dict[tuple[str, int], Version]
    _leases: dict[str, Lease]

    if TYPE_CHECKING:

        def complete_elsewhere(self, model: str, version: int) -> bool: ...

        def expire_pending(self) -> list[tuple[str, int]]: ...

        def active_leases(self, model: str, version: int) -> list[Lease]: ...

    def _get(self, model: str, version: int) -> Version:
        # A version past its TTL is gone for every reader, whether or not its timer
        # (the daemon's, :meth:`next_pending_s`) has fired yet.
        self.expire_pending()
        v = self._versions.get((model, version))
        if v is None:
            raise NotFoundError(f"no version {version} of model {model!r}")
        return v

    def _info(self, v: Version) -> VersionInfo:
        return VersionInfo(
            model=v.model,
            version=v.version,
            state=v.state,
            published_parts=sorted(v.parts) if v.parts else list(v.published),
            expected_parts=v.expected_parts,
            leases=len(self.active_leases(v.model, v.version)),
        )

    def versions(self, model: str | None = None) -> list[VersionInfo]:
        """Every known version (of ``model``, if given), oldest first."""
        self.expire_pending()
        return [
            self._info(v)
            for (mdl, _), v in sorted(self._versions.items())
            if model is None or mdl == model
        ]

    def version(self, model: str, version: int) -> VersionInfo:
        return self._info(self._get(model, version))

    def regions_of(self, model: str, version: int) -> set[int]:
        """Every region id any part of the version lists a shard in (cached: asked on
        every pull and delete, and a version's parts change only while pending)."""
        v = self._get(model, version)
        if v.region_ids is None:
            v.region_ids = frozenset(
                s.region for m in v.parts.values() for t in m.tensors for s in t.shards
            )
        return set(v.region_ids)

    def protected_regions(self) -> dict[int, tuple[str, int, str]]:
        """Region id -> ``(model, version, why)`` of one version that publishes from it
        and whose bytes must not change: READY, pending (being published) or leased
        (a retired version stays protected while a lease on it is live). Neither a
        pull nor a delete may touch these regions. A version pending past its TTL is
        forgotten first (expiry must not wait for an unrelated publish)."""
        self.expire_pending()
        now = self._clock()
        leased = {(x.model, x.version) for x in self._leases.values() if x.expires_at > now}
        out: dict[int, tuple[str, int, str]] = {}
        for key, v in sorted(self._versions.items()):
            if key in leased:
                why = f"leased ({v.state.value})"
            elif v.state is VersionState.RETIRED:
                continue
            else:
                why = v.state.value
            for r in self.regions_of(*key):
                out.setdefault(r, (key[0], key[1], why))
        return out

    def scope(self, model: str, version: int) -> Scope:
        """Region id -> the byte ranges the version's shards occupy (every part's,
        merged): what a lease on it may read. Cached; a version that may be leased
        never changes."""
        v = self._get(model, version)
        if v.scope is None:
            v.scope = scope_of(v.parts)
        return v.scope

    def latest_ready(self, model: str) -> int:
        """``latest``: the model's READY version, :class:`NotFoundError` if none.

        A model has at most one READY version: a version becoming READY retires every
        older one, and versions only move forward, so ``latest`` never goes back to
        an older version. After ``drain?retire=1`` of that version there is no latest
        until a newer version becomes READY."""
        ready = [
            ver
            for (mdl, ver), v in self._versions.items()
            if mdl == model and v.state is VersionState.READY
        ]
        if not ready:
            raise NotFoundError(f"model {model!r} has no READY version")
        return max(ready)

    def _require_ready(self, model: str, version: int) -> Version:
        v = self._get(model, version)
        if v.state is VersionState.PENDING and self.complete_elsewhere(model, version):
            return v  # the other parts are held by other daemons of the cluster
        if v.state is not VersionState.READY:
            raise ConflictError(
                f"{model!r} version {version} is {v.state.value}, not ready: "
                + (
                    f"published parts {sorted(v.parts)} of {v.expected_parts}"
                    if v.state is VersionState.PENDING
                    else "a newer version replaced it"
                )
            )
        return v

    def merged(self, model: str, version: int) -> MergedManifest:
        """The READY version's tensors with replicated blocks listed once (cached)."""
        v = self._require_ready(model, version)
        if v.merged is None:
            v.merged = merge_parts(v.parts, v.model, v.version, self.node_id, self.incarnation)
        return v.merged

    def merged_bytes(self, model: str, version: int) -> bytes:
        """:meth:`merged` encoded as msgpack once, so repeated fetches cost no encoding."""
        v = self._require_ready(model, version)
        if v.merged_bytes is None:
            v.merged_bytes = msgspec.msgpack.encode(self.merged(model, version))
        return v.merged_bytes
