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
4. the bytes move along the path chosen at submit (see :meth:`PullManager.choose_path`),
   through one :class:`~transports.interface.Peer` and one loop (:meth:`PullManager._move`:
   pieces, chunks, progress, errors) whatever the path: ``shm`` when the source is
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
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from refitd.daemon.node import AUTO, SHM_SCHEME, Daemon
from refitd.daemon.paths import TCP_SCHEME, adverts, choose_remote, tcp_grant
from refitd.daemon.regions import validate_descriptors, validate_plan
from refitd.daemon.trust import check_pack_reads, check_reads, check_writes
from refitd.errors import NotFoundError, ProtocolError, RefitError, TransportError
from refitd.wire import (
    DescriptorTable,
    ErrorBody,
    PackSpec,
    PeerRegions,
    PullProgress,
    PullRequest,
    PullState,
    StagedPack,
)
from transports.batch import rows_as_batch, split_pieces, suspect_ranges
from transports.interface import AdvertisedRegion, Peer, PeerInfo
from transports.shm import segment_key
from transports.tcp import TcpPeer

if TYPE_CHECKING:
    from refitd.client.http import RefitClient
    from refitd.daemon.mirrors import Redirect

__all__ = ["PullJob", "PullManager", "Source"]

KEEP_FINISHED = 1024
"""Ended pulls whose results stay queryable (the oldest are forgotten first)."""

IN_FLIGHT = 2
"""Batches of one pull a peer has in flight at once: while one is being moved, the
next is validated and posted, so the data plane never waits on this loop."""


@dataclass(frozen=True)
class Pace:
    """How a path's reads are cut and batched (bytes): a read longer than ``piece``
    is cut into ``piece``-sized reads (so several can be in flight); a batch handed
    to the peer holds at most ``reads`` reads and about ``max_bytes`` bytes (a larger
    single read is a batch of its own). Progress is reported, and a cancel lands,
    between batches."""

    piece: int
    reads: int
    max_bytes: int


TRANSPORT_PACE = Pace(piece=32 << 20, reads=2048, max_bytes=256 << 20)
"""The transport's (UCX): 32 MiB reads, so one large region keeps both batches busy."""

PACE = {
    SHM_SCHEME: Pace(piece=1 << 62, reads=8192, max_bytes=256 << 20),
    TCP_SCHEME: Pace(piece=32 << 20, reads=16384, max_bytes=256 << 20),
}
"""Per path, where it differs from ``TRANSPORT_PACE``. A same-host batch is one
parallel memcpy that cuts its bytes into per-thread shares itself, so reads are not
cut (on the test host a 1 GiB read cut into 32 MiB pieces moved at about 70% of the
speed of the whole read) and batches are large: each costs a validation and two
thread hand-offs, which on a busy host wait for a core. Over ``tcp`` a batch may
hold many small reads: the transport gathers them into requests over its lanes."""

SHUTTING_DOWN = "daemon shutting down"
"""The reason a pull still running when the daemon stops is cancelled with."""

log = logging.getLogger("refitd.pulls")


class Source(Protocol):
    """The daemon a pull reads from, seen from the daemon that pulls."""

    async def check_lease(self, lease_id: str, model: str, version: int) -> None: ...
    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        """Signed records of ``ids``, scoped to what ``req``'s lease may read."""
        ...

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack: ...
    async def drop(self, region_id: int, lease_id: str) -> None: ...


class LocalSource:
    """This daemon as the source of its own pulls."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        self.d.registry.check(lease_id, model, version)

    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        lease = self.d.registry.check(req.lease_id, req.model, req.version)
        return self.d.peer_regions(ids, lease)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        return await self.d.pack(specs, self.d.registry.check(lease_id, model, version))

    async def drop(self, region_id: int, lease_id: str) -> None:
        await self.d.release_staging(region_id, lease_id)


class RemoteSource:
    """A peer daemon reached through :class:`refitd.client.RefitClient`."""

    def __init__(self, client: RefitClient, secret: bytes) -> None:
        self.c = client
        self.secret = secret

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        await self.c.check_lease(lease_id, model, version)

    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        rec = await self.c.peer_regions(ids, req.lease_id, req.model, req.version)
        rec.verify(self.secret)
        return rec

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        return await self.c.peer_pack(model, version, lease_id, specs)

    async def drop(self, region_id: int, lease_id: str) -> None:
        await self.c.peer_drop(region_id, lease_id)


@dataclass
class PullJob:
    pull_id: str
    req: PullRequest
    bytes_total: int
    descriptors_total: int
    state: PullState = PullState.PENDING
    bytes_done: int = 0
    descriptors_done: int = 0
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    error: ErrorBody | None = None
    suspect: list[tuple[int, int, int]] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    path: str = ""  # "shm" or the transport's scheme: decided at submit
    #: the same-host connection chosen at submit (None: the transport's, made later)
    conn: Peer | None = None
    cancel_reason: str = ""
    fail_reason: str = ""  # set when the source left the registry: FAILED, not CANCELLED
    #: regions of this daemon the pull reads or writes, kept from deletion until it ends
    pins: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    #: the principal that submitted it: only they see, wait for and cancel it
    owner: str = ""

    def progress(self, n_desc: int, n_bytes: int) -> None:
        self.descriptors_done += n_desc
        self.bytes_done += n_bytes

    def snapshot(self) -> PullProgress:
        end = self.ended if self.ended is not None else time.perf_counter()
        secs = end - self.started
        rate = self.bytes_done / secs / 1e9 if secs > 0 else 0.0
        return PullProgress(
            self.pull_id,
            self.state,
            self.bytes_total,
            self.bytes_done,
            self.descriptors_total,
            self.descriptors_done,
            secs,
            rate,
            self.error,
            self.suspect,
            self.path,
        )


def dst_ids_of(rows: np.ndarray, req: PullRequest) -> set[int]:
    """The destination regions of a pull's descriptor ``rows`` and pack specs."""
    return {int(x) for x in np.unique(rows[:, 2])} | {p.dst_region for p in req.pack_specs}


def _coalesced_dst(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Destination ``(region, offset, nbytes)`` ranges of wire ``rows``, sorted and
    merged: the data plane's :func:`~transports.batch.suspect_ranges` of those reads."""
    return [(r.region, r.offset, r.nbytes) for r in suspect_ranges(rows_as_batch(rows))]


class PullManager:
    """Every pull of one daemon. Tasks are tracked and cancelled on :meth:`close`."""

    def __init__(self, daemon: Daemon, connect: Callable[[str], Source]) -> None:
        self.d = daemon
        self._connect = connect
        self.jobs: dict[str, PullJob] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count(1)
        #: the transport's connection per source daemon life (node id, epoch)
        self._peers: dict[tuple[str, int, str], Peer] = {}
        #: host mirrors' hook (:mod:`refitd.daemon.mirrors`): a pull from a remote
        #: source rewritten to read this daemon's mirror of the version, or None
        self.redirect: Callable[[PullRequest, str], Awaitable[Redirect | None]] | None = None

    def source_for(self, url: str) -> Source:
        """This daemon for ``""``; else the peer at ``url`` if this daemon trusts it
        (:class:`ProtocolError`, 400, before any connection opens, if not)."""
        return LocalSource(self.d) if not url else self._connect(self.d.peers.check(url))

    async def submit(self, req: PullRequest, owner: str = "") -> PullJob:
        """Check lease and every descriptor, then start moving bytes in a task, as a
        pull of principal ``owner``.

        Raises (nothing moved) :class:`ConflictError` for a stale/unleased version,
        :class:`ProtocolError` naming the first out-of-bounds descriptor or pack spec.
        """
        mirrored = await self.redirect(req, owner) if self.redirect is not None else None
        if mirrored is None:
            return await self._submit(req, owner)
        try:
            job = await self._submit(mirrored.req, owner)
        except BaseException:
            mirrored.release()
            raise
        assert job.task is not None
        job.task.add_done_callback(lambda _: mirrored.release())
        return job

    async def _submit(self, req: PullRequest, owner: str) -> PullJob:
        src = self.source_for(req.source)
        await src.check_lease(req.lease_id, req.model, req.version)
        rows = req.descriptors.rows()
        src_ids = sorted(
            {int(x) for x in np.unique(rows[:, 0])} | {p.src_region for p in req.pack_specs}
        )
        peer = await src.regions(src_ids, req) if src_ids else None
        src_sizes = {r.region_id: r.nbytes for r in peer.regions} if peer else {}
        dst_sizes = self.d.regions.sizes()
        validate_plan(rows, req.pack_specs, src_sizes, dst_sizes)
        if peer is not None:
            what = _scope_check(peer, req)
            check_reads(rows, peer.scope, what)
            check_pack_reads(req.pack_specs, peer.scope, what)
        path, conn = await self.choose_path(src, peer)
        total = int(rows[:, 4].sum()) + sum(p.nbytes for p in req.pack_specs)
        job = PullJob(f"p{next(self._seq)}", req, total, rows.shape[0] + len(req.pack_specs))
        # The write rule again, after the awaits above: a version published meanwhile
        # from a destination must not be written (from here on, none can be).
        dst_ids = dst_ids_of(rows, req)
        try:
            check_writes(dst_ids, self.d.registry.protected_regions(), self.d.staging_ids)
        except RefitError:
            if conn is not None:
                await conn.close()
            raise
        job.path, job.conn, job.owner = path, conn, owner
        job.pins.enter_context(
            self.d.using(dst_ids | (set(src_ids) if isinstance(src, LocalSource) else set()))
        )
        job.pins.enter_context(self.d.writing(dst_ids, job.pull_id))
        self.jobs[job.pull_id] = job
        self._forget_old()
        task = asyncio.create_task(self._run(job, src, rows, peer))
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _forget_old(self) -> None:
        """Keep the records of at most ``KEEP_FINISHED`` ended pulls (oldest go first)."""
        ended = [k for k, j in self.jobs.items() if j.finished.is_set()]
        for k in ended[: max(0, len(ended) - KEEP_FINISHED)]:
            del self.jobs[k]

    def get(self, pull_id: str) -> PullJob:
        job = self.jobs.get(pull_id)
        if job is None:
            raise NotFoundError(f"pull {pull_id!r} is unknown on this daemon")
        return job

    async def cancel(self, pull_id: str, reason: str = "cancelled by request") -> PullJob:
        """Cancel a running pull; its result names ``reason``. Returns once it ended."""
        job = self.get(pull_id)
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
        job.state = PullState.RUNNING
        staged: StagedPack | None = None
        all_rows = rows
        # Once bytes may have moved, every destination range of the pull is suspect:
        # a data plane that failed mid-batch cannot say which reads landed.
        moving = False
        try:
            if req.pack_specs:
                staged = await src.pack(req.model, req.version, req.lease_id, req.pack_specs)
                extra = np.array(
                    [
                        (staged.region.region_id, o, p.dst_region, p.dst_offset, p.nbytes)
                        for p, o in zip(req.pack_specs, staged.offsets, strict=True)
                    ],
                    dtype=np.int64,
                ).reshape(-1, 5)
                # The staging record must come authenticated like any other region,
                # scoped to this lease, and the offsets the source sent are checked
                # like any descriptor: in bounds of that record, inside its scope.
                sp = await src.regions([staged.region.region_id], req)
                what = _scope_check(sp, req)
                validate_descriptors(
                    DescriptorTable.pack(extra),
                    {r.region_id: r.nbytes for r in sp.regions},
                    self.d.regions.sizes(),
                )
                check_reads(extra, sp.scope, what)
                peer = sp if peer is None else _merge_peer(peer, sp)
                all_rows = np.concatenate([rows, extra])
                if isinstance(src, LocalSource):
                    job.pins.enter_context(self.d.using([staged.region.region_id]))
                elif job.conn is not None:  # the staging segment joins the connection
                    await job.conn.update(self._shm_record(peer))
            moving = True
            if all_rows.shape[0] and peer is not None:
                conn = job.conn or await self._transport_peer(peer, job.path)
                await self._move(job, conn, all_rows)
            await src.check_lease(req.lease_id, req.model, req.version)
            job.state = PullState.DONE
        except asyncio.CancelledError as exc:
            if job.fail_reason:
                job.state = PullState.FAILED
                job.error = ErrorBody(
                    "TransportError",
                    f"pull {job.pull_id} from {_source_name(req.source, peer)} failed: "
                    f"{job.fail_reason}",
                )
                job.suspect = _coalesced_dst(all_rows) if moving else []
                return
            # The reason travels on the job (set by whoever cancelled) and, where the
            # cancel reached us directly, in the CancelledError's message.
            reason = job.cancel_reason or (str(exc.args[0]) if exc.args else "") or "cancelled"
            job.state = PullState.CANCELLED
            job.error = ErrorBody(
                "ConflictError", f"pull {job.pull_id} cancelled before it completed: {reason}"
            )
            job.suspect = _coalesced_dst(all_rows) if moving else []
        except Exception as exc:
            # Any error fails the pull: one that escaped here unhandled would end the
            # task with the job still RUNNING and every waiter polling it forever.
            job.state = PullState.FAILED
            job.error = ErrorBody(
                type(exc).__name__ if isinstance(exc, RefitError) else "TransportError",
                f"pull {job.pull_id} from {_source_name(req.source, peer)} failed: {exc}",
            )
            job.suspect = _coalesced_dst(all_rows) if moving else []
            if not isinstance(exc, RefitError):
                log.error("pull %s failed unexpectedly", job.pull_id, exc_info=exc)
        finally:
            job.ended = time.perf_counter()
            if job.conn is not None:
                await job.conn.close()  # lets go of its mappings: none is read any more
            job.pins.close()
            self.d.reap_soon()  # an exited client's region this pull held may go now
            if staged is not None:
                with contextlib.suppress(RefitError):
                    await asyncio.shield(src.drop(staged.region.region_id, req.lease_id))
            job.finished.set()

    # ------------------------------------------------------------ path choice

    async def choose_path(self, src: Source, peer: PeerRegions | None) -> tuple[str, Peer | None]:
        """The path a pull from ``src`` takes, decided before any byte moves, and for
        ``shm`` the connection it reads through.

        ``shm`` for this daemon (a loopback connection of its ``shm`` transport, in
        any mode); in mode ``auto`` or ``shm``, ``shm`` when the ``shm`` transport
        connects to the peer (:meth:`shm_refusal` says why not otherwise); else (mode
        ``auto`` or a scheme) the transport's scheme, when the peer advertises that
        transport (connected when bytes first move).
        Raises :class:`TransportError` (nothing moved) when no path fits.
        """
        if isinstance(src, LocalSource):
            return SHM_SCHEME, self.d.shm.loopback()
        if peer is None:
            return "none", None  # nothing to read
        mode = self.d.options.transport
        why_not_shm = f"this daemon is forced to its transport (--transport {mode})"
        if mode in (AUTO, SHM_SCHEME):
            try:
                conn = await self.d.shm.connect(self._shm_record(peer))
                self.d.seen_paths[peer.node_id] = (SHM_SCHEME, "proven on this host")
                return SHM_SCHEME, conn
            except (RefitError, OSError) as exc:
                refusal = str(exc)
            if mode == SHM_SCHEME:
                raise TransportError(
                    f"pull from {peer.node_id!r} refused before any byte moved: this daemon "
                    "runs the shared-memory path only (--transport shm), and that path is "
                    f"refused: {refusal}"
                )
            why_not_shm = refusal
        scheme, why = choose_remote(self.d, peer, why_not_shm)
        self.d.seen_paths[peer.node_id] = (scheme, why)
        log.info("pull from %s over %s: %s", peer.node_id, scheme, why)
        return scheme, None

    async def shm_refusal(self, peer: PeerRegions) -> str | None:
        """Why the ``shm`` transport does not connect to ``peer``, or None when it does:
        the peer's boot id equals ours and every region it listed maps (by name) to
        the very file its signed record names, at exactly the size it states."""
        try:
            conn = await self.d.shm.connect(self._shm_record(peer))
        except (RefitError, OSError) as exc:
            return str(exc)
        await conn.close()
        return None

    def _shm_record(self, peer: PeerRegions) -> PeerInfo:
        """``peer``'s verified, lease-scoped region records as the ``shm`` transport's
        signed record: address ``<boot id>:<epoch>``, and per region its segment's
        name and file identity (:func:`~transports.shm.segment_key`).

        Built here from the record this daemon already verified rather than
        advertised by the peer: it lists only the regions this pull's lease may read,
        and needs nothing more on the wire than the peer's ``PeerRegions``."""
        regions = []
        for r in peer.regions:
            file = peer.files.get(r.region_id)
            if file is None:
                raise TransportError(
                    f"region {r.region_id} of {peer.node_id!r} does not map here: the record "
                    f"names no file for segment {r.handle!r}"
                )
            key = segment_key(r.handle, *file)
            regions.append(AdvertisedRegion(r.region_id, peer.epoch, 0, r.nbytes, key))
        return PeerInfo(
            scheme=SHM_SCHEME,
            peer_id=peer.node_id,
            address=f"{peer.boot_id}:{peer.epoch}".encode(),
            regions=tuple(regions),
        ).signed(self.d.options.secret)

    async def _transport_peer(self, peer: PeerRegions, scheme: str) -> Peer:
        """The ``scheme`` transport's connection to ``peer``: made once per source
        daemon life and brought up to date with its latest advertisement. Over
        ``tcp``, the pull reads under a grant of its own, scoped to its lease
        (:func:`~refitd.daemon.paths.tcp_grant`), on the shared lanes."""
        transport = self.d.transports[scheme]  # choose_path picked a transport it runs
        info = adverts(peer)[scheme]
        if scheme == TCP_SCHEME:
            info = tcp_grant(peer, info, self.d.options.secret)
        key = (peer.node_id, peer.epoch, scheme)
        for old in [k for k in self._peers if k[0] == peer.node_id and k[1] != peer.epoch]:
            await self._peers.pop(old).close()  # an earlier life of that daemon
        conn = self._peers.get(key)
        if conn is None:
            conn = await transport.connect(info)
            self._peers[key] = conn
        elif scheme != TCP_SCHEME:
            await conn.update(info)
        if isinstance(conn, TcpPeer):
            return conn.with_grant(info)
        return conn

    # ------------------------------------------------------------ moving bytes

    async def _move(self, job: PullJob, conn: Peer, rows: np.ndarray) -> None:
        """Read wire ``rows`` (validated) through ``conn``, whatever its path: long
        reads cut into pieces and sent in batches (the path's :class:`Pace`),
        ``IN_FLIGHT`` of them in flight, progress counted per batch that landed, the
        first transport error raised as itself (the other batches cancelled first)."""
        # Transport reads are (local=dst, local_off, remote=src, remote_off, nbytes).
        pace = PACE.get(job.path, TRANSPORT_PACE)
        batch = rows_as_batch(rows)
        reads = split_pieces(batch, pace.piece)
        # A descriptor is done once its last piece is: mark where each one ends.
        pieces = np.maximum(1, -(-batch["nbytes"] // pace.piece))
        ends = np.zeros(len(reads), dtype=np.int64)
        ends[np.cumsum(pieces) - 1] = 1
        window = asyncio.Semaphore(IN_FLIGHT)

        async def move(lo: int, hi: int) -> None:
            try:
                part = reads[lo:hi]
                await conn.get(part)
                job.progress(int(ends[lo:hi].sum()), int(part["nbytes"].sum()))
            finally:
                window.release()

        try:
            async with asyncio.TaskGroup() as tg:
                for lo, hi in _spans(reads["nbytes"], pace.reads, pace.max_bytes):
                    await window.acquire()
                    tg.create_task(move(lo, hi))
        except BaseExceptionGroup as group:
            # A TaskGroup wraps even one failure (PeerLost when the source died
            # mid-read) in an ExceptionGroup; raise the transport's own error so
            # the pull fails with its message rather than escaping `_run`.
            first = next((e for e in group.exceptions if isinstance(e, RefitError)), None)
            if first is None:
                raise
            raise first from None


def _spans(sizes: np.ndarray, max_reads: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans of reads with at most ``max_reads`` reads and about
    ``max_bytes`` bytes each (a larger single read is its own span)."""
    spans: list[tuple[int, int]] = []
    lo, n = 0, len(sizes)
    while lo < n:
        csum = np.cumsum(sizes[lo : lo + max_reads])
        k = int(np.searchsorted(csum, max_bytes, side="right"))
        hi = lo + max(1, min(k, max_reads))
        spans.append((lo, hi))
        lo = hi
    return spans


def _source_name(url: str, peer: PeerRegions | None) -> str:
    """How a failed pull names where it read from: the peer's node id and URL."""
    if not url:
        return "this daemon"
    return f"{peer.node_id!r} at {url}" if peer is not None else url


def _merge_peer(a: PeerRegions, b: PeerRegions) -> PeerRegions:
    seen = {r.region_id for r in a.regions}
    return PeerRegions(
        a.node_id,
        a.epoch,
        a.transport,
        a.regions + [r for r in b.regions if r.region_id not in seen],
        b.advert or a.advert,
        a.boot_id,
        {**a.files, **b.files},
        a.lease_id,
        {**a.scope, **b.scope},
        {**a.adverts, **b.adverts},
    )


def _scope_check(peer: PeerRegions, req: PullRequest) -> str:
    """Refuse records not given under ``req``'s lease; name that lease for refusals."""
    if peer.lease_id != req.lease_id:
        raise ProtocolError(
            f"region records from {peer.node_id!r} refused: they were given under lease "
            f"{peer.lease_id!r}, not the pull's {req.lease_id!r}; nothing was transferred"
        )
    return f"{req.model!r} version {req.version} read under lease {req.lease_id!r}"
