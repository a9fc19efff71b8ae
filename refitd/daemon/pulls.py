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
4. the bytes move along the path chosen at submit (see :meth:`PullManager.choose_path`):
   ``shm`` when the source is this daemon or a daemon proven
   to be on this host (same kernel boot id, and every segment it names maps to the
   very file its signed record states, at the exact size it states); the transport
   (``ucx``) otherwise. ``--transport shm`` or ``ucx`` forces one path;
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
from refitd.daemon.regions import (
    refuse_overlapping_writes,
    validate_descriptors,
    validate_pack_specs,
)
from refitd.daemon.trust import check_pack_reads, check_reads
from refitd.errors import NotFoundError, ProtocolError, RefitError, TransportError
from refitd.wire import (
    DescriptorTable,
    ErrorBody,
    PackSpec,
    PeerRegions,
    PullProgress,
    PullRequest,
    PullState,
    RegionInfo,
    StagedPack,
)
from transports.core import Peer, rows_as_batch, split_pieces, suspect_ranges
from transports.samehost import same_file
from transports.shm import SharedSegment

if TYPE_CHECKING:
    from refitd.client.http import RefitClient

__all__ = ["PullJob", "PullManager", "Source"]

KEEP_FINISHED = 1024
"""Ended pulls whose results stay queryable (the oldest are forgotten first)."""

TRANSPORT_PIECE = 32 << 20
"""Largest single read handed to a transport (bytes); longer reads are cut up so
several can be in flight."""

PEER_MAPPINGS = 256
"""Peer segments kept mapped between pulls (least recently used dropped first)."""

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
    path: str = ""  # "local", "shm" or the transport's scheme: decided at submit
    cancel_reason: str = ""
    fail_reason: str = ""  # set when the source left the registry: FAILED, not CANCELLED
    #: regions of this daemon the pull reads or writes, kept from deletion until it ends
    pins: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

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


def _coalesced_dst(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Destination ``(region, offset, nbytes)`` ranges of wire ``rows``, sorted and
    merged: the data plane's :func:`~transports.core.suspect_ranges` of those reads."""
    return [(r.region, r.offset, r.nbytes) for r in suspect_ranges(rows_as_batch(rows))]


class PullManager:
    """Every pull of one daemon. Tasks are tracked and cancelled on :meth:`close`."""

    def __init__(self, daemon: Daemon, connect: Callable[[str], Source]) -> None:
        self.d = daemon
        self._connect = connect
        self.jobs: dict[str, PullJob] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count(1)
        self._peers: dict[tuple[str, int], Peer] = {}
        self._mapped: dict[tuple[str, int, int], SharedSegment] = {}
        # (st_dev, st_ino) each kept mapping was verified against
        self._verified: dict[tuple[str, int, int], tuple[int, ...]] = {}

    def source_for(self, url: str) -> Source:
        """This daemon for ``""``; else the peer at ``url`` if this daemon trusts it
        (:class:`ProtocolError`, 400, before any connection opens, if not)."""
        return LocalSource(self.d) if not url else self._connect(self.d.peers.check(url))

    async def submit(self, req: PullRequest) -> PullJob:
        """Check lease and every descriptor, then start moving bytes in a task.

        Raises (nothing moved) :class:`ConflictError` for a stale/unleased version,
        :class:`ProtocolError` naming the first out-of-bounds descriptor or pack spec.
        """
        src = self.source_for(req.source)
        await src.check_lease(req.lease_id, req.model, req.version)
        rows = req.descriptors.rows()
        src_ids = sorted(
            {int(x) for x in np.unique(rows[:, 0])} | {p.src_region for p in req.pack_specs}
        )
        peer = await src.regions(src_ids, req) if src_ids else None
        src_sizes = {r.region_id: r.nbytes for r in peer.regions} if peer else {}
        dst_sizes = self.d.regions.sizes()
        validate_descriptors(req.descriptors, src_sizes, dst_sizes)
        validate_pack_specs(req.pack_specs, src_sizes, dst_sizes)
        refuse_overlapping_writes(rows, req.pack_specs)
        if peer is not None:
            what = _scope_check(peer, req)
            check_reads(rows, peer.scope, what)
            check_pack_reads(req.pack_specs, peer.scope, what)
        path = self.choose_path(src, peer)
        total = int(rows[:, 4].sum()) + sum(p.nbytes for p in req.pack_specs)
        job = PullJob(f"p{next(self._seq)}", req, total, rows.shape[0] + len(req.pack_specs))
        job.path = path
        dst_ids = {int(x) for x in np.unique(rows[:, 2])} | {p.dst_region for p in req.pack_specs}
        job.pins.enter_context(
            self.d.using(dst_ids | (set(src_ids) if isinstance(src, LocalSource) else set()))
        )
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
        for seg in self._mapped.values():
            seg.close()
        self._mapped.clear()

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
            moving = True
            await self._move(job, src, all_rows, peer)
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
            job.pins.close()
            self.d.reap_soon()  # an exited client's region this pull held may go now
            if staged is not None:
                with contextlib.suppress(RefitError):
                    await asyncio.shield(src.drop(staged.region.region_id, req.lease_id))
            job.finished.set()

    async def _move(
        self, job: PullJob, src: Source, rows: np.ndarray, peer: PeerRegions | None
    ) -> None:
        if rows.shape[0] == 0 or peer is None:
            return
        if isinstance(src, LocalSource):
            await self._copy(job, rows, lambda rid: _noop(self.d.view(rid)))
        elif job.path == SHM_SCHEME:
            await self._copy_shm(job, rows, peer)
        else:
            await self._get_transport(job, rows, peer)

    # ------------------------------------------------------------ path choice

    def choose_path(self, src: Source, peer: PeerRegions | None) -> str:
        """The path a pull from ``src`` takes, decided before any byte moves.

        ``shm`` for this daemon (a copy between its own segments, in any mode); in
        mode ``auto`` or ``shm``, ``shm`` when :meth:`shm_refusal` finds nothing
        against the peer; else (mode ``auto`` or a scheme) the transport's scheme,
        when the peer advertises that transport.
        Raises :class:`TransportError` (nothing moved) when no path fits.
        """
        if isinstance(src, LocalSource):
            return SHM_SCHEME
        if peer is None:
            return "none"  # nothing to read
        mode = self.d.options.transport
        why_not_shm = f"this daemon is forced to its transport (--transport {mode})"
        if mode in (AUTO, SHM_SCHEME):
            refusal = self.shm_refusal(peer)
            if refusal is None:
                return SHM_SCHEME
            if mode == SHM_SCHEME:
                raise TransportError(
                    f"pull from {peer.node_id!r} refused before any byte moved: this daemon "
                    f"runs the shared-memory path only (--transport shm) and {refusal}"
                )
            why_not_shm = refusal
        return self._transport_scheme(peer, why_not_shm)

    def _transport_scheme(self, peer: PeerRegions, why_not_shm: str) -> str:
        from transports.core import PeerInfo

        transport = self.d.transport
        if transport is None:
            raise TransportError(
                f"pull from {peer.node_id!r} refused: this daemon runs no transport"
            )
        scheme = str(transport.scheme)
        if not peer.advert:
            raise TransportError(
                f"pull from {peer.node_id!r} refused before any byte moved: it advertises no "
                f"data plane (it runs {peer.transport!r}), and not the shared-memory path "
                f"because {why_not_shm}"
            )
        theirs = PeerInfo.decode(peer.advert).scheme
        if theirs != scheme:
            raise TransportError(
                f"pull from {peer.node_id!r} refused before any byte moved: it serves "
                f"{theirs!r}, this daemon {scheme!r}"
            )
        log.info("pull from %s over %s: not shm because %s", peer.node_id, scheme, why_not_shm)
        return scheme

    def shm_refusal(self, peer: PeerRegions) -> str | None:
        """Why the shared-memory path to ``peer`` is not proven, or None when it is:
        the peer's boot id equals ours and every region it listed maps (by name) to
        the very file its signed record names, at exactly the size it states. Every
        region is mapped here, so a verified pull starts without mapping anything."""
        if not peer.boot_id or peer.boot_id != self.d.boot_id:
            return f"{peer.node_id!r} runs under another kernel (boot id differs: another host)"
        for rec in peer.regions:
            try:
                self._peer_segment(peer, rec)
            except (RefitError, OSError) as exc:
                return f"region {rec.region_id} of {peer.node_id!r} does not map here: {exc}"
        return None

    # ------------------------------------------------------------ moving bytes

    async def _copy(
        self, job: PullJob, rows: np.ndarray, src_view: Callable[[int], Awaitable[memoryview]]
    ) -> None:
        s_ids, s_idx = np.unique(rows[:, 0], return_inverse=True)
        d_ids, d_idx = np.unique(rows[:, 2], return_inverse=True)
        srcs = [await src_view(int(i)) for i in s_ids]
        dsts = [self.d.view(int(i)) for i in d_ids]
        local = rows.copy()
        local[:, 0] = s_idx.reshape(-1)
        local[:, 2] = d_idx.reshape(-1)
        await self.d.copier.copy(srcs, dsts, local, job.progress)

    async def _copy_shm(self, job: PullJob, rows: np.ndarray, peer: PeerRegions) -> None:
        records = {r.region_id: r for r in peer.regions}

        async def view(rid: int) -> memoryview:
            return self._peer_segment(peer, records[rid]).numpy().data

        await self._copy(job, rows, view)

    def _peer_segment(self, peer: PeerRegions, rec: RegionInfo) -> SharedSegment:
        """The peer's segment for ``rec``, mapped once and kept (a fresh mapping of a
        large region costs a page fault per 4 KiB on first touch, every pull).

        A new mapping is made only after checking that the name maps the file the
        peer's signed record names (``files``), before and after mapping it, and
        that its size is exactly the recorded one; else :class:`TransportError`."""
        key = (peer.node_id, peer.epoch, rec.region_id)
        want = peer.files.get(rec.region_id)
        seg = self._mapped.pop(key, None)
        if seg is not None and (
            seg.name != rec.handle or seg.size != rec.nbytes or self._verified.get(key) != want
        ):
            seg.close()
            seg = None
        if seg is None:
            if want is None:
                raise TransportError(f"the record names no file for segment {rec.handle!r}")
            same_file(rec.handle, tuple(want))
            seg = SharedSegment.attach(rec.handle, rec.nbytes)
            try:
                same_file(rec.handle, tuple(want))
            except BaseException:
                seg.close()
                raise
            self._verified[key] = tuple(want)
        self._mapped[key] = seg  # most recently used last
        while len(self._mapped) > PEER_MAPPINGS:
            oldest = next(iter(self._mapped))
            self._mapped.pop(oldest).close()
            self._verified.pop(oldest, None)
        return seg

    async def _get_transport(self, job: PullJob, rows: np.ndarray, peer: PeerRegions) -> None:
        from transports.core import PeerInfo

        transport = self.d.transport
        assert transport is not None  # choose_path picked a transport path
        info = PeerInfo.decode(peer.advert)
        key = (peer.node_id, peer.epoch)
        conn = self._peers.get(key)
        if conn is None:
            conn = await transport.connect(info)
            self._peers[key] = conn
        else:
            await conn.update(info)
        # Transport reads are (local=dst, local_off, remote=src, remote_off, nbytes).
        reads = split_pieces(rows_as_batch(rows), TRANSPORT_PIECE)
        step = 4096
        for lo in range(0, reads.shape[0], step):
            chunk = reads[lo : lo + step]
            # Two batches in flight keep both directions of the data plane busy.
            sizes = chunk["nbytes"]
            half = int(np.searchsorted(np.cumsum(sizes), sizes.sum() // 2))
            parts = [p for p in (chunk[: half + 1], chunk[half + 1 :]) if len(p)]
            try:
                async with asyncio.TaskGroup() as tg:
                    for part in parts:
                        tg.create_task(conn.get(part))
            except BaseExceptionGroup as group:
                # A TaskGroup wraps even one failure (PeerLost when the source died
                # mid-read) in an ExceptionGroup; raise the transport's own error so
                # the pull fails with its message rather than escaping `_run`.
                first = next((e for e in group.exceptions if isinstance(e, RefitError)), None)
                if first is None:
                    raise
                raise first from None
            job.progress(len(chunk), int(chunk["nbytes"].sum()))


def _source_name(url: str, peer: PeerRegions | None) -> str:
    """How a failed pull names where it read from: the peer's node id and URL."""
    if not url:
        return "this daemon"
    return f"{peer.node_id!r} at {url}" if peer is not None else url


async def _noop(v: memoryview) -> memoryview:
    return v


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
    )


def _scope_check(peer: PeerRegions, req: PullRequest) -> str:
    """Refuse records not given under ``req``'s lease; name that lease for refusals."""
    if peer.lease_id != req.lease_id:
        raise ProtocolError(
            f"region records from {peer.node_id!r} refused: they were given under lease "
            f"{peer.lease_id!r}, not the pull's {req.lease_id!r}; nothing was transferred"
        )
    return f"{req.model!r} version {req.version} read under lease {req.lease_id!r}"
