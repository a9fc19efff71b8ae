"""The HTTP API of expert slot pools: ``/v1/experts`` (see :mod:`refitd.daemon.experts.pools`).

A handler decodes, calls the daemon's pools (:class:`~refitd.daemon.experts.pools.ExpertPools`:
the caller's pool, under its lock, host-row rewrites applied first) and encodes.
"""

from __future__ import annotations

from aiohttp import web

from refitd.daemon.access.auth import owner_for, principal_of
from refitd.daemon.app.httpio import RouteTable, body, reply
from refitd.daemon.experts.pools import POOLS
from refitd.wire import (
    EnsureRequest,
    InvalidateRequest,
    PoolCreate,
    PrefetchRequest,
)
from refitd.wire import routes as api
from refitd.wire.args import PoolAt

__all__ = ["routes"]

routes = RouteTable()


@routes.handles(api.CREATE_POOL)
async def create_pool(request: web.Request) -> web.Response:
    spec: PoolCreate = await body(request)
    owner = owner_for(request, spec.owner)
    # A pool's two regions are its creator's memory: they count against its caps.
    pool = await request.app[POOLS].create(spec, owner, principal_of(request).name)
    return reply(request, pool.info())


@routes.handles(api.LIST_POOLS)
async def list_pools(request: web.Request) -> web.Response:
    """The caller's own pools (every pool for root, or without authentication)."""
    return reply(request, request.app[POOLS].seen_by(principal_of(request)))


@routes.handles(api.GET_POOL)
async def get_pool(request: web.Request, args: PoolAt) -> web.Response:
    return reply(request, await request.app[POOLS].info(principal_of(request), args.pool))


@routes.handles(api.POOL_STATS)
async def pool_stats(request: web.Request, args: PoolAt) -> web.Response:
    return reply(request, await request.app[POOLS].stats_of(principal_of(request), args.pool))


@routes.handles(api.DELETE_POOL)
async def delete_pool(request: web.Request, args: PoolAt) -> web.Response:
    return reply(request, await request.app[POOLS].delete(principal_of(request), args.pool))


@routes.handles(api.ENSURE)
async def ensure(request: web.Request, args: PoolAt) -> web.Response:
    """Plan with the expert cache, copy the misses into the slot region."""
    req: EnsureRequest = await body(request)
    return reply(request, await request.app[POOLS].ensure(principal_of(request), args.pool, req))


@routes.handles(api.PREFETCH)
async def prefetch(request: web.Request, args: PoolAt) -> web.Response:
    """Plan a prediction of a layer's next step; its copies land in the background."""
    req: PrefetchRequest = await body(request)
    result = await request.app[POOLS].prefetch(principal_of(request), args.pool, req)
    return reply(request, result)


@routes.handles(api.INVALIDATE)
async def invalidate(request: web.Request, args: PoolAt) -> web.Response:
    """Drop the slots of experts whose host rows were rewritten."""
    req: InvalidateRequest = await body(request)
    result = await request.app[POOLS].invalidate(principal_of(request), args.pool, req)
    return reply(request, result)
