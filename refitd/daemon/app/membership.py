"""The daemon's membership in the cluster registry (:mod:`refitd.cluster`): routes, and the
hooks that keep the registry in step with this daemon.

- once listening, the daemon registers its signed record (:func:`register`);
- after every publish or retire it republishes the model's source records
  (:func:`announce`);
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

from aiohttp import web

from refitd.cluster import ClusterRegistry
from refitd.daemon.access.auth import principal_of
from refitd.daemon.app.httpio import DAEMON, RouteTable, reply
from refitd.daemon.app.waits import long_poll
from refitd.errors import NotFoundError
from refitd.wire import DaemonRecord, SourceRecord, VersionState
from refitd.wire import routes as api
from refitd.wire.args import ClusterNextArgs, VersionAt

__all__ = [
    "CLUSTER",
    "REGISTRY_ORIGIN",
    "announce",
    "register",
    "routes",
]

CLUSTER: web.AppKey[ClusterRegistry] = web.AppKey("cluster", ClusterRegistry)

REGISTRY_ORIGIN = "registry"
"""The origin (in :class:`~refitd.daemon.access.peers.PeerPolicy`) of the peers the etcd
registry vouches for."""

routes = RouteTable()


async def register(app: web.Application, url: str) -> None:
    """Register this daemon at ``url`` (or ``registry.advertise_url``) and publish
    what it holds; raises (the daemon does not start) if etcd refuses or is down."""
    d = app[DAEMON]
    reg = app[CLUSTER]
    advertise = d.config.registry.advertise_url
    me = DaemonRecord(d.node_id, advertise or url, d.incarnation, d.mode, d.boot_id)
    await reg.start(me)
    for model in sorted({v.model for v in d.registry.versions()}):
        await announce(app, model)


async def announce(app: web.Application, model: str) -> None:
    """Publish this daemon's versions of ``model`` (retired ones withdrawn)."""
    reg = app[CLUSTER]
    if reg.me is None:
        return  # not registered yet: register() publishes everything
    d = app[DAEMON]
    records = [
        SourceRecord(
            d.node_id,
            reg.me.url,
            d.incarnation,
            v.model,
            v.version,
            v.state,
            list(v.published_slots),
            v.expected_slots,
        )
        for v in d.registry.versions(model)
        if v.state is not VersionState.RETIRED
    ]
    await reg.publish(model, records)


@routes.handles(api.CLUSTER_DAEMONS)
async def daemons(request: web.Request) -> web.Response:
    return reply(request, request.app[CLUSTER].daemons())


@routes.handles(api.CLUSTER_VERSION)
async def version(request: web.Request, args: VersionAt) -> web.Response:
    model = args.model
    # Which daemons hold which versions of a model is its readers' to know (403 alike
    # whether the version exists or not).
    request.app[DAEMON].models.check_read(principal_of(request), model, "see the holders of")
    found = request.app[CLUSTER].version(model, args.version)
    return reply(request, found)


@routes.handles(api.CLUSTER_NEXT)
async def next_version(request: web.Request, args: ClusterNextArgs) -> web.Response:
    model, after, timeout = args.model, args.after, args.timeout
    who = principal_of(request)
    request.app[DAEMON].models.check_read(who, model, "wait for the versions of")
    async with long_poll(request, f"waiting for a version of {model!r}"):
        found = await request.app[CLUSTER].wait_newer(model, after, timeout)
    if found is None:
        raise NotFoundError(
            f"no complete version of {model!r} newer than {after} was registered within "
            f"{timeout:g} s"
        )
    return reply(request, found)
