"""The HTTP API of expert slot pools: ``/v1/experts`` (see :mod:`refitd.daemon.experts.pools`).

A handler decodes, checks the caller may act on the pool, calls the pool under its
lock (host-row rewrites applied first) and encodes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from refitd.daemon.access.auth import check_owner, owner_for, principal_of
from refitd.daemon.app.httpio import DAEMON, RouteTable, body, reply
from refitd.daemon.experts.pool import ExpertPool
from refitd.daemon.experts.pools import POOLS
from refitd.errors import ConflictError, NotFoundError
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


def _pool(request: web.Request, args: PoolAt, action: str) -> ExpertPool:
    pool = request.app[POOLS].get(args.pool)
    check_owner(request, pool.owner, action, f"expert pool {pool.name!r}")
    return pool


@contextlib.asynccontextmanager
async def _locked(pool: ExpertPool) -> AsyncIterator[ExpertPool]:
    """Hold the pool's lock, with host-row rewrites applied; refuse a pool deleted
    while this request waited."""
    async with pool.lock:
        if pool.deleted:
            raise NotFoundError(f"expert pool {pool.name!r} was deleted")
        pool.apply_rewrites()
        pool.harvest()
        yield pool


def _check_slots_unpublished(request: web.Request, pool: ExpertPool) -> None:
    """Refuse (409) a step that would write a slot region a READY, pending or leased
    version publishes from (publishing from a pool's region is refused, so this
    holds the rule even for memory that became a pool's some other way)."""
    held = request.app[DAEMON].registry.protected_regions().get(pool.slot_region.region_id)
    if held is not None:
        model, version, why = held
        raise ConflictError(
            f"expert pool {pool.name!r} refused the step: its slot region "
            f"{pool.slot_region.region_id} holds {model!r} version {version}, which is {why}; "
            "a published version's bytes never change"
        )


@routes.handles(api.GET_POOL)
async def get_pool(request: web.Request, args: PoolAt) -> web.Response:
    async with _locked(_pool(request, args, "read")) as pool:
        return reply(request, pool.info())


@routes.handles(api.POOL_STATS)
async def pool_stats(request: web.Request, args: PoolAt) -> web.Response:
    async with _locked(_pool(request, args, "read")) as pool:
        return reply(request, pool.stats())


@routes.handles(api.DELETE_POOL)
async def delete_pool(request: web.Request, args: PoolAt) -> web.Response:
    pool = _pool(request, args, "delete")
    return reply(request, await request.app[POOLS].delete(pool.name))


@routes.handles(api.ENSURE)
async def ensure(request: web.Request, args: PoolAt) -> web.Response:
    """Plan with the expert cache, copy the misses into the slot region."""
    req: EnsureRequest = await body(request)
    async with _locked(_pool(request, args, "write")) as pool:
        _check_slots_unpublished(request, pool)
        planned, nbytes = pool.plan(req)
        # A warm step (nothing to copy) runs too: the executor checks the layer's
        # route and counts it.
        result = await pool.off_loop(nbytes, pool.execute, planned)
    return reply(request, result)


@routes.handles(api.PREFETCH)
async def prefetch(request: web.Request, args: PoolAt) -> web.Response:
    """Plan a prediction of a layer's next step; its copies land in the background."""
    req: PrefetchRequest = await body(request)
    async with _locked(_pool(request, args, "write")) as pool:
        _check_slots_unpublished(request, pool)
        # Its own copies start in the background, but a slot it reuses may still be
        # receiving an earlier one.
        result = await pool.off_loop(0, pool.prefetch, req)
    return reply(request, result)


@routes.handles(api.INVALIDATE)
async def invalidate(request: web.Request, args: PoolAt) -> web.Response:
    """Drop the slots of experts whose host rows were rewritten."""
    req: InvalidateRequest = await body(request)
    async with _locked(_pool(request, args, "write")) as pool:
        return reply(request, pool.invalidate(req))
