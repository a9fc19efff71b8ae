"""The daemon's membership in the cluster registry (:mod:`refitd.cluster`): routes, and
:class:`Membership`, which keeps the registry in step with this daemon.

- once listening, the daemon registers its signed record (:meth:`Membership.register`);
- after every publish, and once every drain that retired a version ended, it
  republishes the model's source records: :class:`Membership` is one of the daemon's
  version listeners (:mod:`refitd.daemon.state.events`), added as the app is built;
- a registered daemon that leaves fails every running pull reading from it, naming it;
- with ``kind = "etcd"`` every daemon registered there (record verified) is a
  trusted peer: the registry is the ``"registry"`` origin of the daemon's one
  :class:`~refitd.daemon.access.peers.PeerPolicy`, beside ``[peers] allow``.

Routes (read-only; the registry is written by daemons, never by clients):
``GET /v1/cluster/daemons``, ``GET /v1/cluster/sources/{model}/versions/{version}``
(``latest``: the newest complete one) and ``GET /v1/cluster/sources/{model}/next``
(waits for a complete version newer than ``after``; pushed by the registry's watch).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import msgspec
from aiohttp import web

from refitd.cluster import ClusterRegistry
from refitd.daemon.access.auth import Principal, principal_of
from refitd.daemon.access.owners import ModelOwners
from refitd.daemon.app.httpio import RouteTable, reply
from refitd.daemon.app.waits import long_poll
from refitd.daemon.state.events import VersionListener
from refitd.daemon.state.registry import Registry
from refitd.errors import NotFoundError
from refitd.wire import ClusterVersion, DaemonRecord, SourceRecord, VersionInfo, VersionState
from refitd.wire import routes as api
from refitd.wire.args import ClusterNextArgs, VersionAt

__all__ = [
    "CLUSTER",
    "MEMBERSHIP",
    "REGISTRY_ORIGIN",
    "Membership",
    "routes",
]

CLUSTER: web.AppKey[ClusterRegistry] = web.AppKey("cluster", ClusterRegistry)

REGISTRY_ORIGIN = "registry"
"""The origin (in :class:`~refitd.daemon.access.peers.PeerPolicy`) of the peers the etcd
registry vouches for."""

routes = RouteTable()


class Membership(VersionListener):
    """This daemon's records in the ``cluster`` registry: its own (``me``, its ``url``
    the advertised one, or empty: the URL the daemon listens on, given to
    :meth:`register`) and its versions' (read from the version ``registry``),
    republished as a version listener hears them change; and what the registry says
    of a model, to its readers (``models``: who reads which)."""

    def __init__(
        self, cluster: ClusterRegistry, registry: Registry, models: ModelOwners, me: DaemonRecord
    ) -> None:
        self.cluster = cluster
        self.registry = registry
        self.models = models
        self.me = me

    async def register(self, url: str) -> None:
        """Register this daemon at ``url`` (or its advertised URL, when it has one) and
        publish what it holds; raises (the daemon does not start) if etcd refuses or
        is down."""
        me = self.me if self.me.url else msgspec.structs.replace(self.me, url=url)
        await self.cluster.start(me)
        for model in sorted({v.model for v in self.registry.versions()}):
            await self.announce(model)

    async def announce(self, model: str) -> None:
        """Publish this daemon's versions of ``model`` (retired ones withdrawn)."""
        me = self.cluster.me
        if me is None:
            return  # not registered yet: register() publishes everything
        records = [
            SourceRecord(
                me.node_id,
                me.url,
                me.incarnation,
                v.model,
                v.version,
                v.state,
                list(v.published_parts),
                v.expected_parts,
            )
            for v in self.registry.versions(model)
            if v.state is not VersionState.RETIRED
        ]
        await self.cluster.publish(model, records)

    def version(self, who: Principal, model: str, version: int | str) -> ClusterVersion:
        """``model`` at ``version`` across hosts (``"latest"``: the newest complete one;
        404 when none), for a reader of ``model``: which daemons hold which versions of
        a model is its readers' to know (403 alike whether the version exists or not)."""
        self.models.check_read(who, model, "see the holders of")
        return self.cluster.version(model, version)

    async def next_version(
        self,
        who: Principal,
        model: str,
        after: int,
        timeout_s: float,
        held: AbstractAsyncContextManager[object],
    ) -> ClusterVersion:
        """The newest complete version of ``model`` newer than ``after``, for a reader
        of ``model`` (403 else), waiting up to ``timeout_s`` seconds (the wait
        ``held``: the request's long poll) for the registry to announce one; 404 if
        none came."""
        self.models.check_read(who, model, "wait for the versions of")
        async with held:
            found = await self.cluster.wait_newer(model, after, timeout_s)
        if found is None:
            raise NotFoundError(
                f"no complete version of {model!r} newer than {after} was registered within "
                f"{timeout_s:g} s"
            )
        return found

    async def published(self, info: VersionInfo) -> None:
        await self.announce(info.model)

    async def retired(self, model: str, version: int) -> None:
        await self.announce(model)


MEMBERSHIP: web.AppKey[Membership] = web.AppKey("membership", Membership)


@routes.handles(api.CLUSTER_DAEMONS)
async def daemons(request: web.Request) -> web.Response:
    return reply(request, request.app[CLUSTER].daemons())


@routes.handles(api.CLUSTER_VERSION)
async def version(request: web.Request, args: VersionAt) -> web.Response:
    found = request.app[MEMBERSHIP].version(principal_of(request), args.model, args.version)
    return reply(request, found)


@routes.handles(api.CLUSTER_NEXT)
async def next_version(request: web.Request, args: ClusterNextArgs) -> web.Response:
    held = long_poll(request, f"waiting for a version of {args.model!r}")
    found = await request.app[MEMBERSHIP].next_version(
        principal_of(request), args.model, args.after, args.timeout, held
    )
    return reply(request, found)
