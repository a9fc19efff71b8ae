"""The handlers of API v1, and :func:`create_app`, the aiohttp application they make.

:func:`create_app` builds the app around one :class:`~refitd.daemon.app.node.Daemon`.
A handler decodes its request, calls one owner and encodes the answer; what follows
from a change is an event on its owner (:mod:`refitd.daemon.state.events`), whose
listeners (the delta book, the cluster membership) :func:`create_app` adds, in order.
Operators' pieces (auth, metrics, size limits, OpenAPI) plug in through
``middlewares``, ``cleanup_ctx`` and ``setup`` callbacks, so the app is assembled
in one place. Every RefitError maps to one status code in :func:`error_middleware`
and comes back as ``{"error": <class name>, "detail": <message>}``.

Bodies are msgpack (``application/msgpack``) or JSON, chosen by ``Content-Type``;
responses follow ``Accept`` (msgpack when asked for, JSON otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from aiohttp import web

from refitd.daemon.access.auth import Principal, check_owner, principal_of
from refitd.daemon.app.httpio import (
    DAEMON,
    RouteTable,
    body,
    error_middleware,
    manifest_body,
    reply,
    wants_msgpack,
)
from refitd.daemon.app.membership import CLUSTER, MEMBERSHIP, REGISTRY_ORIGIN, Membership
from refitd.daemon.app.membership import routes as cluster_routes
from refitd.daemon.app.metrics import METRICS_KEY, PullMetrics
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.waits import WAITS, Waits, long_poll
from refitd.daemon.delta.routes import setup_deltas
from refitd.daemon.experts.pools import POOLS, ExpertPools, close_pools
from refitd.daemon.experts.routes import routes as expert_routes
from refitd.daemon.mirror.digestroutes import setup_digests
from refitd.daemon.mirror.routes import MIRRORS, setup_mirrors
from refitd.daemon.pull.listeners import Caller, PullCap, WriteRule
from refitd.daemon.pull.peerclient import PeerClient
from refitd.daemon.pull.pulls import PULLS, PullManager, RemoteSource
from refitd.errors import TransportError
from refitd.wire import (
    MSGPACK,
    STATUS_OF,
    DaemonRecord,
    LeaseRequest,
    ManifestIn,
    PackRequest,
    PullRequest,
    RegionAttach,
    RegionCreate,
)
from refitd.wire import routes as api
from refitd.wire.args import (
    DrainArgs,
    GcArgs,
    LeaseAt,
    LeaseCheckArgs,
    ModelAt,
    PeerDropArgs,
    PeerRegionsArgs,
    PullAt,
    PullWaitArgs,
    RegionAt,
    RenewArgs,
    VersionAt,
    WaitReadyArgs,
)

__all__ = [
    "DAEMON",
    "PULLS",
    "STATUS_OF",
    "create_app",
    "error_middleware",
    "routes",
]

routes = RouteTable()


@routes.handles(api.HEALTH)
async def health(request: web.Request) -> web.Response:
    return reply(request, {"status": "ok"})


@routes.handles(api.READY)
async def ready(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    if not d.ready:
        raise TransportError("not ready: the data plane is not up")
    return reply(request, {"status": "ready", "transport": d.mode})


@routes.handles(api.NODE)
async def node(request: web.Request) -> web.Response:
    return reply(request, await request.app[DAEMON].info())


# ---------------------------------------------------------------- regions


@routes.handles(api.CREATE_REGION)
async def create_region(request: web.Request) -> web.Response:
    req: RegionCreate = await body(request)
    return reply(request, await request.app[DAEMON].create_region(req, principal_of(request)))


@routes.handles(api.ATTACH_REGION)
async def attach_region(request: web.Request) -> web.Response:
    req: RegionAttach = await body(request)
    return reply(request, await request.app[DAEMON].attach_region(req, principal_of(request)))


@routes.handles(api.LIST_REGIONS)
async def list_regions(request: web.Request) -> web.Response:
    return reply(request, request.app[DAEMON].regions(principal_of(request)))


@routes.handles(api.GET_REGION)
async def get_region(request: web.Request, args: RegionAt) -> web.Response:
    return reply(request, request.app[DAEMON].region(principal_of(request), args.region_id))


@routes.handles(api.DELETE_REGION)
async def delete_region(request: web.Request, args: RegionAt) -> web.Response:
    info = await request.app[DAEMON].delete_region(args.region_id, principal_of(request))
    return reply(request, info)


# ---------------------------------------------------------------- sources


@routes.handles(api.GC)
async def gc(request: web.Request, args: GcArgs) -> web.Response:
    """Free regions of exited clients and stale segments; ``dry_run=1`` only lists them."""
    return reply(request, await request.app[DAEMON].gc(principal_of(request), args.dry_run))


@routes.handles(api.PUBLISH)
async def publish(request: web.Request) -> web.Response:
    async def read(max_shards: int) -> ManifestIn:
        # Decoded off the event loop (:func:`manifest_body`): other requests are
        # answered meanwhile.
        return await manifest_body(request, await request.read(), max_shards)

    # Its listeners hear of it (the delta book, the cluster registry): Daemon.publish.
    return reply(request, await request.app[DAEMON].publish(read, principal_of(request)))


@routes.handles(api.ALL_VERSIONS)
async def list_sources(request: web.Request) -> web.Response:
    return reply(request, request.app[DAEMON].versions(principal_of(request)))


@routes.handles(api.MODEL_VERSIONS)
async def list_versions(request: web.Request, args: ModelAt) -> web.Response:
    return reply(request, request.app[DAEMON].versions(principal_of(request), args.model))


def _asked(request: web.Request, args: VersionAt) -> tuple[Principal, str, int | None]:
    """Who asks for which version of which model (None: ``latest``)."""
    return principal_of(request), args.model, args.number


@routes.handles(api.GET_VERSION)
async def get_version(request: web.Request, args: VersionAt) -> web.Response:
    return reply(request, request.app[DAEMON].version(*_asked(request, args)))


@routes.handles(api.MANIFEST)
async def get_manifest(request: web.Request, args: VersionAt) -> web.Response:
    d = request.app[DAEMON]
    if wants_msgpack(request):
        # Encoded once per version and cached: a 100k-tensor manifest is served as is.
        return web.Response(body=d.manifest_bytes(*_asked(request, args)), content_type=MSGPACK)
    return reply(request, d.manifest(*_asked(request, args)))


@routes.handles(api.WAIT_READY)
async def wait_ready(request: web.Request, args: WaitReadyArgs) -> web.Response:
    """Answer once the version is READY, or after ``timeout`` seconds with its state."""
    held = long_poll(request, f"waiting for {args.model!r} v{args.version}")
    info = await request.app[DAEMON].leases.wait_ready(*_asked(request, args), args.timeout, held)
    return reply(request, info)


@routes.handles(api.DRAIN)
async def drain(request: web.Request, args: DrainArgs) -> web.Response:
    """Wait for the version's leases to drain; ``retire=1`` first refuses new ones."""
    # A long poll: counted, and ended (its place given back) once its client goes; what
    # the drain changes is changed before its first await (Leases.drain).
    held = long_poll(request, f"draining {args.model!r} v{args.version}")
    info = await request.app[DAEMON].leases.drain(
        *_asked(request, args), args.timeout, args.retire, held
    )
    return reply(request, info)


# ---------------------------------------------------------------- leases


@routes.handles(api.ACQUIRE_LEASE)
async def acquire(request: web.Request) -> web.Response:
    req: LeaseRequest = await body(request)
    return reply(request, request.app[DAEMON].leases.lease(req, principal_of(request)))


@routes.handles(api.CHECK_LEASE)
async def check_lease(request: web.Request, args: LeaseCheckArgs) -> web.Response:
    d = request.app[DAEMON]
    return reply(request, d.leases.check(args.lease_id, args.model, args.version))


@routes.handles(api.RENEW_LEASE)
async def renew(request: web.Request, args: RenewArgs) -> web.Response:
    # A mirror's lease is re-checked at its source, which may cut the ttl.
    return reply(request, await request.app[MIRRORS].leases.renew(args.lease_id, args.ttl))


@routes.handles(api.RELEASE_LEASE)
async def release(request: web.Request, args: LeaseAt) -> web.Response:
    request.app[DAEMON].leases.release(args.lease_id)
    return reply(request, None)


# ---------------------------------------------------------------- pulls


def caller_of(request: web.Request) -> Caller:
    """The principal submitting a pull, and how to refuse them another's object."""
    return Caller(principal_of(request).name, functools.partial(check_owner, request))


@routes.handles(api.SUBMIT_PULL)
async def submit_pull(request: web.Request) -> web.Response:
    req: PullRequest = await body(request)
    job = await request.app[PULLS].submit(req, caller_of(request))
    return reply(request, job.snapshot())


@routes.handles(api.LIST_PULLS)
async def list_pulls(request: web.Request) -> web.Response:
    """The caller's own pulls (every pull for root, or without authentication)."""
    return reply(request, request.app[PULLS].seen_by(principal_of(request)))


@routes.handles(api.GET_PULL)
async def pull_status(request: web.Request, args: PullAt) -> web.Response:
    return reply(request, request.app[PULLS].get(args.pull_id, caller_of(request)).snapshot())


@routes.handles(api.WAIT_PULL)
async def pull_wait(request: web.Request, args: PullWaitArgs) -> web.Response:
    """Answer when the pull ends, or after ``timeout`` seconds (at most a minute) with
    its progress."""
    job = request.app[PULLS].get(args.pull_id, caller_of(request), "wait for")
    async with long_poll(request, f"waiting for pull {job.pull_id}"):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.timeout):
                await job.finished.wait()
    return reply(request, job.snapshot())


@routes.handles(api.CANCEL_PULL)
async def cancel_pull(request: web.Request, args: PullAt) -> web.Response:
    job = await request.app[PULLS].cancel(args.pull_id, caller=caller_of(request))
    return reply(request, job.snapshot())


# ---------------------------------------------------------------- daemon to daemon


@routes.handles(api.PEER_REGIONS)
async def peer_regions(request: web.Request, args: PeerRegionsArgs) -> web.Response:
    ids, d = args.region_ids(), request.app[DAEMON]
    if args.lease is not None:  # records for a pull: only what that lease may read
        version = args.leased_version()
        return reply(request, d.leases.leased_regions(ids, args.lease, args.model, version))
    return reply(request, d.leases.peer_regions(ids))


@routes.handles(api.PEER_PACK)
async def peer_pack(request: web.Request) -> web.Response:
    req: PackRequest = await body(request)
    # A staging region is memory its lease's principal holds (its caps count it).
    return reply(
        request, await request.app[DAEMON].leases.pack_leased(req, principal_of(request).name)
    )


@routes.handles(api.PEER_DROP)
async def peer_drop(request: web.Request, args: PeerDropArgs) -> web.Response:
    await request.app[DAEMON].leases.release_staging(args.region_id, args.lease)
    return reply(request, None)


# ---------------------------------------------------------------- assembly

CleanupCtx = Callable[[web.Application], AsyncIterator[None]]


def create_app(
    d: Daemon,
    *,
    middlewares: Iterable[Any] = (),
    cleanup_ctx: Iterable[CleanupCtx] = (),
    setup: Iterable[Callable[[web.Application], None]] = (),
    token: str | None = None,
) -> web.Application:
    """The app around daemon ``d``, as ``d.config`` says (its body limit, cluster
    registry and mirror policy).

    Order: the error middleware wraps every other middleware so their refusals map
    too; the daemon's data plane starts (cleanup_ctx) before the site accepts, and
    running pulls are cancelled before the data plane closes.
    """
    app = web.Application(
        middlewares=[error_middleware, *middlewares],
        client_max_size=d.config.server.max_request_bytes,
    )
    app[DAEMON] = d
    # long polls held open, per principal
    app[WAITS] = Waits(d.config.limits.max_long_polls_per_principal)

    clients: dict[str, PeerClient] = {}

    # The daemon's: its version registry asks it which versions are complete across
    # hosts (a trainer split over hosts: each daemon holds some parts of a version).
    cluster = d.cluster
    app[CLUSTER] = cluster

    if cluster.kind == "etcd":
        # The registry is one origin of the peer allow-list: every registered daemon
        # whose record verifies is trusted, for as long as it stays registered.
        cluster.on_change(
            lambda: d.peers.replace(REGISTRY_ORIGIN, [r.url for r in cluster.daemons()])
        )

    def connect(url: str) -> RemoteSource:
        c = clients.get(url)
        if c is None:
            c = clients[url] = PeerClient(url, token=token)
        return RemoteSource(c, d.secret)

    # Host mirrors and relay (issue 25): built first, so the pull manager is built
    # with them (it asks them of each pull; they fill through the manager that asks).
    mirrors = setup_mirrors(app, d, connect)
    pulls = PullManager(d, connect, mirrors=mirrors)
    # Each pull is admitted by the write rule, then the pull cap, in this order.
    pulls.listen(WriteRule(d.store.regions, d.registry, d.staging))
    pulls.listen(PullCap(d.caps, pulls.running))
    app[PULLS] = pulls
    # The daemon's version listeners, told in this order: the delta book holds a
    # version that became READY before the registry is told of it.
    setup_deltas(app, d)  # delta refit (issue 37)
    me = DaemonRecord(d.node_id, d.config.registry.advertise_url, d.incarnation, d.mode, d.boot_id)
    app[MEMBERSHIP] = membership = Membership(cluster, d.registry, d.models, me)
    d.events.listen(membership)
    setup_digests(app, d)  # chunk digests at a version's source (issue 45)
    cluster.on_gone(
        lambda rec: pulls.fail_source(
            rec.url,
            f"source daemon {rec.node_id!r} at {rec.url} left the cluster registry (no "
            "keepalive within its lease TTL, or it stopped): its host is down or the daemon died",
        )
    )

    async def daemon_ctx(app: web.Application) -> AsyncIterator[None]:
        await d.start()
        try:
            yield
        finally:
            await pulls.close()
            await cluster.close()
            for c in clients.values():
                await c.close()
            await d.close()

    app.cleanup_ctx.append(daemon_ctx)
    app.cleanup_ctx.extend(cleanup_ctx)
    app.add_routes(routes)
    app[POOLS] = pools = ExpertPools(
        d.store, d.registry, d.config.limits.max_pool_bookkeeping_bytes_per_principal
    )
    pulls.listen(pools)  # the experts a pull rewrites leave their slots
    # Pulls by outcome, bytes by the path each took, once the app has metrics.
    pulls.listen(PullMetrics(lambda: app.get(METRICS_KEY)))
    app.on_shutdown.append(close_pools)  # before cleanup closes the regions
    app.add_routes(expert_routes)
    app.add_routes(cluster_routes)
    for fn in setup:
        fn(app)
    return app
