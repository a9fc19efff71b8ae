"""One daemon's life: identity, the data planes, start and stop, peer records.

:class:`Daemon` is what the HTTP handlers call. It composes the parts that each
hold one idea: the region store (:mod:`refitd.daemon.state.store`: regions, their
segments keyed by memory, pins, reaping), the staging pool
(:mod:`refitd.daemon.state.staging`: source-side packing for a lease), lease drains
(:mod:`refitd.daemon.state.drain`), the version registry (:mod:`refitd.daemon.state.registry`),
the data planes (:mod:`refitd.daemon.state.plane`) and which bytes of the host mirrors
still filling are complete (:mod:`refitd.daemon.mirror.hold`). What is left here is what
crosses them: the rules a region's deletion or publication must pass. What a lease
reads (the signed region records a peer daemon reads, packs), a lease's life and a
version's drain are its part ``leases`` (:mod:`refitd.daemon.app.leasing`), built with
the owners it uses. A publish and a drain are told to the daemon's version listeners
(``events``, :mod:`refitd.daemon.state.events`), which the app adds as it is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec

from refitd.cluster import registry_from_config
from refitd.config import Config, LimitsConfig
from refitd.daemon.access.auth import Principal
from refitd.daemon.access.caps import Caps
from refitd.daemon.access.owners import ModelOwners
from refitd.daemon.access.peers import PeerPolicy
from refitd.daemon.app.leasing import Leases
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.daemon.pull.paths import AUTO, peer_paths, probes_ucx
from refitd.daemon.state.drain import LeaseDrain
from refitd.daemon.state.events import VersionEvents
from refitd.daemon.state.plane import TransportSet
from refitd.daemon.state.registry import Registry, check_manifest_bounds
from refitd.daemon.state.staging import STAGING_POOL, StagingPool
from refitd.daemon.state.store import RegionStore
from refitd.errors import AccessDenied, ConflictError, QuotaExceeded, RefitError, TransportError
from refitd.wire import (
    GcReport,
    ManifestIn,
    MergedManifest,
    NodeInfo,
    RegionAttach,
    RegionCreate,
    RegionInfo,
    VersionInfo,
)
from refitd.wire.mirrors import HolderJoin
from transports.local import Copier
from transports.pins import PINS
from transports.segments import cleanup_stale, huge_page_mode
from transports.shm import ShmTransport
from transports.shm import boot_id as host_boot_id

__all__ = [
    "AUTO",
    "STAGING_POOL",
    "Daemon",
]

log = logging.getLogger("refitd.daemon")

MANIFEST_CHECKS = 2
"""Published manifests decoded and checked at once; more wait their turn."""


class Daemon:
    """One daemon, run as ``config`` says (the defaults without one), with what no
    configuration file holds: ``secret`` (≥ 16 bytes; a random one when None)
    authenticates peer records between the daemons of one deployment; ``boot_id``
    empty means this kernel's, another value makes the daemon claim another host
    (tests of the cross-host choice on one machine). ``clock`` and ``copier`` are
    the registry's clock and the same-host copy engine (tests inject their own).

    ``config.data_plane.transport`` is the data-plane mode: ``"auto"`` (per source
    peer the same-host shared-memory path when the peer is proven to be on this host
    with attachable segments, else UCX where both ends have RDMA, else ``tcp``; see
    :mod:`refitd.daemon.pull.paths`), ``"shm"`` (only the shared-memory path; a peer on
    another host is refused) or a scheme of ``transports.interface``."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        secret: bytes | None = None,
        boot_id: str = "",
        clock: Callable[[], float] = time.monotonic,
        copier: Copier | None = None,
    ) -> None:
        self.config = config = config if config is not None else Config()
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        #: the data-plane mode (``[data_plane] transport``)
        self.mode = config.data_plane.transport
        self.node_id = config.server.node_id or f"{socket.gethostname()}-{os.getpid()}"
        self.incarnation = time.time_ns()
        self.clock = clock
        self.limits: LimitsConfig = config.limits
        # The host memory locked for GPU copies is the process's (transports.pins).
        PINS.limit(config.data_plane.max_pinned_bytes)
        #: the cluster registry (``[registry]``): which daemons exist, and where each
        #: version's parts live; the app starts and closes it
        self.cluster = registry_from_config(config.registry, self.secret)
        self.registry = Registry(
            self.node_id,
            self.incarnation,
            clock,
            pending_ttl_s=self.limits.pending_ttl_s,
            # A trainer split over hosts: each daemon holds some parts of a version.
            complete_elsewhere=self._complete_elsewhere if self.cluster.kind == "etcd" else None,
        )
        #: the timer that expires pending versions (:meth:`_expire_pending_later`)
        self._pending_timer: asyncio.TimerHandle | None = None
        #: published manifests being decoded and checked now (off the event loop), and
        #: how many may be at once (the others wait before their body is read)
        self.manifests_checking = 0
        self.manifest_checks = asyncio.Semaphore(MANIFEST_CHECKS)
        #: per-principal caps on leases, regions and pulls (``[limits]``): the region
        #: store and the staging pool admit regions and bytes, :meth:`Leases.acquire` leases
        self.caps = Caps(
            self.limits.max_leases_per_principal,
            self.limits.max_regions_per_principal,
            self.limits.max_pulls_per_principal,
            self.limits.max_region_bytes_per_principal,
        )
        #: the one decision which source URLs may be contacted (config, then registry)
        self.peers = PeerPolicy(config.peers.allow)
        #: per peer node, the path the last pull from it took and why
        self.seen_paths: dict[str, tuple[str, str]] = {}
        self.boot_id = boot_id or host_boot_id()
        #: the data planes: the same-host one in every mode (``copier``: its copy
        #: engine), and the transports :meth:`start` brings up
        self.plane = TransportSet(
            ShmTransport(
                secret=self.secret,
                peer_id=self.node_id,
                copier=copier,
                boot_id=self.boot_id,
                incarnation=self.incarnation,
            )
        )
        self.store = RegionStore(self.incarnation, self.plane, self.registry, self.caps)
        self.staging = StagingPool(self.store, self.registry, self.plane.shm)
        # A lease's end or a version's change wakes the drains and the store's reaper.
        self.drain = LeaseDrain(self.registry, clock, self.store.reap_soon)
        self.ready = False
        self.ucx_transports: list[str] = []  # what the loaded UCX can use (ucx_info -d)
        self._ucx_probed = False  # whether ucx_transports is ucx_info's answer yet
        self._ucx_probe = asyncio.Lock()  # held while ucx_info runs
        #: who owns each model, and who may read it (``[models]``)
        self.models = ModelOwners(config.models.owners, config.models.readers)
        #: stale segments of earlier lives (this daemon's or its clients') removed at start
        self.removed_at_start: list[str] = []
        #: which bytes of the host mirrors still filling are complete
        #: (:mod:`refitd.daemon.mirror.hold`): the mirrors are built with it and change
        #: it, the data plane holds reads on it, and a lease reads of such a mirror only
        #: its complete chunks (:meth:`Leases.version_scope`)
        self.filling = FillingMirrors()
        #: who hears of a published part, a drain and a retired version
        #: (:mod:`refitd.daemon.state.events`): the app adds its parts once, as it is built
        self.events = VersionEvents()
        #: the leases: what each reads here, and their life (:mod:`refitd.daemon.app.leasing`)
        self.leases = Leases(
            secret=self.secret,
            node_id=self.node_id,
            incarnation=self.incarnation,
            mode=self.mode,
            registry=self.registry,
            store=self.store,
            staging=self.staging,
            plane=self.plane,
            drain=self.drain,
            caps=self.caps,
            models=self.models,
            filling=self.filling,
            events=self.events,
            clock=clock,
            max_plan_runs=self.limits.max_plan_runs,
        )

    def _complete_elsewhere(self, model: str, version: int) -> bool:
        """Whether the cluster registry says ``model`` ``version`` has all its parts
        published across the daemons that hold it, this one among them."""
        return self.cluster.complete(model, version, self.node_id)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bring up the data plane; the daemon reports ready only after this.

        Every mode but ``shm`` starts a transport (``auto`` starts UCX where it offers
        RDMA); a transport that cannot start stops the daemon's start with
        :class:`TransportError`. UCX is asked what it can use (:meth:`probe_ucx`) only
        where it may start: ``auto`` on a host with an RDMA device (first: the answer
        decides), and ``ucx`` (while UCX starts, which it does not decide).
        First, shared-memory segments whose creator process is gone — left by an
        earlier life of this daemon, or by clients that crashed — are unlinked."""
        self.removed_at_start = await asyncio.to_thread(cleanup_stale)
        if self.removed_at_start:
            log.info("removed %d stale segment(s) at start", len(self.removed_at_start))
        await self.plane.shm.start()
        mode = self.mode
        from refitd.daemon.pull.paths import rdma_devices, transport_schemes

        if mode == AUTO and rdma_devices():
            await self.probe_ucx()  # its answer decides whether UCX starts
        # ``ucx`` starts UCX whatever ucx_info says: ask it while UCX starts.
        forced = probes_ucx(mode) and mode != AUTO
        probing = asyncio.create_task(self.probe_ucx()) if forced else None
        try:
            await self._start_transports(transport_schemes(mode, self.ucx_transports))
            if probing is not None:
                await probing
        finally:
            if probing is not None and not probing.done():
                probing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probing
        self.ready = True

    async def _start_transports(self, schemes: list[str]) -> None:
        """Start each transport of ``schemes`` and add it to the data plane, in order."""
        from refitd.daemon.pull.paths import transport_options
        from transports.interface import create_transport

        for scheme in schemes:
            c = self.config
            options = transport_options(
                scheme,
                secret=self.secret,
                node_id=self.node_id,
                pull_timeout_s=c.data_plane.pull_timeout_s,
                lanes=c.data_plane.lanes,
                host=c.server.host,
                tcp_port=c.data_plane.tcp_port,
                advertise_url=c.registry.advertise_url,
                trusted=self.peers.trusted,
                is_live=self.registry.is_live,
                incarnation=self.incarnation,
            )
            t = create_transport(scheme, options)
            try:
                await t.start()
            except RefitError as exc:
                auto = self.mode == AUTO
                hint = " (--transport shm runs without it, same host only)" if auto else ""
                raise TransportError(
                    f"data plane {scheme!r} did not start, so the daemon will not report "
                    f"ready: {exc}{hint}"
                ) from exc
            self.plane.add(scheme, t)

    async def probe_ucx(self) -> list[str]:
        """What this host's UCX can use (``ucx_info -d``, about 0.4 s), asked once, in
        the modes that may run UCX (``auto``, ``ucx``): at start where UCX may start,
        else when ``/v1/node`` first asks. Empty in other modes."""
        if not probes_ucx(self.mode):
            return []
        async with self._ucx_probe:  # a second asker waits for the first one's answer
            if not self._ucx_probed:
                from transports.ucx.info import ucx_transports

                self.ucx_transports = await ucx_transports()
                self._ucx_probed = True
        return self.ucx_transports

    async def close(self) -> None:
        self.ready = False
        if self._pending_timer is not None:
            self._pending_timer.cancel()
            self._pending_timer = None
        self.store.processes.close()
        await self.plane.close()
        self.store.close()

    async def info(self) -> NodeInfo:
        """``GET /v1/node``: this daemon, its data planes and the path to each peer;
        UCX is asked what it can use (:meth:`probe_ucx`) here unless the start did."""
        await self.probe_ucx()
        worker: dict[str, str] = {}
        if self.plane.primary is not None:
            advert = self.plane.primary.advertise()
            worker = {"scheme": advert.scheme, "peer_id": advert.peer_id}
        return NodeInfo(
            self.node_id,
            self.incarnation,
            self.mode,
            worker,
            shm_huge_pages=huge_page_mode(),
            ucx_transports=self.ucx_transports,
            paths=peer_paths(
                self.mode,
                {s: t.capabilities for s, t in self.plane.by_scheme.items()},
                self.peers.trusted(),
                self.seen_paths,
            ),
        )

    # ------------------------------------------------------------ regions

    async def create_region(self, req: RegionCreate, principal: Principal) -> RegionInfo:
        """A new daemon-owned segment of exactly ``req.nbytes`` bytes (≥ 1), owned as
        :meth:`Principal.owner_of` decides (403 for asking for another's) and within
        ``principal``'s caps (:meth:`RegionStore.create_region`)."""
        req = msgspec.structs.replace(req, owner=principal.owner_of(req.owner))
        return await self.store.create_region(req, principal.name)

    async def attach_region(self, req: RegionAttach, principal: Principal) -> RegionInfo:
        """Map memory ``principal`` made (:meth:`RegionStore.attach_region`), owned as
        :meth:`Principal.owner_of` decides; a uid the kernel named (the Unix socket,
        not root) attaches only its own files."""
        req = msgspec.structs.replace(req, owner=principal.owner_of(req.owner))
        uid = principal.uid if principal.via == "unix" and not principal.admin else None
        return await self.store.attach_region(req, uid, principal.via, principal.name)

    async def delete_region(self, region_id: int, principal: Principal) -> RegionInfo:
        """Forget a region for ``principal`` (``DELETE /v1/regions/{id}``). Refused
        (403) for a region of another principal, (409) for an expert pool's region
        (it goes with its pool), (409) while a READY, pending or leased version
        publishes from it (a retired version included, while leased), while a running
        pull of this daemon reads or writes it (its mapping is never unmapped under a
        copy), and (403) for a staging region, which only the daemon itself frees."""
        owner = self.store.regions.get(region_id).owner
        principal.check_owns(owner, "delete", f"region {region_id}")
        if (pool := self.store.pool_regions.get(region_id)) is not None:
            raise ConflictError(
                f"region {region_id} refused deletion: expert pool {pool!r} holds it; "
                "delete the pool instead"
            )
        if region_id in self.staging:
            raise AccessDenied(
                f"region {region_id} refused deletion: it is a staging region of this "
                "daemon, freed by the lease that packed it or when that lease ends"
            )
        return await self.store.delete(region_id)

    def view(self, region_id: int) -> memoryview:
        return self.store.view(region_id)

    def regions(self, who: Principal) -> list[RegionInfo]:
        """Every region, each as ``who`` sees it (:meth:`Principal.seen_region`)."""
        return [who.seen_region(r) for r in self.store.regions]

    def region(self, who: Principal, region_id: int) -> RegionInfo:
        """Region ``region_id`` as ``who`` sees it (404 when unknown)."""
        return who.seen_region(self.store.regions.get(region_id))

    async def gc(self, who: Principal, dry_run: bool = False) -> GcReport:
        """``POST /v1/gc``: free exited clients' regions and stale segments, the
        regions reported as ``who`` sees them."""
        report = await self.store.gc(dry_run)
        return msgspec.structs.replace(report, regions=[who.seen_region(r) for r in report.regions])

    def check_publishable(self, region_ids: Iterable[int]) -> None:
        """Refuse (:class:`ConflictError`, 409, naming what holds it) publishing a
        version from a region whose bytes something other than its publisher changes:
        a staging region (the daemon repacks it for other leases), an expert pool's
        region (``ensure`` rewrites its slots, pulls its host rows), or a region a
        running pull writes (its bytes would change after the version is READY)."""
        for rid in sorted(set(region_ids)):
            why = ""
            if rid in self.staging:
                why = "it is a staging region of this daemon, which repacks it for other leases"
            elif rid in self.store.pool_regions:
                why = (
                    f"it is a region of expert pool {self.store.pool_regions[rid]!r}, whose ensure "
                    "and pulls rewrite it"
                )
            elif writers := self.store.writers(rid):
                why = (
                    f"running pull(s) {', '.join(writers)} write it; wait for them to end or "
                    "cancel them"
                )
            if why:
                raise ConflictError(
                    f"publishing from region {rid} refused: {why}; a version's bytes never "
                    "change once published"
                )

    async def publish(
        self, read: Callable[[int], Awaitable[ManifestIn]], principal: Principal
    ) -> VersionInfo:
        """Publish one part's manifest for ``principal``; ``read(max_shards)`` decodes
        it from the request (refused past ``limits.max_manifest_shards`` shards).

        The steps, in order: the manifest is read and checked against the regions'
        bounds off the event loop, a few at a time (each holds its body and decoded
        objects, hundreds of MB at the limits, and a worker thread); the model must be
        the principal's to publish into, and every region it publishes from the
        principal's (403: else it would expose another principal's bytes to its
        leases, and pin them against their writes), and none rewritten by anything
        else (409, :meth:`check_publishable`); the registry takes the part, charged to
        its publisher while the daemon holds it; the principal becomes the model's
        owner if nobody was; drain waiters wake; the version listeners hear of it
        (:meth:`VersionEvents.published`: the delta book, the cluster registry)."""
        # At its cap already: refused before its body is read or decoded.
        cap = self.limits.max_manifest_bytes_per_principal
        held = self.registry.manifest_bytes(principal.name)
        if held >= cap:
            raise QuotaExceeded(
                f"publishing refused: {principal.name}'s manifests hold {held} bytes of the "
                f"daemon's memory, its cap (limits.max_manifest_bytes_per_principal = {cap}); "
                "retire versions nobody reads (drain with retire=1) or let pending ones expire"
            )
        async with self.manifest_checks:
            self.manifests_checking += 1
            try:
                m = await read(self.limits.max_manifest_shards)
                await asyncio.to_thread(check_manifest_bounds, m, self.store.regions.sizes())
            finally:
                self.manifests_checking -= 1
        # After the awaits: what is checked from here on runs without a break.
        self.models.check_owner(principal, m.model, "publish into")
        region_ids = sorted({s.region for t in m.tensors for s in t.shards})
        for rid in region_ids:
            principal.check_owns(self.store.regions.get(rid).owner, "publish from", f"region {rid}")
        self.check_publishable(region_ids)
        # Charged to its publisher while the daemon holds it (pending, READY, or
        # retired while leased), in bytes of the daemon's memory.
        self.models.admit(principal, self.limits.max_models_per_principal, m.model)
        info = self.registry.publish(m, principal.name, cap)
        self._expire_pending_later()
        self.models.claim(principal, m.model)
        self.leases.changed()
        await self.events.published(info)
        return info

    def _expire_pending_later(self) -> None:
        """Set the one timer that forgets pending versions at their TTL (its manifests'
        memory with them), whether or not anything else happens on the daemon: at the
        oldest pending version's deadline, then at each next one's."""
        if self._pending_timer is not None:
            return
        left = self.registry.next_pending_s()
        if left is None:
            return

        def fire() -> None:
            self._pending_timer = None
            if self.registry.expire_pending():
                self.store.reap_soon()  # an exited client's regions it pinned may go
                self.leases.changed()
            self._expire_pending_later()

        # A little past the deadline: the registry's clock, not the loop's, decides.
        self._pending_timer = asyncio.get_running_loop().call_later(left + 0.01, fire)

    # ------------------------------------------------------------ versions

    def versions(self, who: Principal, model: str | None = None) -> list[VersionInfo]:
        """The versions ``who`` may read: of every model it reads, or of ``model``
        (403 for one it may not read)."""
        if model is None:
            return [v for v in self.registry.versions() if self.models.may_read(who, v.model)]
        self.models.check_read(who, model, "list the versions of")
        return self.registry.versions(model)

    def version(self, who: Principal, model: str, version: int | None) -> VersionInfo:
        """The state of the version ``who`` reads (:meth:`Leases.readable`; 404 when
        unknown)."""
        return self.registry.version(model, self.leases.readable(who, model, version))

    def manifest(self, who: Principal, model: str, version: int | None) -> MergedManifest:
        """The READY manifest of the version ``who`` reads (:meth:`Leases.readable`)."""
        return self.registry.merged(model, self.leases.readable(who, model, version))

    def manifest_bytes(self, who: Principal, model: str, version: int | None) -> bytes:
        """:meth:`manifest` as msgpack, encoded once per version."""
        return self.registry.merged_bytes(model, self.leases.readable(who, model, version))

    def check_holder_join(self, join: HolderJoin) -> None:
        """Admit a peer daemon's join to the holder book of a version here: the join
        must be signed with the deployment secret (403), name a version this daemon
        holds (404), and come from a daemon this one trusts (403): the book hands its
        URL to readers."""
        join.verify(self.secret)
        self.registry.version(join.model, join.version)
        self.peers.check(join.url)
