"""The HTTP side of host mirrors and relay: the holder book's and a mirror's routes,
and :func:`setup_mirrors`, which builds the store from the daemon's parts and installs
it and its routes on the app (the pull manager is then built with it: see
:mod:`refitd.daemon.mirror.mirrors`, Wiring)."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from refitd.daemon.access.auth import principal_of
from refitd.daemon.app.httpio import DAEMON, RouteTable, body, reply
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.waits import long_poll
from refitd.daemon.mirror.digestroutes import DIGESTS
from refitd.daemon.mirror.feed import serve_feed
from refitd.daemon.mirror.mirrors import Mirrors
from refitd.daemon.pull.sources import RemoteSource
from refitd.errors import ProtocolError, RequestTooLarge
from refitd.wire import routes as api
from refitd.wire.args import MirrorReadArgs, MirrorStateArgs
from refitd.wire.mirrors import MAX_JOIN_BYTES, HolderJoin, MirrorLease

__all__ = ["MIRRORS", "routes", "setup_mirrors"]


MIRRORS: web.AppKey[Mirrors] = web.AppKey("mirrors", Mirrors)
routes = RouteTable()


@routes.handles(api.MIRROR_HOLDERS)
async def join_holders(request: web.Request) -> web.Response:
    """A mirror of a version this daemon is the source of joins its holder book (or
    reports its rate and its complete chunks); answers the version's deal
    (:mod:`refitd.daemon.mirror.book`), waiting at most ``DEAL_GRACE_S`` for it. Only a peer daemon joins (the join is signed with the
    deployment secret, 403 otherwise), in a body of at most ``MAX_JOIN_BYTES`` (413,
    refused before it is read) whose fields are bounded (400)."""
    if request.content_length is None or request.content_length > MAX_JOIN_BYTES:
        sent = (
            "a body of unstated length"
            if request.content_length is None
            else (f"{request.content_length} bytes")
        )
        raise RequestTooLarge(
            f"{request.method} {request.path} sent {sent}; a holder join is at most "
            f"{MAX_JOIN_BYTES} bytes, with its length stated"
        )
    j = await body(request, HolderJoin)
    d, book = request.app[DAEMON], request.app[MIRRORS].book
    d.check_holder_join(j)
    if (digests := request.app.get(DIGESTS)) is not None:
        digests.prepare(j.model, j.version)  # the joiner checks what other holders send
    now = time.monotonic()
    a = book.join(j, request.app[MIRRORS].chunk_count(j.model, j.version), now)
    if not a.deal:  # the version's holders are still joining: at most DEAL_GRACE_S
        a = await book.wait_dealt(j.model, j.version, now)
    return reply(request, a)


@routes.handles(api.MIRROR_STATE)
async def mirror_state(request: web.Request, args: MirrorStateArgs) -> web.Response:
    """A mirror's progress; with ``after=N`` it answers once more than ``N`` chunks
    are complete, the mirror ended, or ``timeout`` seconds passed (at most
    :data:`~refitd.wire.args.MAX_WAIT_S`). A wait is a long poll of its caller:
    counted against the per-principal cap (429 past it) and ended when its client
    goes."""
    model, version, after, timeout_s = args.model, args.version, args.after, args.timeout
    mirrors = request.app[MIRRORS]
    # Who may see it first: whether a version is mirrored is the model's readers' only.
    mirrors.leases.check_state_reader(principal_of(request), model, version, args.lease)
    m = mirrors.find(model, version)
    if int(m.done.sum()) <= after and not m.finished and timeout_s > 0:
        async with long_poll(request, f"waiting for the mirror of {model!r} v{version}"):
            deadline = time.monotonic() + timeout_s
            while int(m.done.sum()) <= after and not m.finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await m.changed(left)
    return reply(request, mirrors.state(m))


@routes.handles(api.MIRROR_FEED)
async def mirror_feed(request: web.Request, args: MirrorReadArgs) -> web.StreamResponse:
    """A mirror's complete chunks as they land, under a lease on its version here
    (:mod:`refitd.daemon.mirror.feed`)."""
    model, version, lease_id = args.model, args.version, args.lease
    if not lease_id:
        raise ProtocolError(f"GET {request.path} refused: the feed is read under a lease (?lease=)")
    d = request.app[DAEMON]
    # The lease first (409 for one not live on this version): whether a version is
    # mirrored is told only to a holder of a lease on it.
    d.leases.check(lease_id, model, version)
    m = request.app[MIRRORS].find(model, version)
    return await serve_feed(request, m, d.leases, lease_id)


@routes.handles(api.MIRROR_LEASE)
async def mirror_lease(request: web.Request) -> web.Response:
    """A peer daemon leases this daemon's mirror of a version, under its live lease at
    the source; the request is signed with the deployment secret (403 otherwise)."""
    req = await body(request, MirrorLease)
    d = request.app[DAEMON]
    grant = await request.app[MIRRORS].leases.grant(req, d.secret)
    return reply(request, grant, 201)


def setup_mirrors(
    app: web.Application, d: Daemon, connect: Callable[[str], RemoteSource]
) -> Mirrors:
    """Install the mirror store of daemon ``d`` (built with the parts of ``d`` it uses,
    as ``d.config`` says) and its routes on ``app``; ``connect(url)`` is the peer
    daemon at ``url`` (a URL this daemon trusts). Build the pull manager with the
    store it returns (its ``mirrors``); the daemon's lease rules read the table of
    mirrors still filling (``d.filling``) that the store is built with. Nothing is
    set on ``d`` or on a pull manager."""
    from refitd.daemon.app.membership import CLUSTER

    def self_url() -> str:
        me = app[CLUSTER].me
        return me.url if me is not None else ""

    def remote(url: str) -> RemoteSource:
        """The trusted peer daemon at ``url`` (refused, 400, if ``d`` does not trust it)."""
        return connect(d.peers.check(url))

    mirrors = Mirrors(
        d.config.mirrors,
        registry=d.registry,
        store=d.store,
        models=d.models,
        plane=d.plane,
        filling=d.filling,
        remote=remote,
        self_url=self_url,
        node_id=d.node_id,
        secret=d.secret,
        pull_timeout_s=d.config.data_plane.pull_timeout_s,
        lease_changed=d.leases.changed,
    )
    app[MIRRORS] = mirrors
    app.add_routes(routes)

    async def close(app: web.Application) -> None:
        await mirrors.close()

    app.on_shutdown.append(close)
    return mirrors
