"""One daemon's live state: identity, regions and their memory, registry, data plane.

:class:`Daemon` is what the HTTP handlers call. It owns every shared-memory segment
it created or attached, registers each with its transport once (whole segment), and
answers peers' requests for region records. The pure rules live in
:mod:`refitd.daemon.registry` and :mod:`refitd.daemon.regions`; this class adds the
memory, the clock and the waiting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import inspect
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from refitd.config import LimitsConfig
from refitd.daemon.caps import Caps
from refitd.daemon.copier import Copier, CopyFault, pack_strided, zero_view
from refitd.daemon.holders import Holders
from refitd.daemon.memory import (
    SharedSegment,
    byte_view,
    check_shm_capacity,
    free_shm_bytes,
    refuse_cuda_ipc,
)
from refitd.daemon.owners import ModelOwners
from refitd.daemon.paths import peer_paths
from refitd.daemon.peers import PeerPolicy
from refitd.daemon.regions import RegionTable, validate_plan
from refitd.daemon.registry import Lease, Registry
from refitd.daemon.trust import Extents, check_pack_reads
from refitd.errors import (
    AccessDenied,
    ConflictError,
    InsufficientStorage,
    PlanError,
    ProtocolError,
    RefitError,
    TransportError,
)
from refitd.wire import (
    GcReport,
    NodeInfo,
    PackSpec,
    PeerRegions,
    RegionAttach,
    RegionCreate,
    RegionInfo,
    RegionKind,
    StagedPack,
    VersionInfo,
)
from transports.interface import Transport
from transports.segments import (
    SHM_DIR,
    cleanup_stale,
    creator_tag,
    huge_page_mode,
    is_stale,
    stale_segments,
)
from transports.shm import ShmTransport, boot_id, file_id

__all__ = [
    "AUTO",
    "SHM_SCHEME",
    "Daemon",
    "DaemonOptions",
    "boot_id",
    "file_id",
]

log = logging.getLogger("refitd.daemon")

MANIFEST_CHECKS = 2
"""Published manifests decoded and checked at once; more wait their turn."""

STAGING_POOL = 4
"""Free staging regions kept for reuse by later pack specs."""

SHM_SCHEME = "shm"
"""The built-in same-host data plane: map the peer daemon's segments by name."""

AUTO = "auto"
"""The default data-plane mode: per source peer the same-host shared-memory path
whenever that peer is proven to share this host's memory, else UCX where both ends
have RDMA, else ``tcp`` (see :mod:`refitd.daemon.paths`)."""

UCX_SCHEME = "ucx"
"""UCX: ``auto`` starts it beside ``tcp`` where this host's UCX offers RDMA."""


@dataclass(frozen=True)
class DaemonOptions:
    """How one daemon runs. ``port`` 0 binds any free port (reported once bound).

    ``transport`` is the data-plane mode: ``"auto"`` (default: per source peer the
    same-host shared-memory path when the peer is proven to be on this host with
    attachable segments, else UCX where both ends have RDMA, else ``tcp``; see
    :mod:`refitd.daemon.paths`), ``"shm"`` (only the shared-memory path; a peer on
    another host is refused) or a scheme of ``transports.interface`` (e.g. ``"tcp"`` or
    ``"ucx"``: every other-host peer through that transport).
    ``secret`` (≥ 16 bytes) authenticates peer records between the daemons of one
    deployment. ``boot_id`` empty means this kernel's; another value makes the
    daemon claim another host (tests of the cross-host choice on one machine).
    ``peers`` are the base URLs of the peer daemons it may read from
    (``[peers] allow``, see :mod:`refitd.daemon.peers`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    unix_path: str | None = None
    transport: str = AUTO
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    node_id: str = ""
    client_max_size: int = 1 << 30
    grace_s: float = 10.0
    boot_id: str = ""
    peers: tuple[str, ...] = ()
    #: deadline of one batch of transport reads from a peer, s (``[data_plane]
    #: pull_timeout_s``): a hung peer fails only the pulls that read from it
    pull_timeout_s: float = 120.0
    #: ``refitd.config.RegistryConfig`` (None: the static registry, this daemon alone)
    registry: Any = None
    #: TCP connections per peer of the ``tcp`` data plane (``[data_plane] lanes``)
    lanes: int = 4
    #: port of the ``tcp`` data server (``[data_plane] tcp_port``; 0: any free one)
    tcp_port: int = 0
    #: ``refitd.config.LimitsConfig`` (None: its defaults): caps, manifest size, pending TTL
    limits: Any = None
    #: ``[models] owners`` / ``readers``: ``MODEL=PRINCIPAL`` entries (see
    #: :class:`~refitd.daemon.owners.ModelOwners`)
    model_owners: tuple[str, ...] = ()
    model_readers: tuple[str, ...] = ()
    #: ``[mirrors] policy``: ``never``, ``always`` or ``shared`` (see
    #: :mod:`refitd.daemon.mirrors`)
    mirrors: str = "never"


class Daemon:
    def __init__(
        self,
        options: DaemonOptions,
        *,
        clock: Callable[[], float] = time.monotonic,
        copier: Copier | None = None,
    ) -> None:
        self.options = options
        self.node_id = options.node_id or f"{socket.gethostname()}-{os.getpid()}"
        self.epoch = time.time_ns()
        self.clock = clock
        self.limits: LimitsConfig = options.limits or LimitsConfig()
        self.registry = Registry(
            self.node_id, self.epoch, clock, pending_ttl_s=self.limits.pending_ttl_s
        )
        #: published manifests being decoded and checked now (off the event loop), and
        #: how many may be at once (the others wait before their body is read)
        self.manifests_checking = 0
        self.manifest_checks = asyncio.Semaphore(MANIFEST_CHECKS)
        #: per-principal caps on leases, regions and pulls (``[limits]``)
        self.caps = Caps(
            self.limits.max_leases_per_principal,
            self.limits.max_regions_per_principal,
            self.limits.max_pulls_per_principal,
            self.limits.max_region_bytes_per_principal,
        )
        #: the one decision which source URLs may be contacted (config, then registry)
        self.peers = PeerPolicy(options.peers)
        self.regions = RegionTable(self.epoch)
        self.segments: dict[int, SharedSegment] = {}
        self.transport: Transport | None = None  # every mode but shm: the primary
        #: every transport started, by scheme (see :mod:`refitd.daemon.paths`)
        self.transports: dict[str, Transport] = {}
        #: per peer node, the path the last pull from it took and why
        self.seen_paths: dict[str, tuple[str, str]] = {}
        self.boot_id = options.boot_id or boot_id()
        #: the same-host data plane, in every mode: pulls from this daemon itself and
        #: from peers proven to share this host's memory (``copier``: its copy engine)
        self.shm = ShmTransport(
            secret=options.secret, peer_id=self.node_id, copier=copier, boot_id=self.boot_id
        )
        self.ready = False
        self.ucx_transports: list[str] = []  # what the loaded UCX can use (ucx_info -d)
        self._lease_changed = asyncio.Event()
        self._staging_free: list[int] = []
        #: ids of the staging regions this daemon made: a client may label its own
        #: region "staging", so the label alone must not admit it to the pool
        self._staging_ids: set[int] = set()
        #: staging regions handed to a reader -> (the lease it packed under, bytes packed
        #: at its start); a reader that never releases one cannot keep it past its lease
        #: (see _reclaim_staging), and the lease reads only the bytes packed for it
        self._staging_held: dict[int, tuple[str, int]] = {}
        #: regions a running pull of this daemon reads or writes (see :meth:`using`)
        self._busy: collections.Counter[int] = collections.Counter()
        #: regions a running pull writes, with the ids of those pulls (see :meth:`writing`)
        self._writing: dict[int, set[str]] = {}
        #: the memory behind each region, ``(st_dev, st_ino)`` of its segment -> region
        #: id: one memory is one region, so every rule keyed on a region id holds for
        #: that memory (see :meth:`_record`)
        self._memory: dict[tuple[int, int], int] = {}
        #: regions an expert pool holds -> the pool's name (set by the pools)
        self.pool_regions: dict[int, str] = {}
        #: who owns each model, and who may read it (``[models]``)
        self.models = ModelOwners(options.model_owners, options.model_readers)
        #: client processes regions live with, and regions whose client exited
        self.holders = Holders(self._holder_exited)
        self._held: dict[str, set[int]] = {}
        self._orphans: set[int] = set()
        self._exited: set[str] = set()  # holder tags seen exiting (maybe not yet reaped)
        self._reaping: asyncio.Task[list[RegionInfo]] | None = None
        #: stale segments of earlier lives (this daemon's or its clients') removed at start
        self.removed_at_start: list[str] = []
        #: host mirrors' hook (:mod:`refitd.daemon.mirrors`): what a lease on a version
        #: may read of a mirror still filling (only complete chunks are served)
        self.scope_limit: Callable[[str, int, dict[int, Extents]], dict[int, Extents]] | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bring up the data plane; the daemon reports ready only after this.

        Every mode but ``shm`` starts a transport (``auto`` starts UCX); a transport
        that cannot start stops the daemon's start with :class:`TransportError`.
        First, shared-memory segments whose creator process is gone — left by an
        earlier life of this daemon, or by clients that crashed — are unlinked."""
        self.removed_at_start = await asyncio.to_thread(cleanup_stale)
        if self.removed_at_start:
            log.info("removed %d stale segment(s) at start", len(self.removed_at_start))
        await self.shm.start()
        mode = self.options.transport
        if mode in (AUTO, UCX_SCHEME):
            from transports.ucx.info import ucx_transports

            self.ucx_transports = await ucx_transports()
        from refitd.daemon.paths import transport_options, transport_schemes
        from transports.interface import create_transport, transport_class

        for scheme in transport_schemes(mode, self.ucx_transports):
            extra = transport_options(self, scheme)
            if "pull_timeout" in inspect.signature(transport_class(scheme)).parameters:
                extra["pull_timeout"] = self.options.pull_timeout_s
            t = create_transport(scheme, secret=self.options.secret, peer_id=self.node_id, **extra)
            try:
                await t.start()
            except RefitError as exc:
                hint = " (--transport shm runs without it, same host only)" if mode == AUTO else ""
                raise TransportError(
                    f"data plane {scheme!r} did not start, so the daemon will not report "
                    f"ready: {exc}{hint}"
                ) from exc
            self.transports[scheme] = t
            self.transport = self.transport or t
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        self.holders.close()
        for t in self.transports.values():
            await t.close()
        self.transports.clear()
        self.transport = None
        await self.shm.close()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()

    def info(self) -> NodeInfo:
        worker: dict[str, str] = {}
        if self.transport is not None:
            advert = self.transport.advertise()
            worker = {"scheme": advert.scheme, "peer_id": advert.peer_id}
        return NodeInfo(
            self.node_id,
            self.epoch,
            self.options.transport,
            worker,
            shm_huge_pages=huge_page_mode(),
            ucx_transports=self.ucx_transports,
            paths=peer_paths(self, self.seen_paths),
        )

    # ------------------------------------------------------------ regions

    async def _record(
        self,
        seg: SharedSegment,
        kind: RegionKind,
        owner: str,
        label: str,
        daemon_owned: bool,
        holder: str = "",
    ) -> RegionInfo:
        ident = seg.file_identity
        same = self._memory.get(ident)
        if same is not None:
            if not daemon_owned:
                seg.close()  # unmap what attach mapped; the file is not ours to unlink
            raise ConflictError(
                f"region refused: segment {seg.name!r} is memory this daemon already holds "
                f"as region {same} (device {ident[0]}, inode {ident[1]}); one memory is one "
                "region, never a second id whose rules its first id's would not bind"
            )
        rid = self.regions.new_id()
        self._memory[ident] = rid
        try:
            return await self._record_new(rid, seg, kind, owner, label, daemon_owned, holder)
        except BaseException:
            if rid not in self.regions:
                self._memory.pop(ident, None)
            raise

    async def _record_new(
        self,
        rid: int,
        seg: SharedSegment,
        kind: RegionKind,
        owner: str,
        label: str,
        daemon_owned: bool,
        holder: str,
    ) -> RegionInfo:
        if holder and not self.holders.watch(holder):
            holder = ""  # not a process visible here: the region lives until deleted
        info = RegionInfo(
            rid, kind, seg.name, seg.size, self.epoch, owner, label, daemon_owned, holder
        )
        if holder:
            self._held.setdefault(holder, set()).add(rid)
        for t in self.transports.values():
            await t.register(rid, seg)
        await self.shm.register(rid, seg)
        self.segments[rid] = seg
        return self.regions.add(info)

    async def create_region(self, req: RegionCreate) -> RegionInfo:
        """A new daemon-owned segment of exactly ``req.nbytes`` bytes (≥ 1)."""
        if req.kind is RegionKind.CUDA_IPC:
            refuse_cuda_ipc()
        check_shm_capacity(req.nbytes, f"region of {req.nbytes} bytes")
        try:  # a size the kernel cannot map is the client's mistake, not a server error
            # Every byte is reserved now: a full /dev/shm refuses here (507), never
            # later as a bus error in the middle of a pull.
            seg = SharedSegment.create(req.nbytes, req.label or "region")
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise InsufficientStorage(
                    f"region of {req.nbytes} bytes refused: {SHM_DIR} cannot reserve its "
                    f"memory ({free_shm_bytes()} bytes free); nothing was created"
                ) from None
            raise PlanError(f"region of {req.nbytes} bytes refused: {exc}") from None
        except OverflowError as exc:
            raise PlanError(f"region of {req.nbytes} bytes refused: {exc}") from None
        return await self._record(
            seg, req.kind, req.owner, req.label, daemon_owned=True, holder=req.holder
        )

    async def attach_region(self, req: RegionAttach, uid: int | None = None) -> RegionInfo:
        """Map a segment a client created; its size must equal ``req.nbytes``.

        ``uid``: the caller's uid when the kernel named it (Unix socket, not root): the
        segment must then be that uid's file. The daemon may open files its caller
        cannot (its own, its group's), and must not map them on that caller's behalf."""
        if req.kind is RegionKind.CUDA_IPC:
            refuse_cuda_ipc()
        seg = SharedSegment.attach(req.handle, req.nbytes)
        if uid is not None and seg.file_uid != uid:
            seg.close()
            raise AccessDenied(
                f"attaching segment {req.handle!r} refused: its file belongs to uid "
                f"{seg.file_uid}, not to the caller's uid {uid}; a client attaches only "
                "segments it made"
            )
        return await self._record(
            seg, req.kind, req.owner, req.label, daemon_owned=False, holder=req.holder
        )

    async def delete_region(self, region_id: int) -> RegionInfo:
        """Forget a region (``DELETE /v1/regions/{id}``). Refused (409) while a READY,
        pending or leased version publishes from it (a retired version included, while
        leased), while a running pull of this daemon reads or writes it (its mapping
        is never unmapped under a copy), and (403) for a staging region, which only
        the daemon itself frees."""
        info = self.regions.get(region_id)
        if region_id in self._staging_ids:
            raise AccessDenied(
                f"region {region_id} refused deletion: it is a staging region of this "
                "daemon, freed by the lease that packed it or when that lease ends"
            )
        protected = self.registry.protected_regions().get(region_id)
        if protected is not None:
            model, version, why = protected
            raise ConflictError(
                f"region {region_id} refused deletion: {model!r} version {version} "
                f"publishes tensors in it and is {why}"
            )
        return await self._drop_region(region_id, info)

    async def _drop_region(self, region_id: int, info: RegionInfo) -> RegionInfo:
        if self._busy[region_id]:
            raise ConflictError(
                f"region {region_id} refused deletion: {self._busy[region_id]} running "
                "pull(s) of this daemon read or write it; cancel them or wait"
            )
        self.regions.remove(region_id)
        self._orphans.discard(region_id)
        if info.holder:
            self._held.get(info.holder, set()).discard(region_id)
        for t in self.transports.values():
            await t.deregister(region_id)
        await self.shm.deregister(region_id)
        seg = self.segments.pop(region_id)
        if self._memory.get(seg.file_identity) == region_id:
            del self._memory[seg.file_identity]
        seg.close()
        return info

    def view(self, region_id: int) -> memoryview:
        self.regions.get(region_id)
        return byte_view(self.segments[region_id])

    # ------------------------------------------------------------ client death

    def _holder_exited(self, tag: str) -> None:
        self._exited.add(tag)
        self._orphans |= self._held.pop(tag, set())
        log.info("client %s exited: releasing its regions %s", tag, sorted(self._orphans))
        self.reap_soon()

    def reap_soon(self) -> None:
        """Release exited clients' regions in a task (no-op when there are none)."""
        if self._orphans and (self._reaping is None or self._reaping.done()):
            self._reaping = asyncio.get_running_loop().create_task(self.reap())

    async def reap(self, dry_run: bool = False) -> list[RegionInfo]:
        """Release (``dry_run``: only list) every region whose holder process exited
        and that nothing still needs: no READY, pending or leased version publishes
        from it and no running pull reads or writes it. Those still needed stay
        orphans and are released by a later call, once they are free; a client's
        segment whose creator is gone is unlinked with it."""
        protected = self.registry.protected_regions()
        out: list[RegionInfo] = []
        for rid in sorted(self._orphans):
            if rid not in self.regions:
                self._orphans.discard(rid)
                continue
            if rid in protected or self._busy[rid]:
                continue
            info = self.regions.get(rid)
            out.append(info)
            if dry_run:
                continue
            stale = not info.daemon_owned and (
                creator_tag(info.handle) in self._exited or is_stale(info.handle)
            )
            await self._drop_region(rid, info)
            if stale:
                with contextlib.suppress(OSError):
                    (SHM_DIR / info.handle).unlink()
        return out

    async def gc(self, dry_run: bool = False) -> GcReport:
        """``POST /v1/gc``: free exited clients' regions and stale segments."""
        regions = await self.reap(dry_run)
        segments = stale_segments() if dry_run else await asyncio.to_thread(cleanup_stale)
        return GcReport(dry_run, regions, segments)

    @contextlib.contextmanager
    def using(self, region_ids: Iterable[int]) -> Iterator[None]:
        """Mark regions as read or written by a running pull for the block: none of
        them is deleted (and unmapped) meanwhile."""
        ids = sorted(set(region_ids))
        self._busy.update(ids)
        try:
            yield
        finally:
            self._busy.subtract(ids)
            for i in ids:
                if self._busy[i] <= 0:
                    del self._busy[i]

    @contextlib.contextmanager
    def writing(self, region_ids: Iterable[int], pull_id: str) -> Iterator[None]:
        """Mark regions as written by running pull ``pull_id`` for the block: no
        version is published from them meanwhile (:meth:`check_publishable`)."""
        ids = sorted(set(region_ids))
        for i in ids:
            self._writing.setdefault(i, set()).add(pull_id)
        try:
            yield
        finally:
            for i in ids:
                pulls = self._writing.get(i, set())
                pulls.discard(pull_id)
                if not pulls:
                    self._writing.pop(i, None)

    def check_publishable(self, region_ids: Iterable[int]) -> None:
        """Refuse (:class:`ConflictError`, 409, naming what holds it) publishing a
        version from a region whose bytes something other than its publisher changes:
        a staging region (the daemon repacks it for other leases), an expert pool's
        region (``ensure`` rewrites its slots, pulls its host rows), or a region a
        running pull writes (its bytes would change after the version is READY)."""
        for rid in sorted(set(region_ids)):
            why = ""
            if rid in self._staging_ids:
                why = "it is a staging region of this daemon, which repacks it for other leases"
            elif rid in self.pool_regions:
                why = (
                    f"it is a region of expert pool {self.pool_regions[rid]!r}, whose ensure "
                    "and pulls rewrite it"
                )
            elif self._writing.get(rid):
                pulls = ", ".join(sorted(self._writing[rid]))
                why = f"running pull(s) {pulls} write it; wait for them to end or cancel them"
            if why:
                raise ConflictError(
                    f"publishing from region {rid} refused: {why}; a version's bytes never "
                    "change once published"
                )

    def holds_memory(self, region_id: int) -> bool:
        """Whether ``region_id`` holds memory for a principal now: a region that
        exists and, for a staging region, is held for a lease (a free one waits in
        the pool for anyone). What the region cap counts."""
        if region_id not in self.regions:
            return False
        return region_id not in self._staging_ids or region_id in self._staging_held

    @property
    def staging_ids(self) -> frozenset[int]:
        """Every staging region of this daemon (held or free)."""
        return frozenset(self._staging_ids)

    def lease_scope(self, lease: Lease) -> dict[int, Extents]:
        """What ``lease`` may read here: its version's shard ranges, and in each staging
        region packed for that very lease the bytes packed for it (not the rest of a
        reused region)."""
        scope = dict(self.registry.scope(lease.model, lease.version))
        if self.scope_limit is not None:  # a mirror still filling: its complete chunks
            scope = self.scope_limit(lease.model, lease.version, scope)
        for rid, (held, packed) in self._staging_held.items():
            if held == lease.lease_id and rid in self.regions:
                scope[rid] = [(0, packed)] if packed else []
        return scope

    def peer_regions(self, ids: list[int] | None = None, lease: Lease | None = None) -> PeerRegions:
        """Signed records of ``ids`` (all regions if ``None``) for a peer daemon.

        Under ``lease`` (a live one, checked by the caller) only regions that lease may
        read are given, each with the byte ranges it may read (``scope``); any other
        id is refused (:class:`AccessDenied`). Without a lease the records carry no
        scope, no transport keys and no file identities: enough to list regions,
        nothing to read them with."""
        scope: dict[int, Extents] = {}
        if lease is not None:
            allowed = self.lease_scope(lease)
            if ids is None:
                ids = sorted(allowed)
            outside = [i for i in ids if i not in allowed]
            if outside:
                raise AccessDenied(
                    f"region(s) {outside} refused: not part of {lease.model!r} version "
                    f"{lease.version} read under lease {lease.lease_id!r}; a lease reads only "
                    "its version's shards and staging packed for it"
                )
            scope = {i: allowed[i] for i in ids}
        infos = list(self.regions) if ids is None else [self.regions.get(i) for i in ids]
        # The holder process is nobody's business but the region's owner; the segment
        # name only a reader under a lease needs (a same-host daemon maps it by name).
        infos = [
            msgspec.structs.replace(r, holder="", handle=r.handle if lease is not None else "")
            for r in infos
        ]
        advert = b""
        adverts: dict[str, bytes] = {}
        files: dict[int, tuple[int, int]] = {}
        if lease is not None:
            adverts = {s: t.advertise().encode() for s, t in self.transports.items()}
            advert = next(iter(adverts.values()), b"")
            files = self.shm.file_ids([r.region_id for r in infos])
        rec = PeerRegions(
            self.node_id,
            self.epoch,
            self.options.transport,
            infos,
            advert,
            self.boot_id,
            files,
            lease_id=lease.lease_id if lease is not None else "",
            scope=scope,
            adverts=adverts,
        )
        return rec.signed(self.options.secret)

    # ------------------------------------------------------------ packing

    async def pack(self, specs: list[PackSpec], lease: Lease) -> StagedPack:
        """Gather each spec's strided block into one new daemon-owned staging region.

        Only the source fields of each spec are used here; the destination fields are
        the reader's. Refused (nothing packed) if there is no spec, any spec leaves
        its source region, or any spec reads bytes outside what ``lease`` (live,
        checked by the caller) may read. The region is held for that lease: released
        by its holder (:meth:`release_staging`) or reclaimed once the lease is gone.
        """
        if not specs:
            raise ProtocolError("pack refused: the request names no pack spec, nothing to pack")
        sizes = self.regions.sizes()
        offsets: list[int] = []
        total = 0
        for p in specs:
            offsets.append(total)
            total += p.nbytes
        staging_sizes = {p.dst_region: total for p in specs}
        validate_plan(
            np.zeros((0, 5), dtype=np.int64),
            [msgspec.structs.replace(p, dst_offset=o) for p, o in zip(specs, offsets, strict=True)],
            sizes,
            staging_sizes,
        )
        what = f"{lease.model!r} version {lease.version} (lease {lease.lease_id!r})"
        check_pack_reads(specs, self.registry.scope(lease.model, lease.version), what)
        region = await self._take_staging(total, lease.owner)
        self._staging_held[region.region_id] = (lease.lease_id, total)
        dst = self.view(region.region_id)
        srcs = {p.src_region: self.view(p.src_region) for p in specs}

        def work() -> None:
            # A reused region still holds what it was packed with for another lease:
            # what this pack does not overwrite is zeroed, so no byte of it survives.
            # Guarded like every copy here: a staging file shrunk by the principal
            # that sees its name faults here, not in the daemon.
            zero_view(dst[total:])
            for p, o in zip(specs, offsets, strict=True):
                pack_strided(
                    srcs[p.src_region], p.src_offset, p.shape, p.strides, p.itemsize, dst, o
                )

        try:
            await asyncio.to_thread(work)
        except CopyFault as exc:
            if exc.side == "destination":
                # The staging region itself was shrunk: never handed out again.
                await self._discard_staging(region.region_id)
                raise TransportError(
                    f"pack refused: staging region {region.region_id} faulted under the "
                    "pack: its segment was shrunk; it is discarded"
                ) from exc
            spec = next((p for p in specs if self._covers(p.src_region, exc.address)), specs[0])
            raise TransportError(
                f"pack refused: source region {spec.src_region} faulted under the gather: "
                "its segment was shrunk by its owner"
            ) from exc
        return StagedPack(region, offsets)

    def _covers(self, region_id: int, address: int) -> bool:
        """Whether ``address`` (in this process) lies in region ``region_id``'s mapping."""
        seg = self.segments.get(region_id)
        return seg is not None and seg.address <= address < seg.address + seg.size

    async def _discard_staging(self, region_id: int) -> None:
        """Forget a staging region whose memory can no longer be trusted (shrunk)."""
        self._staging_held.pop(region_id, None)
        if region_id in self._staging_free:
            self._staging_free.remove(region_id)
        self._staging_ids.discard(region_id)
        if region_id in self.regions and not self._busy[region_id]:
            await self._drop_region(region_id, self.regions.get(region_id))

    async def _take_staging(self, nbytes: int, owner: str) -> RegionInfo:
        """A staging region of at least ``nbytes`` bytes, owned by ``owner`` (the
        principal of the lease it is packed for): a free one from the pool (its pages
        are already faulted in, here and in readers that mapped it), else a new one."""
        await self._reclaim_staging()
        fits = [
            r
            for r in self._staging_free
            if self.regions.get(r).nbytes >= nbytes and not self._busy[r]
        ]
        if fits:
            best = min(fits, key=lambda r: self.regions.get(r).nbytes)
            self._staging_free.remove(best)
            info = msgspec.structs.replace(self.regions.get(best), owner=owner)
            self.regions.remove(best)
            return self.regions.add(info)
        region = await self.create_region(RegionCreate(nbytes, owner=owner, label="staging"))
        self._staging_ids.add(region.region_id)
        return region

    async def _reclaim_staging(self) -> None:
        """Delete every held staging region whose lease was released or expired, so
        readers that never call release cannot grow the daemon's memory. Deleted, not
        reused: a reader whose lease ended may still be reading it (its pull fails,
        but the bytes it read land), and must never read what is packed there next.
        One that a pull of this daemon still reads waits for a later call."""
        for region_id, (lease_id, _) in list(self._staging_held.items()):
            if self.registry.is_live(lease_id) or self._busy[region_id]:
                continue
            del self._staging_held[region_id]
            self._staging_ids.discard(region_id)
            await self._drop_region(region_id, self.regions.get(region_id))

    async def release_staging(self, region_id: int, lease_id: str) -> None:
        """The reader under ``lease_id`` is done with staging region ``region_id``
        (``DELETE /v1/peer/staging/{id}?lease=``): it returns to the pool. Refused
        (403) when the region was packed for another lease: only the lease that
        packed it (or its end) frees it, so no reader's bytes are repacked under it.
        Releasing one already free is a no-op."""
        info = self.regions.get(region_id)
        if region_id not in self._staging_ids or not info.daemon_owned:
            raise ConflictError(
                f"region {region_id} refused as staging: it is not a staging region of this daemon"
            )
        held = self._staging_held.get(region_id)
        if held is None:
            return
        if held[0] != lease_id:
            raise AccessDenied(
                f"staging region {region_id} refused release: it was packed for another "
                f"lease than {lease_id!r}; only that lease's holder or its end frees it"
            )
        await self._free_staging(region_id)

    async def _free_staging(self, region_id: int) -> None:
        """Return a staging region to the pool; the pool keeps at most
        ``STAGING_POOL`` regions and deletes the rest."""
        self._staging_held.pop(region_id, None)
        if region_id in self._staging_free:
            return
        self._staging_free.append(region_id)
        while len(self._staging_free) > STAGING_POOL:
            gone = self._staging_free.pop(0)
            if self._busy[gone]:  # still read by a pull of this daemon: keep it
                self._staging_free.append(gone)
                break
            self._staging_ids.discard(gone)
            await self._drop_region(gone, self.regions.get(gone))

    # ------------------------------------------------------------ leases

    def lease_changed(self) -> None:
        """Wake every drain waiter (a lease was released or a version changed), and
        release exited clients' regions that this may have freed."""
        self._lease_changed.set()
        self._lease_changed = asyncio.Event()
        self.reap_soon()

    async def wait_drain(
        self, model: str, version: int, timeout_s: float, retire: bool = False
    ) -> VersionInfo:
        """Return once no live lease remains on the version (released or expired).

        With ``retire`` the version first stops accepting new leases (a publisher
        about to rewrite its memory must ask for that). Waits on release events and
        on the next expiry deadline, never by polling. :class:`ConflictError` if
        leases remain after ``timeout_s`` seconds.
        """
        self.registry.version(model, version)  # NotFound for an unknown version
        if retire:
            self.registry.retire(model, version)
        deadline = self.clock() + timeout_s
        while (nxt := self.registry.next_expiry(model, version)) is not None:
            left = deadline - self.clock()
            if left <= 0:
                n = len(self.registry.active_leases(model, version))
                raise ConflictError(
                    f"{model!r} version {version} still holds {n} lease(s) after {timeout_s}s"
                )
            event = self._lease_changed
            try:
                async with asyncio.timeout(min(nxt, left) + 1e-3):
                    await event.wait()
            except TimeoutError:
                pass  # an expiry deadline passed: re-read the lease set
        return self.registry.version(model, version)
