"""The MoE expert slot pools the daemon hosts: made, admitted, deleted, and kept fresh
under the pulls that rewrite them (one pool's operations:
:mod:`refitd.daemon.experts.pool`; their HTTP API: :mod:`refitd.daemon.experts.routes`).

A pool's two regions are made, and charged, as its creator's memory; its bookkeeping
is admitted against ``limits.max_pool_bookkeeping_bytes_per_principal`` before
anything is made, and a refused pool leaves nothing behind. Only the pool's own
copies write its slot region: a pull into one is refused (403).

Staleness: every pull that writes a pool's host region is noted on the pool twice,
when accepted (so no step copies rows while they are being rewritten and keeps them)
and when it ends (whatever copy a step made meanwhile is dropped too); the experts
whose rows it touches leave their slots before the pool's next operation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
from aiohttp import web

from refitd.daemon.access.auth import Principal
from refitd.daemon.experts.pool import ExpertPool, residency_of
from refitd.daemon.pull.core import dst_ids
from refitd.daemon.pull.listeners import Caller, Job, PullListener
from refitd.daemon.state.memory import check_shm_capacity
from refitd.daemon.state.registry import Registry
from refitd.daemon.state.store import RegionStore
from refitd.errors import (
    AccessDenied,
    ConfigError,
    ConflictError,
    NotFoundError,
    PlanError,
    QuotaExceeded,
)
from refitd.wire import (
    EnsureRequest,
    EnsureResult,
    InvalidateRequest,
    InvalidateResult,
    PoolCreate,
    PoolInfo,
    PoolStats,
    PrefetchRequest,
    PrefetchResult,
    PullRequest,
    RegionCreate,
)

__all__ = [
    "POOLS",
    "ExpertPools",
    "bookkeeping_bytes",
    "close_pools",
]

POOL_KEY_BYTES = 64
"""Daemon memory a pool's bookkeeping takes per expert row (``layers x experts``):
the planner's and its policy's per-expert lists (measured about 40 bytes)."""
POOL_SLOT_BYTES = 192
"""... per slot (the planner's, policy's and executor's per-slot lists; about 120)."""
POOL_LAYER_BYTES = 384
"""... per layer (per-layer lists, heaps and vectors; about 280)."""


def bookkeeping_bytes(spec: PoolCreate) -> int:
    """Bytes of daemon memory (besides its two regions) the pool ``spec`` describes
    keeps for its life: what ``limits.max_pool_bookkeeping_bytes_per_principal``
    counts, computed from the geometry before anything is built."""
    keys = spec.layers * spec.experts
    return POOL_KEY_BYTES * keys + POOL_SLOT_BYTES * spec.slots + POOL_LAYER_BYTES * spec.layers


class ExpertPools(PullListener):
    """The daemon's pools by name, and which regions they hold. A listener on the
    daemon's pulls: the experts a pull rewrites leave their slots when it is
    accepted and again when it ends (see the module's staleness).

    Built with the region ``store`` its pools' regions are made, charged, viewed
    and deleted in, the version ``registry`` (which regions a version publishes from:
    a step never writes those), and ``max_bookkeeping`` (bytes a principal's pools may
    keep, ``limits.max_pool_bookkeeping_bytes_per_principal``).

    A pool's operations for a principal (``info``, ``stats_of``, ``ensure``,
    ``prefetch``, ``invalidate``, ``delete``) refuse another's pool (403), and run
    under the pool's lock with its host-row rewrites applied (:meth:`locked`)."""

    def __init__(self, store: RegionStore, registry: Registry, max_bookkeeping: int) -> None:
        self.store = store
        self.registry = registry
        self.max_bookkeeping = max_bookkeeping
        self._pools: dict[str, ExpertPool] = {}
        #: per principal, the bookkeeping bytes of each pool it holds or is making
        self._bookkeeping: dict[str, dict[str, int]] = {}

    def all(self) -> list[ExpertPool]:
        return list(self._pools.values())

    def seen_by(self, who: Principal) -> list[PoolInfo]:
        """The pools ``who`` sees (:meth:`Principal.sees`): its own, every pool for
        root or without authentication."""
        return [p.info() for p in self._pools.values() if who.sees(p.owner)]

    def get(self, name: str) -> ExpertPool:
        pool = self._pools.get(name)
        if pool is None:
            raise NotFoundError(f"expert pool {name!r} does not exist on this daemon")
        return pool

    @contextlib.asynccontextmanager
    async def locked(self, who: Principal, name: str, action: str) -> AsyncIterator[ExpertPool]:
        """Pool ``name`` (404) if ``who`` may ``action`` it (403), held under its lock
        with host-row rewrites applied; 404 for a pool deleted while this waited."""
        pool = self.get(name)
        who.check_owns(pool.owner, action, f"expert pool {pool.name!r}")
        async with pool.lock:
            if pool.deleted:
                raise NotFoundError(f"expert pool {pool.name!r} was deleted")
            pool.apply_rewrites()
            pool.harvest()
            yield pool

    def _check_slots_unpublished(self, pool: ExpertPool) -> None:
        """Refuse (409) a step that would write a slot region a READY, pending or leased
        version publishes from (publishing from a pool's region is refused, so this
        holds the rule even for memory that became a pool's some other way)."""
        held = self.registry.protected_regions().get(pool.slot_region.region_id)
        if held is not None:
            model, version, why = held
            raise ConflictError(
                f"expert pool {pool.name!r} refused the step: its slot region "
                f"{pool.slot_region.region_id} holds {model!r} version {version}, which is "
                f"{why}; a published version's bytes never change"
            )

    async def info(self, who: Principal, name: str) -> PoolInfo:
        async with self.locked(who, name, "read") as pool:
            return pool.info()

    async def stats_of(self, who: Principal, name: str) -> PoolStats:
        async with self.locked(who, name, "read") as pool:
            return pool.stats()

    async def ensure(self, who: Principal, name: str, req: EnsureRequest) -> EnsureResult:
        """Plan with the expert cache, copy the misses into the slot region."""
        async with self.locked(who, name, "write") as pool:
            self._check_slots_unpublished(pool)
            planned, nbytes = pool.plan(req)
            # A warm step (nothing to copy) runs too: the executor checks the layer's
            # route and counts it.
            return await pool.off_loop(nbytes, pool.execute, planned)

    async def prefetch(self, who: Principal, name: str, req: PrefetchRequest) -> PrefetchResult:
        """Plan a prediction of a layer's next step; its copies land in the background."""
        async with self.locked(who, name, "write") as pool:
            self._check_slots_unpublished(pool)
            # Its own copies start in the background, but a slot it reuses may still be
            # receiving an earlier one.
            return await pool.off_loop(0, pool.prefetch, req)

    async def invalidate(
        self, who: Principal, name: str, req: InvalidateRequest
    ) -> InvalidateResult:
        """Drop the slots of experts whose host rows were rewritten."""
        async with self.locked(who, name, "write") as pool:
            return pool.invalidate(req)

    async def create(
        self, spec: PoolCreate, owner: str, principal: str | None = None
    ) -> ExpertPool:
        """Check the geometry, then create both regions and the pool; on any refusal
        nothing is left behind. A pool's two regions are the memory of ``principal``
        (its creator): admitted by its region and byte caps first (429), and counted."""
        store = self.store
        if principal is not None:
            rows = spec.layers * spec.experts + spec.slots
            with self._holding_bookkeeping(principal, spec):
                with store.holding(principal, 2, sum(spec.row_bytes) * rows):
                    pool = await self.create(spec, owner)
                    for made in (pool.host, pool.slot_region):
                        store.charge(principal, store.regions.get(made.region_id))
                self._bookkeeping[principal][spec.name] = bookkeeping_bytes(spec)
            return pool
        if spec.name in self._pools:
            raise ConflictError(f"expert pool {spec.name!r} refused: a pool of that name exists")
        if spec.slots < spec.experts:
            raise PlanError(
                f"expert pool {spec.name!r} refused: {spec.slots} slots cannot hold one "
                f"layer's {spec.experts} experts, and one step may route all of them"
            )
        expert_bytes = sum(spec.row_bytes)
        # Before any per-layer bookkeeping is built: a geometry whose bytes cannot
        # exist must not first allocate lists of its (possibly 2**62) layers.
        for n, region in ((spec.layers * spec.experts, "host rows"), (spec.slots, "slots")):
            check_shm_capacity(n * expert_bytes, f"expert pool {spec.name!r} {region}")
        try:
            residency = residency_of(spec)
        except ConfigError as exc:  # InconsistentResidency: a PlanError as well
            raise PlanError(f"expert pool {spec.name!r} refused: {exc}") from None
        del residency  # checked here so no region is created for a refused pool
        host = await store.create_region(
            RegionCreate(
                expert_bytes * spec.layers * spec.experts, owner=owner, label="experts-host"
            )
        )
        store.pool_regions[host.region_id] = spec.name  # never a version's memory (see publish)
        try:
            slots = await store.create_region(
                RegionCreate(expert_bytes * spec.slots, owner=owner, label="experts-slots")
            )
            store.pool_regions[slots.region_id] = spec.name
        except BaseException:
            await self._drop(host.region_id)
            raise
        try:
            # Its per-expert, per-slot and per-layer lists, built off the event loop
            # (bounded in bytes by the caller's admission).
            pool = await asyncio.to_thread(ExpertPool, spec, owner, host, slots, store.view)
        except BaseException:
            await self._drop(host.region_id)
            await self._drop(slots.region_id)
            raise
        # Re-checked: another create of the same name may have finished meanwhile.
        if spec.name in self._pools:
            await self._drop(host.region_id)
            await self._drop(slots.region_id)
            raise ConflictError(f"expert pool {spec.name!r} refused: a pool of that name exists")
        self._pools[spec.name] = pool
        return pool

    @contextlib.contextmanager
    def _holding_bookkeeping(self, principal: str, spec: PoolCreate) -> Iterator[None]:
        """Admit ``spec``'s bookkeeping (:func:`bookkeeping_bytes`) to ``principal``'s
        cap (429 past it, before anything is made) and hold its place for the block;
        a pool not made by the end gives it back."""
        cap = self.max_bookkeeping
        cost = bookkeeping_bytes(spec)
        held = self._bookkeeping.setdefault(principal, {})
        total = sum(held.values())
        if total + cost > cap:
            raise QuotaExceeded(
                f"expert pool {spec.name!r} refused: its {spec.layers} layers of "
                f"{spec.experts} experts and {spec.slots} slots keep {cost} bytes of the "
                f"daemon's memory, and {principal}'s pools keep {total} already, past its "
                f"cap (limits.max_pool_bookkeeping_bytes_per_principal = {cap})"
            )
        place = f"\0making {spec.name}"  # no pool name holds a NUL
        held[place] = cost
        try:
            yield
        finally:
            held.pop(place, None)

    async def delete(self, who: Principal, name: str) -> PoolInfo:
        """Delete pool ``name`` (404) for ``who`` (403 for another's), once the copies
        in flight landed; a request waiting for its lock is then refused (404)."""
        pool = self.get(name)
        who.check_owns(pool.owner, "delete", f"expert pool {pool.name!r}")
        async with pool.lock:
            await asyncio.to_thread(pool.close)  # no copy may land in a freed region
            info = pool.info()
            pool.deleted = True
            self._pools.pop(name, None)
            for held in self._bookkeeping.values():
                held.pop(name, None)
            for rid in (pool.host.region_id, pool.slot_region.region_id):
                with contextlib.suppress(NotFoundError):
                    await self._drop(rid)
        return info

    async def _drop(self, region_id: int) -> None:
        """Delete one of a pool's regions (it stops being a pool region first; never
        a staging region, so the store's rules are all a delete of it passes)."""
        self.store.pool_regions.pop(region_id, None)
        await self.store.delete(region_id)

    def holding(self, region_id: int) -> ExpertPool | None:
        """The pool whose host or slot region is ``region_id``, if any."""
        for pool in self._pools.values():
            if region_id in (pool.host.region_id, pool.slot_region.region_id):
                return pool
        return None

    def note_writes(self, req: PullRequest) -> None:
        """Mark every pool whose host region ``req`` writes (descriptors and packed
        blocks); its touched experts are dropped before the pool's next operation."""
        if not self._pools:
            return
        rows = req.descriptors.rows()
        for pool in self._pools.values():
            rid = pool.host.region_id
            mine = rows[rows[:, 2] == rid][:, 3:5]
            packed = [(p.dst_offset, p.nbytes) for p in req.pack_specs if p.dst_region == rid]
            if packed:
                mine = np.concatenate([mine, np.array(packed, dtype=np.int64).reshape(-1, 2)])
            pool.note_rewrite(mine)

    def admit(self, req: PullRequest, caller: Caller) -> None:
        """Refuse (403) a pull that writes a pool's slot region: only the pool's own
        copies write its slots, so that every slot holds the expert the cache names.
        (A pull may write a host region: its touched experts leave their slots.)"""
        if not self._pools:
            return
        dst = dst_ids(req.descriptors.rows(), req.pack_specs)
        for pool in self._pools.values():
            rid = pool.slot_region.region_id
            if rid in dst:
                raise AccessDenied(
                    f"pull refused: destination region {rid} is the slot region of expert "
                    f"pool {pool.name!r}, which only the pool's own copies write; pull into "
                    f"its host region {pool.host.region_id} instead; nothing was transferred"
                )

    def started(self, job: Job) -> None:
        self.note_writes(job.req)

    def ended(self, job: Job) -> None:
        self.note_writes(job.req)

    def stats(self, sees: Callable[[str], bool] = lambda owner: True) -> list[PoolStats]:
        """Every pool's numbers whose owner ``sees`` allows (by owner)."""
        return [pool.stats() for pool in self._pools.values() if sees(pool.owner)]


POOLS: web.AppKey[ExpertPools] = web.AppKey("expert_pools", ExpertPools)


async def close_pools(app: web.Application) -> None:
    """On shutdown, before regions close: let every pool's copies in flight land."""
    pools = app.get(POOLS)
    if pools is None:
        return
    for pool in pools.all():
        async with pool.lock:
            await asyncio.to_thread(pool.close)
