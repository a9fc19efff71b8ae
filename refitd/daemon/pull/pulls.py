"""Pulls: validate a whole plan, then move its bytes, reporting progress.

Order of a pull, and why:

1. the lease is checked at the source (a stale or unleased read is a 409, before
   anything else);
2. the source's region records are fetched (from this daemon, or from the peer
   daemon over HTTP, MAC-verified) and every descriptor and pack spec is checked
   against them and against this daemon's own records: the first bad one is named
   in a 400 and nothing moves;
3. pack specs are executed by the source daemon into a staging region it owns, and
   each is read back with one descriptor;
4. the bytes move along the path chosen at submit (see :meth:`PullPaths.choose_path`),
   through one :class:`~transports.interface.Peer` and the daemon's one byte loop
   (:func:`refitd.daemon.pull.move.move`: pieces, batches, progress, errors) whatever the
   path: ``shm`` when the source is
   this daemon (a loopback connection of the daemon's ``shm`` transport) or a daemon
   the ``shm`` transport connects to (same kernel boot id, and every segment it
   names maps to the very file its signed record states, at the exact size it
   states); the transport (``ucx``) otherwise. ``--transport shm`` or ``ucx``
   forces one path;
5. the lease is checked again: if it expired while bytes moved, the pull FAILS and
   every destination range it wrote is reported suspect, so the receiver installs
   nothing from it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import msgspec
import numpy as np
from aiohttp import web

from refitd.daemon.access.auth import Principal
from refitd.daemon.access.caps import Charges
from refitd.daemon.access.trust import check_writes
from refitd.daemon.app.node import Daemon
from refitd.daemon.pull import core as pullcore
from refitd.daemon.pull.connections import PullPaths
from refitd.daemon.pull.job import PullJob
from refitd.daemon.pull.listeners import Caller, PullListener, anyone
from refitd.daemon.pull.machine import Cancel, Fail, Finish, Gone, Move, Pull, Start
from refitd.daemon.pull.move import IN_FLIGHT, move
from refitd.daemon.pull.plancheck import check_runs
from refitd.daemon.pull.sources import Filling, LocalSource, Redirect, RemoteSource, Source
from refitd.errors import NotFoundError, RefitError
from refitd.wire import (
    DescriptorTable,
    PeerRegions,
    PullProgress,
    PullRequest,
    StagedPack,
)
from transports.batch import ReadBatch
from transports.interface import Peer

__all__ = [
    "IN_FLIGHT",
    "PULLS",
    "Filling",
    "LocalSource",
    "PullJob",
    "PullManager",
    "Redirector",
    "RemoteSource",
    "Source",
]


PLAN_RUN_BYTES = 256
"""Daemon memory a running pull's plan is charged per run (its rows, their checks and
their batches: measured up to about 240 bytes a descriptor at their peak)."""

OFF_LOOP_ROWS = 16_384
"""A plan of more descriptors and pack specs than this is checked off the event loop."""

SHUTTING_DOWN = "daemon shutting down"
"""The reason a pull still running when the daemon stops is cancelled with."""


class Redirector(Protocol):
    """Host mirrors as a pull manager asks them (:class:`refitd.daemon.mirror.mirrors.Mirrors`):
    a pull of ``owner`` rewritten to read a mirror here, filled through ``pulls``; or None."""

    async def redirect(
        self, req: PullRequest, owner: str, pulls: PullManager
    ) -> Redirect | None: ...


class PullManager:
    """Every pull of one daemon. Tasks are tracked and cancelled on :meth:`close`.

    It holds the daemon's parts a pull needs, not the daemon: the region store
    (destination sizes, pins), the registry and staging pool (the write rule), the
    data planes and the peer policy; ``connect`` makes the source for a peer URL.
    Its path choice and connections are a part of it, ``paths``, built with the
    owners they use (:class:`~refitd.daemon.pull.connections.PullPaths`).
    ``listeners`` are told of every pull (:mod:`refitd.daemon.pull.listeners`); ``mirrors``
    may serve a pull of a remote source from a host mirror here (:class:`Redirector`)."""

    def __init__(
        self,
        daemon: Daemon,
        connect: Callable[[str], Source],
        listeners: Iterable[PullListener] = (),
        mirrors: Redirector | None = None,
    ) -> None:
        leases = daemon.leases
        self._local = LocalSource(
            daemon.plane, daemon.registry, daemon.staging, leases.leased_regions, leases.pack_leased
        )
        self.store = daemon.store
        self.registry = daemon.registry
        self.staging = daemon.staging
        self.plane = daemon.plane
        self.peers = daemon.peers
        #: the path each pull takes and the connections it reads through
        self.paths = PullPaths(daemon.plane, daemon.mode, daemon.store, daemon.seen_paths)
        self.max_plan_runs = daemon.config.limits.max_plan_runs
        #: per principal, the bytes its running pulls' plans are charged
        self.plans = Charges(
            "running pulls",
            "max_plan_bytes_per_principal",
            daemon.config.limits.max_plan_bytes_per_principal,
        )
        #: ended pulls each principal's results stay queryable for (oldest go first)
        self.keep_ended = daemon.config.limits.max_ended_pulls_per_principal
        #: per principal, its ended pulls still kept, oldest first
        self._ended: dict[str, collections.deque[str]] = {}
        self._connect = connect
        self.listeners: list[PullListener] = list(listeners)
        self.jobs: dict[str, PullJob] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count(1)
        #: the host mirrors (:mod:`refitd.daemon.mirror.mirrors`), given at construction
        self.mirrors = mirrors

    # Reads outside a pull (a host mirror's, a relay's feed) open through ``paths``.
    async def open_path(self, src: Source, peer: PeerRegions) -> tuple[str, Peer]:
        """:meth:`PullPaths.open_path`."""
        return await self.paths.open_path(src, peer)

    def owns(self, path: str) -> bool:
        """:meth:`PullPaths.owns`."""
        return self.paths.owns(path)

    async def regrant(self, peer: PeerRegions, path: str, conn: Peer) -> Peer:
        """:meth:`PullPaths.regrant`."""
        return await self.paths.regrant(peer, path, conn)

    def listen(self, listener: PullListener) -> None:
        """Tell ``listener`` of every pull submitted from now on (after the others)."""
        self.listeners.append(listener)

    def running(self, pull_id: str) -> bool:
        """Whether the pull ``pull_id`` is known here and has not ended."""
        job = self.jobs.get(pull_id)
        return job is not None and not job.finished.is_set()

    def source_for(self, url: str) -> Source:
        """This daemon for ``""``; else the peer at ``url`` if this daemon trusts it
        (:class:`ProtocolError`, 400, before any connection opens, if not)."""
        return self._local if not url else self._connect(self.peers.check(url))

    async def submit(self, req: PullRequest, caller: Caller = anyone) -> PullJob:
        """Check lease and every descriptor, then start moving bytes in a task, as a
        pull of ``caller``.

        Raises (nothing moved) whatever a listener refuses with first, then
        :class:`ConflictError` for a stale/unleased version, :class:`ProtocolError`
        naming the first out-of-bounds descriptor or pack spec.
        """
        # What the plan expands into is bounded before anything reads or maps it, and
        # charged to its principal until the pull ends.
        runs = check_runs(len(req.descriptors), req.pack_specs, self.max_plan_runs, "pull")
        cost = PLAN_RUN_BYTES * runs
        self.plans.take(caller.name, cost, f"pull of {runs} runs")
        try:
            return await self._admitted(req, caller, cost)
        except BaseException:
            self.plans.give_back(caller.name, cost)
            raise

    async def _admitted(self, req: PullRequest, caller: Caller, cost: int) -> PullJob:
        """:meth:`submit` once its plan is charged (``cost`` bytes)."""
        for listener in self.listeners:
            listener.admit(req, caller)
        # A host mirror may serve the pull instead of its remote source: admitted as
        # asked (the destinations are the same), then read from the mirror over shm.
        mirrored = await self.mirrors.redirect(req, caller.name, self) if self.mirrors else None
        if mirrored is None:
            return await self._submit(req, caller, None, cost)
        try:
            job = await self._submit(mirrored.req, caller, mirrored.source, cost)
        except BaseException:
            mirrored.release()
            raise
        assert job.task is not None
        job.task.add_done_callback(lambda _: mirrored.release())
        return job

    async def _submit(
        self, req: PullRequest, caller: Caller, src: Source | None = None, cost: int = 0
    ) -> PullJob:
        """:meth:`submit` once admitted: ``req`` is read from ``src`` (default: its own
        source); the job gives back ``cost`` bytes of its principal's plan charge
        when it ends."""
        src = src or self.source_for(req.source)
        # The records the source granted the lease, presented with the pull: neither
        # they nor the lease are asked for again before the path is known.
        granted = src.granted(req)
        if granted is None:
            await src.check_lease(req.lease_id, req.model, req.version)
        rows = req.descriptors.rows()
        src_ids = pullcore.source_ids(rows, req.pack_specs)
        if granted is not None:
            peer: PeerRegions | None = granted
        else:
            peer = await src.regions(src_ids, req) if src_ids else None
        sizes = self.store.regions.sizes()
        if len(rows) + len(req.pack_specs) > OFF_LOOP_ROWS:
            # Vectorised, but a plan at limits.max_plan_runs still takes the loop for
            # over 100 ms: checked in a worker thread (numpy lets go of the GIL).
            await asyncio.to_thread(pullcore.check_plan, rows, req, peer, sizes)
        else:
            pullcore.check_plan(rows, req, peer, sizes)
        path, conn = await self.paths.choose_path(src, peer)
        if granted is not None and not self.paths.lease_checked_by(path):
            # Only a data server that checks the lease before every read refuses a
            # grant of a lease released or expired since; on any other path the lease
            # is checked here, before any byte moves.
            try:
                await src.check_lease(req.lease_id, req.model, req.version)
            except BaseException:
                if conn is not None:
                    await conn.close()
                raise
        gpu = pullcore.peer_devices(peer) if peer is not None else []
        # The source copies its GPU rows into host staging, read from there: a pack
        # spec made in Python a row (1.5 us each), and the specs summed and listed
        # likewise, so a large plan's are made in a worker thread (a 131,072-row
        # pull of GPU memory took the loop for 0.2 s).
        placed = functools.partial(pullcore.placed, rows, req, gpu)
        rows, req, total, dst_ids = (
            await asyncio.to_thread(placed) if len(rows) > OFF_LOOP_ROWS else placed()
        )
        job = PullJob(f"p{next(self._seq)}", req, total, rows.shape[0] + len(req.pack_specs))
        # The write rule again, after the awaits above: a version published meanwhile
        # from a destination must not be written (from here on, none can be).
        try:
            check_writes(dst_ids, self.registry.protected_regions(), self.staging.ids)
        except RefitError:
            if conn is not None:
                await conn.close()
            raise
        job.path, job.conn, job.owner, job.plan_bytes = path, conn, caller.name, cost
        job.caps = self.plane.caps(path)
        local = src.own(src_ids)
        job.devices = "+".join(self.store.device_kinds(dst_ids | local))
        job.pins.enter_context(self.store.using(dst_ids | local))
        job.pins.enter_context(self.store.writing(dst_ids, job.pull_id))
        self.jobs[job.pull_id] = job
        task = asyncio.create_task(self._run(job, src, rows, peer))
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        for listener in self.listeners:
            listener.started(job)
        return job

    def _keep_ended(self, job: PullJob) -> None:
        """``job`` ended: keep its result, not its plan (the request's descriptor table
        and pack specs go; its suspect ranges are kept to at most
        :data:`~refitd.daemon.pull.core.SUSPECT_KEPT`, widened), among the last
        ``limits.max_ended_pulls_per_principal`` of its owner's: one principal's pulls
        never push out another's results."""
        job.req = msgspec.structs.replace(
            job.req, descriptors=DescriptorTable(b""), pack_specs=[], grant=None
        )
        self.plans.give_back(job.owner, job.plan_bytes)
        job.plan_bytes = 0
        job.suspect = pullcore.widened(job.suspect, pullcore.SUSPECT_KEPT)
        kept = self._ended.setdefault(job.owner, collections.deque())
        kept.append(job.pull_id)
        while len(kept) > self.keep_ended:
            self.jobs.pop(kept.popleft(), None)

    def seen_by(self, who: Principal) -> list[PullProgress]:
        """The pulls ``who`` sees (:meth:`Principal.sees`): its own, every pull for root
        or without authentication."""
        return [j.snapshot() for j in self.jobs.values() if who.sees(j.owner)]

    def get(self, pull_id: str, caller: Caller = anyone, action: str = "read") -> PullJob:
        """Pull ``pull_id`` (404 when unknown), if ``caller`` may ``action`` it (403)."""
        job = self.jobs.get(pull_id)
        if job is None:
            raise NotFoundError(f"pull {pull_id!r} is unknown on this daemon")
        caller.check_owner(job.owner, action, f"pull {pull_id}")
        return job

    async def cancel(
        self, pull_id: str, reason: str = "cancelled by request", caller: Caller = anyone
    ) -> PullJob:
        """Cancel a running pull of ``caller`` (403 for another's); its result names
        ``reason``. Returns once it ended."""
        job = self.get(pull_id, caller, "cancel")
        if job.task is not None and not job.task.done():
            job.cancel_reason = reason
            job.task.cancel(reason)
            with contextlib.suppress(asyncio.CancelledError):
                await job.finished.wait()
        return job

    def fail_source(self, url: str, reason: str) -> list[str]:
        """Fail every running pull that reads from the daemon at ``url`` (it left
        the cluster registry): each ends FAILED with ``reason``, its written ranges
        reported suspect. Returns the ids of the pulls failed."""
        url = url.rstrip("/")
        failed = []
        for job in self.jobs.values():
            if job.req.source.rstrip("/") != url or job.task is None or job.task.done():
                continue
            job.fail_reason = reason
            job.task.cancel(reason)
            failed.append(job.pull_id)
        return failed

    async def cancel_all(self, reason: str = SHUTTING_DOWN) -> None:
        """Cancel every running pull with ``reason`` and wait until each has ended."""
        running = [j for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for job in running:
            job.cancel_reason = reason
            assert job.task is not None
            job.task.cancel(reason)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every running pull (the daemon is stopping) and wait for them."""
        await self.cancel_all(SHUTTING_DOWN)

    async def _run(
        self, job: PullJob, src: Source, rows: np.ndarray, peer: PeerRegions | None
    ) -> None:
        req = job.req
        pull = job.step(Pull(job.pull_id), Start())
        staged: StagedPack | None = None
        all_rows, done = rows, None
        filling = src.filling
        try:
            # A reader that maps the source's memory (shm) gathers strided blocks
            # itself, straight into their destinations (one copy, not pack then read).
            # Expanding them is numpy work on up to 2M rows: off the event loop.
            direct = (
                await asyncio.to_thread(pullcore.direct_reads, req.pack_specs)
                if req.pack_specs and job.caps.reads_strided
                else None
            )
            if direct is not None:
                all_rows = np.concatenate([rows, direct[0]])
                done = np.concatenate([np.ones(len(rows), dtype=np.int64), direct[1]])
            elif req.pack_specs:
                if filling is not None:  # the source packs only complete bytes
                    await filling.complete()
                    # Every byte is there now, and the staged rows read the staging
                    # region, which is no chunk of the mirror: nothing is gated.
                    filling = None
                staged = await src.pack(req.model, req.version, req.lease_id, req.pack_specs)
                rows_of = functools.partial(pullcore.staged_rows, staged, req.pack_specs)
                many = len(req.pack_specs) > OFF_LOOP_ROWS  # a Python step a spec
                extra = await asyncio.to_thread(rows_of) if many else rows_of()
                sp = await src.regions([staged.region.region_id], req)
                pullcore.check_staged(extra, sp, req, self.store.regions.sizes())
                peer = sp if peer is None else pullcore.merge_peer(peer, sp)
                all_rows = np.concatenate([rows, extra])
                here = src.own([staged.region.region_id])
                if here:
                    job.pins.enter_context(self.store.using(here))
                elif job.conn is not None:  # the staging segment joins the connection
                    await job.conn.update(self.paths.shm_credential(peer))
            pull = job.step(pull, Move())  # from now on its ranges may be suspect
            if all_rows.shape[0] and peer is not None:
                conn = job.conn or await self.paths.transport_peer(peer, job.path)
                if job.devices and job.conn is None:
                    conn = job.device_staging = await self.paths.staged(conn, all_rows)
                await self._move(job, conn, all_rows, done, filling)
            await src.check_lease(req.lease_id, req.model, req.version)
            pull = job.step(pull, Finish(), all_rows)
        except asyncio.CancelledError as exc:
            where = pullcore.source_name(req.source, peer)
            if job.fail_reason:  # its source left: FAILED, not CANCELLED
                pull = job.step(pull, Gone(job.fail_reason, where), all_rows)
                return
            # The reason travels on the job (set by whoever cancelled) and, where the
            # cancel reached us directly, in the CancelledError's message.
            reason = job.cancel_reason or (str(exc.args[0]) if exc.args else "") or "cancelled"
            pull = job.step(pull, Cancel(reason), all_rows)
        except Exception as exc:
            # Any error fails the pull: one that escaped here unhandled would end the
            # task with the job still RUNNING and every waiter polling it forever.
            where = pullcore.source_name(req.source, peer)
            pull = job.step(pull, Fail(exc, where), all_rows)
        finally:
            job.ended = time.perf_counter()
            if job.conn is not None:
                await job.conn.close()  # lets go of its mappings: none is read any more
            if job.device_staging is not None:
                await job.device_staging.close()
                with contextlib.suppress(RefitError):
                    await self.paths.staging_regions.give(job.device_staging.staging)
            job.pins.close()
            self.store.reap_soon()  # an exited client's region this pull held may go now
            if staged is not None:
                with contextlib.suppress(RefitError):
                    await asyncio.shield(src.drop(staged.region.region_id, req.lease_id))
            for listener in self.listeners:
                listener.ended(job)
            self._keep_ended(job)
            job.finished.set()

    # ------------------------------------------------------------ moving bytes

    async def _move(
        self,
        job: PullJob,
        conn: Peer,
        rows: np.ndarray,
        done: np.ndarray | None = None,
        filling: Filling | None = None,
    ) -> None:
        """Read wire ``rows`` (validated) through ``conn`` with the daemon's byte loop:
        long reads cut into pieces and sent in batches (the path's
        :class:`~refitd.daemon.pull.core.Pace`); from a source still ``filling``, in
        the order it fills, each batch once its bytes are complete."""
        pace = pullcore.pace_for(job.caps)
        if filling is not None:
            reads, ends, spans, ready = filling.gated(rows, done, pace.reads)
            await move(job, conn, reads, ends, spans, ready=ready)
            return

        def plan() -> tuple[ReadBatch, np.ndarray, list[tuple[int, int]]]:
            reads, ends = pullcore.cut(rows, pace, done)
            return reads, ends, pullcore.spans(reads["nbytes"], pace.reads, pace.max_bytes)

        # Cutting a large plan into batches is numpy work of over 100 ms: off the loop.
        reads, ends, spans = await asyncio.to_thread(plan) if len(rows) > OFF_LOOP_ROWS else plan()
        await move(job, conn, reads, ends, spans)

    # ------------------------------------------------------------ its state

    # ------------------------------------------------------------ reads outside a pull

    @contextlib.contextmanager
    def tracked(
        self, req: PullRequest, owner: str, path: str, nbytes: int, source: str = ""
    ) -> Iterator[PullJob]:
        """A job for bytes the daemon reads on its own behalf (a host mirror filling
        from ``source``): listed in ``/v1/pulls`` to its ``owner`` (and to root), told
        to every listener (so ``/metrics`` counts them) and ended with the block: DONE,
        or FAILED / CANCELLED naming what ended it. ``req`` is what it reads."""
        rows = req.descriptors.rows()
        job = PullJob(f"p{next(self._seq)}", req, nbytes, rows.shape[0])
        job.path, job.owner = path, owner
        pull = job.step(Pull(job.pull_id), Start())
        self.jobs[job.pull_id] = job
        for listener in self.listeners:
            listener.started(job)
        try:
            yield job
            job.step(pull, Finish())
        except asyncio.CancelledError as exc:
            job.step(pull, Cancel(str(exc.args[0]) if exc.args else "cancelled"))
            raise
        except Exception as exc:
            job.step(pull, Fail(exc, source or "its source"))
            raise
        finally:
            job.ended = time.perf_counter()
            for listener in self.listeners:
                listener.ended(job)
            self._keep_ended(job)
            job.finished.set()


PULLS: web.AppKey[PullManager] = web.AppKey("pulls", PullManager)
"""The app's :class:`PullManager`."""
