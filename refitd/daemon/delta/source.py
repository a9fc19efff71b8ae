"""Deltas at the source: each READY version compared, bytewise, with the version
before it, and the record of its changed units kept for the receivers that ask.

When a version becomes READY, :class:`DeltaBook` (one of the daemon's version
listeners, :mod:`refitd.daemon.state.events`) compares each of its blocks with the
same block (tensor, offset, shape, dtype) of the newest earlier READY version of the
model, the *base*: a trainer that double-buffers keeps that version's memory
untouched until it retires it, and the book holds a lease on both versions while it
compares, so neither is retired (and rewritten) under the comparison. The comparison
runs in a thread pool, off the event loop, one 1 MiB chunk at a time: each chunk of
both sides is copied through the bus-error guard into private memory (a segment its
owner shrinks fails the comparison, not the daemon), compared as units and
digested. The book keeps, per version, the byte offsets (int64) and new bytes of its
changed units, ``(8 + unit)`` bytes a change, and the lane digests of the version and
its base. A version's record goes with the version (retired or gone).

The book serves a planned pull's changes from these records: staged for its lease
(``POST /v1/deltas/pack``) or streamed (``POST /v1/deltas/stream``), selected and
checked by :mod:`refitd.daemon.delta.selection`. The mechanism and its costs:
``docs/delta.md``; the rules: ``docs/trust.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from refitd.config import LimitsConfig
from refitd.daemon.access.auth import Principal
from refitd.daemon.access.owners import ModelOwners
from refitd.daemon.app.waits import Waits
from refitd.daemon.delta.plans import Plans
from refitd.daemon.state.drain import LeaseDrain
from refitd.daemon.state.events import VersionListener
from refitd.daemon.state.registry import Registry
from refitd.daemon.state.staging import StagingPool
from refitd.daemon.state.store import RegionStore
from refitd.delta.compare import (
    JobResult,
    Table,
    address_of,
    assemble,
    block_hash,
    check_bounds,
    check_twins,
    digest,
    itemsize_of,
    jobs_of,
    pair_with,
    run_job,
    table_of,
)
from refitd.delta.diff import LANES, unit_of
from refitd.delta.stream import ChangeIndex
from refitd.errors import ConflictError, RefitError
from refitd.wire import DeltaInfo, DeltaState, VersionInfo, VersionState
from transports.local import copy_batch_guarded

__all__ = ["KEEP_RECORDS", "MAX_CHAIN", "DeltaBook", "DeltaRecord"]

log = logging.getLogger("refitd.deltas")

HOLD_S = 3600.0
"""The lease the book holds on a model's newest version, the next version's base,
until the next one is compared with it or its publisher drains it."""

KEEP_RECORDS = 8
"""Records kept per model (a retired version's without its changed units)."""

MAX_CHAIN = 4
"""An engine at most this many versions behind gets a delta composed of the records
between (each still READY, with its changes): v -> v+k for k <= 4."""


I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
_T = TypeVar("_T")


@dataclass
class _Hold:
    """A version held as the next one's base: a lease on it, so its publisher's drain
    (before rewriting its memory) waits for the comparison reading it."""

    version: int
    lease_id: str
    #: its block table, built in a worker thread (:func:`refitd.delta.compare.table_of`)
    table: asyncio.Future[Table]
    busy: int = 0  # comparisons reading it now
    yielded: bool = False  # drained, or no longer the newest: released once not busy
    released: bool = False


@dataclass
class DeltaRecord:
    model: str
    version: int
    state: DeltaState = DeltaState.COMPUTING
    base: int = -1
    digest: str = ""
    base_digest: str = ""
    unit: int = 0
    compared: int = 0
    seconds: float = 0.0
    reason: str = ""
    #: the version's changed units (byte offsets, region by region), and each one's
    #: old bytes then new bytes (``2 * unit`` bytes a change, in the same order)
    index: ChangeIndex = field(default_factory=lambda: ChangeIndex.of({}))
    values: U8 = field(default_factory=lambda: np.zeros(0, np.uint8))

    #: whether ``index`` and ``values`` hold the version's changes from its base (a
    #: link of a composed delta, :meth:`DeltaBook._chain`), and its block table
    linkable: bool = False
    table: Table | None = None

    def drop_changes(self) -> None:
        self.index = ChangeIndex.of({})
        self.values = np.zeros(0, np.uint8)
        self.linkable = False
        self.table = None

    def retire(self) -> None:
        """The version was retired: no delta to it is served any more (a lease still on
        it refits in full). Its changes stay, a link of deltas to later versions, while
        the record is among the model's newest :data:`MAX_CHAIN` (``_forget``)."""
        if self.state == DeltaState.READY:
            self.state = DeltaState.NONE
            self.reason = (
                f"v{self.version} was retired: deltas to it are no longer served, its "
                "changed units are kept only to compose deltas to later versions"
            )

    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def changed(self) -> int:
        return len(self.index.offsets)

    def info(self) -> DeltaInfo:
        held = self.index.offsets.nbytes + self.values.nbytes
        return DeltaInfo(
            self.model,
            self.version,
            self.state,
            self.base,
            self.digest,
            self.base_digest,
            self.unit,
            self.changed,
            self.compared,
            held,
            self.seconds,
            self.reason,
        )


@dataclass
class _Run:
    """What a comparison found: each block's hash (new side, base side), the two
    digests, and the changes (unless ``over`` the budget)."""

    hash_new: U8
    hash_old: U8
    digest_new: str = ""
    digest_old: str = ""
    over: bool = False
    index: ChangeIndex = field(default_factory=lambda: ChangeIndex.of({}))
    values: U8 = field(default_factory=lambda: np.zeros(0, np.uint8))


class DeltaBook(VersionListener):
    """The delta records of one daemon's versions, and the pool that compares them,
    built with the parts it uses: the version ``registry`` (versions, their merged
    manifests, the book's hold leases), the region ``store`` (the bytes compared),
    the ``staging`` pool (a delta staged for a lease), the lease ``drain``, told
    when the book lets go of a hold (a publisher's drain may be waiting for it), and
    the model ``models`` (who reads a model's delta records).
    ``max_bytes``: what the records may hold together (``[pulls] delta_max_bytes``;
    0: a quarter of the host's memory); ``max_plan_runs``: the runs a delta request's
    plan may expand into (``limits.max_plan_runs``)."""

    def __init__(
        self,
        registry: Registry,
        store: RegionStore,
        staging: StagingPool,
        drain: LeaseDrain,
        models: ModelOwners,
        *,
        max_bytes: int = 0,
        enabled: bool = True,
        threads: int | None = None,
        waits: Waits | None = None,
        max_plan_runs: int = LimitsConfig().max_plan_runs,
    ) -> None:
        self.registry = registry
        self.max_plan_runs = max_plan_runs
        #: the plans kept for delta readers (:mod:`refitd.daemon.delta.plans`)
        self.plans = Plans()
        self.store = store
        self.staging = staging
        self.drain = drain
        self.models = models
        #: the long polls each principal holds open (a pack waiting for a comparison)
        self.waits = waits if waits is not None else Waits()
        #: what the records may hold together, bytes (``[pulls] delta_max_bytes``)
        self.max_bytes = max_bytes or _quarter_of_memory()
        self._pending = 0  # changes kept by comparisons still running, bytes
        #: whether versions are held and compared at all (``[pulls] deltas``)
        self.enabled = enabled
        self._holds: dict[str, _Hold] = {}
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="refitd-delta")
        self._records: dict[tuple[str, int], DeltaRecord] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ records

    async def published(self, info: VersionInfo) -> None:
        """A part of ``info``'s version was published: once the version is READY, hold
        it (the next version's base) and compare it with the version held before (in
        the background). Nothing here awaits: the hold is taken as the publish ends."""
        reg = self.registry
        model, version = info.model, info.version
        if not self.enabled or (model, version) in self._records:
            return
        if info.state != VersionState.READY:
            return
        self._forget(model)
        rec = self._records[(model, version)] = DeltaRecord(model, version)
        # A step per shard: in a worker thread, not on the loop (a version may have
        # tens of thousands of tiny shards).
        merged = reg.merged(model, version)
        table = asyncio.get_running_loop().run_in_executor(
            self._pool, table_of, merged, itemsize_of
        )
        hold = _Hold(version, reg.acquire(model, version, HOLD_S, "delta-base").lease_id, table)
        base = self._holds.get(model)
        self._holds[model] = hold
        hold.busy += 1
        if base is not None:
            base.busy += 1
            base.yielded = True  # no longer the model's base: let go once compared
        task = asyncio.create_task(self._compute(rec, hold, base))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def draining(self, model: str, version: int) -> None:
        """``version`` is being drained (its publisher is about to rewrite its memory):
        stop holding it as a base, now, or once the comparison reading it ends."""
        hold = self._holds.get(model)
        if hold is None or hold.version != version:
            return
        del self._holds[model]
        hold.yielded = True
        self._let_go(hold)

    def _let_go(self, hold: _Hold) -> None:
        if hold.busy or not hold.yielded or hold.released:
            return
        hold.released = True
        with contextlib.suppress(RefitError):
            self.registry.release(hold.lease_id)
        self.drain.changed()

    def _forget(self, model: str) -> None:
        """Drop the changed units of retired versions; keep the newest records."""
        live = {v.version for v in self.registry.versions(model) if v.state != "retired"}
        mine = sorted(k for k in self._records if k[0] == model)
        for i, key in enumerate(mine):
            if key[1] not in live:
                self._records[key].retire()
                # The newest MAX_CHAIN - 1 before this publish stay links of a chain.
                if i < len(mine) - (MAX_CHAIN - 1):
                    self._records[key].drop_changes()
        for key in mine[: max(0, len(mine) - KEEP_RECORDS)]:
            del self._records[key]

    async def info(
        self,
        who: Principal,
        model: str,
        version: int,
        wait_s: float,
        held: AbstractAsyncContextManager[object],
    ) -> DeltaInfo:
        """``version``'s record for a reader of ``model`` (403 else), after up to
        ``wait_s`` seconds for its comparison (a wait is ``held``: the request's long
        poll); 404 for a version this daemon does not hold."""
        self.models.check_read(who, model, "read")
        async with held if wait_s > 0 else contextlib.nullcontext():
            self.registry.version(model, version)
            rec = self._records.get((model, version))
            if rec is None:
                why = "no delta record of this version" if self.enabled else "deltas are off here"
                return DeltaInfo(model, version, DeltaState.NONE, reason=why)
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await rec.done.wait()
        return rec.info()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------ comparing

    async def _compute(self, rec: DeltaRecord, hold: _Hold, base: _Hold | None) -> None:
        t0 = time.perf_counter()
        reg = self.registry
        try:
            table = await hold.table
            rec.unit = unit_of(table.itemsizes)
            if self.store.device_kinds(set(np.unique(table.region).tolist())):
                raise ConflictError(
                    "published in GPU memory: deltas are compared in host memory only"
                )
            why = "no earlier version held to compare with"
            twins: tuple[I64, I64] | str | None = None
            if base is not None:
                twins = await self.in_pool(pair_with, table, await base.table)
                why = (
                    f"v{base.version} is laid out otherwise ({twins})"
                    if isinstance(twins, str)
                    else ""
                )
                if not why and not reg.is_live(base.lease_id):
                    why = f"the hold on v{base.version} expired"
            if why:  # the version's digest only: a full refit of it records it
                run = await self._run(table, rec.unit, None)
                rec.digest = run.digest_new
                rec.state, rec.reason = DeltaState.NONE, why
            else:
                assert base is not None and isinstance(twins, tuple)
                await self._compare(rec, table, twins, base.version)
                if not reg.is_live(base.lease_id):  # its memory may have changed meanwhile
                    rec.drop_changes()
                    rec.state = DeltaState.NONE
                    rec.reason = f"the hold on v{base.version} expired during the comparison"
        except (RefitError, OSError) as exc:
            rec.state, rec.reason = DeltaState.NONE, f"comparison refused: {exc}"
        except Exception as exc:
            rec.state, rec.reason = DeltaState.NONE, f"comparison failed: {exc!r}"
            log.error("delta of %s v%d failed", rec.model, rec.version, exc_info=exc)
        finally:
            for h in (hold, base):
                if h is not None:
                    h.busy -= 1
                    self._let_go(h)
            rec.seconds = time.perf_counter() - t0
            rec.done.set()
            log.info(
                "delta of %s v%d: %s (base v%d, %d changed units, %.3f s)",
                rec.model,
                rec.version,
                rec.state,
                rec.base,
                rec.changed,
                rec.seconds,
            )

    async def in_pool(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in the comparison's thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _compare(
        self, rec: DeltaRecord, table: Table, twins: tuple[I64, I64], base: int
    ) -> None:
        left = max(0, self.max_bytes - self.held_bytes())
        run = await self._run(table, rec.unit, twins, budget=left)
        rec.base = base
        rec.digest, rec.base_digest = run.digest_new, run.digest_old
        known = self._records.get((rec.model, base))
        if known is not None and known.digest and known.digest != rec.base_digest:
            raise ConflictError(
                f"base v{base}'s bytes changed since it was published (digest "
                f"{known.digest} then, {rec.base_digest} now): a READY version was rewritten"
            )
        if run.over:
            rec.state = DeltaState.NONE
            rec.reason = (
                f"its changes would hold more than the {left} bytes left of the daemon "
                f"memory delta records may hold ([pulls] delta_max_bytes = {self.max_bytes})"
            )
            return
        rec.index, rec.values = run.index, run.values
        rec.compared = table.total
        rec.state = DeltaState.READY
        rec.linkable, rec.table = True, table

    async def _run(
        self,
        table: Table,
        unit: int,
        twins: tuple[I64, I64] | None,
        budget: int | None = None,
    ) -> _Run:
        """Compare ``table``'s blocks with their ``twins`` in the base (None: the
        version's lanes only), job by job in the pool: at most two jobs per thread in
        flight, so the loop holds a handful of futures whatever the block count. With
        ``budget``, the changes are kept only while they hold at most that many bytes:
        past it (``over``) none are, the digests still are taken."""
        views = {}
        for r in np.unique(table.region).tolist() + (
            np.unique(twins[0]).tolist() if twins is not None else []
        ):
            views[int(r)] = self.store.view(int(r))
        sizes = {r: len(v) for r, v in views.items()}
        address = {r: address_of(v) for r, v in views.items()}
        what = "comparison refused"
        await self.in_pool(check_bounds, table, sizes, what)
        if twins is not None:
            await self.in_pool(check_twins, table, twins, sizes, what)
        jobs = await self.in_pool(jobs_of, table)
        out = _Run(
            np.zeros((len(table.keys), 16), np.uint8), np.zeros((len(table.keys), 16), np.uint8)
        )
        partial: dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = {}
        kept: list[JobResult] = []
        held = 0
        window = 2 * self.threads
        pending: set[asyncio.Future[JobResult]] = set()
        order: dict[asyncio.Future[JobResult], int] = {}
        results: dict[int, JobResult] = {}
        nxt = 0
        try:
            while nxt < jobs.count or pending:
                while nxt < jobs.count and len(pending) < window:
                    fut = asyncio.get_running_loop().run_in_executor(
                        self._pool, run_job, table, jobs, nxt, twins, address, unit,
                        copy_batch_guarded,
                    )  # fmt: skip
                    pending.add(fut)
                    order[fut] = nxt
                    nxt += 1
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    j, res = order.pop(fut), fut.result()
                    out.hash_new[res.whole] = res.hash_new
                    out.hash_old[res.whole] = res.hash_old
                    for b, ln, lo in res.partial:
                        acc = partial.setdefault(
                            b, (np.zeros(LANES, np.uint64), np.zeros(LANES, np.uint64))
                        )
                        acc[0].__iadd__(ln)
                        acc[1].__iadd__(lo)
                    if out.over or twins is None:
                        continue
                    held += res.nbytes
                    self._pending += res.nbytes
                    results[j] = res
                    if budget is not None and held > budget:
                        out.over = True
                        results.clear()
        finally:
            for fut in pending:
                fut.cancel()
            self._pending -= held
        for b, (ln, lo) in partial.items():
            out.hash_new[b] = np.frombuffer(block_hash(table.keys[b], ln), np.uint8)
            out.hash_old[b] = np.frombuffer(block_hash(table.keys[b], lo), np.uint8)
        kept = [results[j] for j in sorted(results)]
        out.digest_new = digest(table, out.hash_new)
        out.digest_old = digest(table, out.hash_old) if twins is not None else ""
        if kept:
            out.index, out.values = await self.in_pool(assemble, kept)
        return out

    def record(self, model: str, version: int) -> DeltaRecord | None:
        """The delta record of ``model`` ``version``, if the book keeps one."""
        return self._records.get((model, version))

    def held_bytes(self) -> int:
        """Daemon memory the delta records hold now, with comparisons' kept changes."""
        held = sum(r.index.offsets.nbytes + r.values.nbytes for r in self._records.values())
        return held + self._pending


def _quarter_of_memory() -> int:
    """A quarter of the host's physical memory, bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
