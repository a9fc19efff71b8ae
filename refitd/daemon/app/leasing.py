"""What a lease reads on a daemon, and a lease's life: its scope, the signed region
records a peer daemon reads under it, the packs made for it, and acquiring, checking
and releasing it, with the drains its end wakes; which version a principal reads, and
a version's drain (its publisher's, before rewriting it), told to the daemon's
version listeners (:mod:`refitd.daemon.state.events`).

:class:`Leases` is a part of :class:`~refitd.daemon.app.node.Daemon` (its ``leases``),
built with the owners it uses: the one rule of "a lease reads only its version's
shards and the staging packed for it", applied where this daemon signs what a lease
reads (its records, its grants, its packs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import msgspec

from refitd.daemon.access.auth import Principal
from refitd.daemon.access.caps import Caps
from refitd.daemon.access.owners import ModelOwners
from refitd.daemon.access.trust import Extents
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.daemon.pull.plancheck import check_runs
from refitd.daemon.state.drain import LeaseDrain
from refitd.daemon.state.events import VersionEvents
from refitd.daemon.state.plane import TransportSet
from refitd.daemon.state.registry import Lease, Registry
from refitd.daemon.state.staging import OFF_LOOP_SPECS, StagingPool
from refitd.daemon.state.store import RegionStore
from refitd.errors import AccessDenied
from refitd.wire import (
    LeaseInfo,
    LeaseRequest,
    PackRequest,
    PackSpec,
    PeerRegions,
    StagedPack,
    VersionInfo,
)
from transports.interface import LeaseScope, Scope

__all__ = ["Leases"]


class Leases:
    """The leases of one daemon, over its registry, region store, staging pool, data
    planes, lease drains, per-principal caps, model owners (``models``: who reads a
    model, which it holds as a host mirror) and the table of host mirrors still
    filling (``filling``: what a lease on a version may read of one, only its
    complete chunks); ``events`` are told of each drain (:meth:`drain`). Its records are signed with the deployment ``secret``, as daemon
    ``node_id`` in its ``incarnation`` and data-plane ``mode``; ``clock`` is the registry's;
    ``max_plan_runs`` bounds a pack's specs (``limits.max_plan_runs``)."""

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: str,
        incarnation: int,
        mode: str,
        registry: Registry,
        store: RegionStore,
        staging: StagingPool,
        plane: TransportSet,
        drain: LeaseDrain,
        caps: Caps,
        models: ModelOwners,
        filling: FillingMirrors,
        events: VersionEvents,
        clock: Callable[[], float],
        max_plan_runs: int,
    ) -> None:
        self.secret = secret
        self.node_id = node_id
        self.incarnation = incarnation
        self.mode = mode
        self.registry = registry
        self.store = store
        self.staging = staging
        self.plane = plane
        self.drains = drain
        self.caps = caps
        self.models = models
        self.filling = filling
        self.events = events
        self.clock = clock
        self.max_plan_runs = max_plan_runs

    # ------------------------------------------------------------ peer records

    def version_scope(self, lease: Lease, held: bool = False) -> Scope:
        """What ``lease`` may read of its version's own regions now: the shard ranges,
        and of a mirror still filling only its complete chunks, unless ``held``: read
        through a data plane whose server holds each read of a chunk still filling
        until it is complete (it then answers only complete bytes). The one rule of
        "only complete chunks are read", applied where this daemon signs what a lease
        reads: its records, the grants it makes, and the packs it makes."""
        scope = self.registry.scope(lease.model, lease.version)
        if not held:  # of a mirror still filling, only its complete chunks
            scope = self.filling.limit_scope(lease.model, lease.version, scope)
        return scope

    def lease_scope(self, lease: Lease, held: bool = False) -> Scope:
        """What ``lease`` may read here: :meth:`version_scope`, and in each staging
        region packed for that very lease the bytes packed for it (not the rest of a
        reused region)."""
        scope = dict(self.version_scope(lease, held))
        scope.update(self.staging.packed_for(lease.lease_id))
        return scope

    def peer_regions(self, ids: list[int] | None = None, lease: Lease | None = None) -> PeerRegions:
        """Signed records of ``ids`` (all regions if ``None``) for a peer daemon.

        Under ``lease`` (a live one, checked by the caller) only regions that lease may
        read are given, each with the byte ranges it may read (``scope``); any other
        id is refused (:class:`AccessDenied`). ``adverts`` then holds, per data plane,
        the credential this daemon grants that lease (:meth:`TransportSet.grants`,
        over everything the lease may read here, whichever ids were asked): a reader
        connects with it as given, and never makes one. Without a lease the records
        carry no scope, no credential and no file identities: enough to list
        regions, nothing to read them with."""
        scope: dict[int, Extents] = {}  # the wire's concrete lists
        allowed: Scope = {}
        if lease is not None:
            allowed = self.lease_scope(lease)
            if ids is None:
                ids = sorted(allowed)
            outside = [i for i in ids if i not in allowed]
            if outside:
                raise AccessDenied(
                    f"region(s) {outside} refused: not part of {lease.model!r} version "
                    f"{lease.version} read under lease {lease.lease_id!r}; a lease reads only "
                    "its version's shards and staging packed for it"
                )
            scope = {i: list(allowed[i]) for i in ids}
        regions = self.store.regions
        infos = list(regions) if ids is None else [regions.get(i) for i in ids]
        # The client process is nobody's business but the region's owner; the segment
        # name only a reader under a lease needs (a same-host daemon maps it by name).
        infos = [
            msgspec.structs.replace(r, process="", handle=r.handle if lease is not None else "")
            for r in infos
        ]
        advert = b""
        adverts: dict[str, bytes] = {}
        if lease is not None:
            held = self.lease_scope(lease, held=True)
            adverts = self.plane.grants(lease.lease_id, allowed, held)
            advert = next(iter(adverts.values()), b"")
            # The same-host path's, made here too: every region the lease may read, each
            # limited to its ranges, and no other (a staging record asked for later
            # lists the version's regions too).
            shm = self.plane.shm
            adverts[shm.scheme] = shm.grant(LeaseScope(lease.lease_id, allowed)).encode()
        rec = PeerRegions(
            self.node_id,
            self.incarnation,
            self.mode,
            infos,
            advert,
            lease_id=lease.lease_id if lease is not None else "",
            scope=scope,
            adverts=adverts,
        )
        return rec.signed(self.secret)

    def leased_regions(
        self, ids: list[int] | None, lease_id: str, model: str, version: int
    ) -> PeerRegions:
        """:meth:`peer_regions` for a pull under ``lease_id`` (409 for a lease not live
        on ``(model, version)``)."""
        return self.peer_regions(ids, self.registry.check(lease_id, model, version))

    # ------------------------------------------------------------ packing and leases

    async def pack(
        self, specs: list[PackSpec], lease: Lease, principal: str | None = None
    ) -> StagedPack:
        """Gather specs into a staging region for ``lease`` (:meth:`StagingPool.pack`),
        reading only what :meth:`version_scope` allows, within the caps of the lease's
        principal (else ``principal``'s)."""
        limit = self.max_plan_runs
        if len(specs) > OFF_LOOP_SPECS:  # a Python step a spec: off the loop
            await asyncio.to_thread(check_runs, 0, specs, limit, "pack")
        else:
            check_runs(0, specs, limit, "pack")
        return await self.staging.pack(specs, lease, self.version_scope(lease), principal)

    async def pack_leased(self, req: PackRequest, principal: str | None = None) -> StagedPack:
        """:meth:`pack` under ``req``'s lease (409 for one not live on its version)."""
        lease = self.registry.check(req.lease_id, req.model, req.version)
        return await self.pack(req.specs, lease, principal)

    def check(self, lease_id: str, model: str, version: int) -> LeaseInfo:
        """The live lease ``lease_id`` on ``(model, version)`` with its seconds left
        (409 for one not live on that version)."""
        lease = self.registry.check(lease_id, model, version)
        left = lease.expires_at - self.clock()
        return LeaseInfo(lease.lease_id, lease.model, lease.version, left)

    def release(self, lease_id: str) -> None:
        """End a lease, and wake the drains and reaps its end may free."""
        self.registry.release(lease_id)
        self.changed()

    def acquire(
        self,
        model: str,
        version: int,
        ttl_s: float,
        label: str,
        principal: str,
        manifest: bool = False,
    ) -> LeaseInfo:
        """Lease a READY version for ``principal``, within its lease cap (429 past
        ``limits.max_leases_per_principal``). The grant carries this daemon's signed
        records of what the lease may read, with its credential on each data plane
        (:meth:`peer_regions`), and with ``manifest`` the version's merged manifest."""
        self.caps.leases.admit(principal, self.registry.is_live)
        grant = self.registry.acquire(model, version, ttl_s, label, owner=principal)
        self.caps.leases.add(principal, grant.lease_id)
        records = self.peer_regions(None, self.registry.check(grant.lease_id, model, version))
        merged = self.registry.merged(model, version) if manifest else None
        return msgspec.structs.replace(grant, records=records, manifest=merged)

    def lease(self, req: LeaseRequest, who: Principal) -> LeaseInfo:
        """``POST /v1/leases`` for ``who``: 403 for a model it may not read, and for a
        version this daemon holds as a host mirror (a tenant leases it at its source;
        only a peer daemon leases the copy, :meth:`MirrorLeases.grant`); else
        :meth:`acquire`."""
        self.models.check_read(who, req.model, "lease")
        if self.models.held(req.model):
            raise AccessDenied(
                f"lease on {req.model!r} version {req.version} refused: this daemon holds "
                "that model as a host mirror, which only peer daemons lease; lease it at its "
                "source and pull it through this daemon, which serves the pull from its mirror"
            )
        return self.acquire(req.model, req.version, req.ttl_s, req.label, who.name, req.manifest)

    async def release_staging(self, region_id: int, lease_id: str) -> None:
        """Return a staging region to the pool (:meth:`StagingPool.release`)."""
        await self.staging.release(region_id, lease_id)

    def changed(self) -> None:
        """Wake every drain waiter (a lease was released or a version changed), and
        release exited clients' regions that this may have freed (the drain's
        ``freed``: :meth:`LeaseDrain.changed`)."""
        self.drains.changed()

    def readable(self, who: Principal, model: str, version: int | None) -> int:
        """The version of ``model`` that ``who`` reads: ``version``, or (None, "latest")
        the model's READY one (404 when none); 403 for a model it may not read, whether
        the version exists or not."""
        self.models.check_read(who, model, "read")
        return self.registry.latest_ready(model) if version is None else version

    async def drain(
        self,
        who: Principal,
        model: str,
        version: int | None,
        timeout_s: float,
        retire: bool,
        held: AbstractAsyncContextManager[object],
    ) -> VersionInfo:
        """``POST .../drain`` for ``who``, the owner of ``model`` (403 else): return once
        no live lease remains on the version it reads (:meth:`readable`), released or
        expired (:meth:`LeaseDrain.wait`: 409 past ``timeout_s``); with ``retire`` the
        version first takes no new lease (its publisher is about to rewrite it).

        The wait is ``held`` (the request's long poll: it may refuse, and ends the wait
        when its client leaves), entered after the checks. Inside it, before any await,
        the listeners hear ``draining`` and the version is retired: a drain whose client
        left still changes what it asked. Once a drain that retired the version ends,
        however it ends, they hear ``retired``."""
        version = self.readable(who, model, version)
        self.models.check_owner(
            who, model, "retire a version of" if retire else "drain a version of"
        )
        retired = False
        try:
            async with held:
                self.registry.version(model, version)  # 404 for an unknown one: no event
                self.events.draining(model, version)
                if retire:
                    self.registry.retire(model, version)
                    retired = True
                return await self.drains.wait(model, version, timeout_s)
        finally:
            if retired:
                await self.events.retired(model, version)

    async def wait_ready(
        self,
        who: Principal,
        model: str,
        version: int | None,
        timeout_s: float,
        held: AbstractAsyncContextManager[object],
    ) -> VersionInfo:
        """Return once the version ``who`` reads (:meth:`readable`) is READY, or after
        ``timeout_s`` with its state (:meth:`LeaseDrain.ready`), the wait ``held`` as
        :meth:`drain`'s is."""
        version = self.readable(who, model, version)
        async with held:
            return await self.drains.ready(model, version, timeout_s)
