"""The HTTP side of chunk digests at a version's source:
``GET /v1/mirrors/{model}/{version}/digests?lease=`` (:mod:`refitd.daemon.mirror.digest`),
and :func:`setup_digests`, which installs the source's digest cache on the app."""

from __future__ import annotations

from aiohttp import web

from refitd.daemon.app.httpio import RouteTable, reply
from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.digest import SourceDigests
from refitd.wire import routes as api
from refitd.wire.args import MirrorReadArgs

__all__ = ["DIGESTS", "routes", "setup_digests"]

DIGESTS: web.AppKey[SourceDigests] = web.AppKey("digests", SourceDigests)
routes = RouteTable()


@routes.handles(api.MIRROR_DIGESTS)
async def chunk_digests(request: web.Request, args: MirrorReadArgs) -> web.Response:
    """The digest of each chunk of a version this daemon is the source of, for a
    caller holding a live lease on it here (403 with no lease named, 409 for one not
    live on that version, or a version this daemon holds as a mirror)."""
    digests = request.app[DIGESTS]
    return reply(request, await digests.get(args.model, args.version, args.lease))


def setup_digests(app: web.Application, d: Daemon) -> SourceDigests:
    """Install daemon ``d``'s digest cache (built with the parts of ``d`` it reads) and
    its route on ``app``; its computations are cancelled at shutdown, before the
    regions they read are unmapped."""
    digests = SourceDigests(d.registry, d.store, d.models)
    app[DIGESTS] = digests
    app.add_routes(routes)

    async def close(app: web.Application) -> None:
        await digests.close()

    app.on_shutdown.append(close)
    return digests
