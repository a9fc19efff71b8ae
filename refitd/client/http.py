"""The async HTTP client of refitd's API v1: :class:`RefitClient`.

One method per endpoint, typed with the daemon's own schemas. Bodies travel as
msgpack. A refusal comes back as the same :class:`refitd.errors.RefitError`
subclass the daemon raised, carrying its ``detail`` message, so a caller catches
the same exception in-process or over HTTP. Transport failures (connection refused,
reset) become :class:`TransportError` raised ``from`` aiohttp's exception.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

from refitd.client.session import ApiSession, error_from_body
from refitd.errors import RefitError
from refitd.wire import (
    ClusterVersion,
    DaemonRecord,
    DeltaInfo,
    DeltaPackRequest,
    DeltaStaged,
    EnsureRequest,
    EnsureResult,
    ExpertRef,
    GcReport,
    HostResidencyName,
    InvalidateRequest,
    InvalidateResult,
    LeaseInfo,
    LeaseRequest,
    ManifestIn,
    MemoryKind,
    MergedManifest,
    NodeInfo,
    PackSpec,
    PeerRegions,
    PoolCreate,
    PoolInfo,
    PoolStats,
    PrefetchRequest,
    PrefetchResult,
    PullProgress,
    PullRequest,
    PullState,
    RegionAttach,
    RegionCreate,
    RegionInfo,
    StagedPack,
    VersionInfo,
)
from refitd.wire import routes as api
from transports.segments import owner_tag

__all__ = ["RefitClient", "error_from_body"]

T = TypeVar("T")

_TERMINAL = {PullState.DONE, PullState.FAILED, PullState.CANCELLED}


def _this_process() -> str:
    """This process as the one a region lives with (``<pid>.<start>``, a ``ProcessTag``;
    sent as the request's ``process``), or "" where /proc cannot say."""
    tag = owner_tag()
    return tag if tag.replace(".", "").isdigit() else ""


class RefitClient(ApiSession):
    """Talks to one daemon: ``base_url`` over TCP, or ``unix_path`` (then ``base_url``
    only supplies the host header). Use as ``async with RefitClient(url) as c``.
    Its calls go through :meth:`ApiSession.send` (one session, one error map)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:7450",
        *,
        unix_path: str | None = None,
        token: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(base_url, unix_path=unix_path, token=token, timeout_s=timeout_s)
        #: True when requests carry a bearer token: the daemon then records the token's
        #: name as the owner of what this client creates, whatever owner it asks for.
        self.authenticated = bool(token)

    async def __aenter__(self) -> Self:
        self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ node

    async def node(self) -> NodeInfo:
        return await self.send(api.NODE)

    async def health(self) -> dict[str, str]:
        return await self.send(api.HEALTH)

    async def ready(self) -> dict[str, str]:
        """Raises :class:`TransportError` (503) until the data plane is up."""
        return await self.send(api.READY)

    # ------------------------------------------------------------ regions

    async def create_region(
        self, nbytes: int, *, label: str = "", owner: str = "", kind: MemoryKind = MemoryKind.HOST
    ) -> RegionInfo:
        """A daemon-owned region, released by the daemon when this process exits."""
        req = RegionCreate(nbytes, kind, owner, label, process=_this_process())
        return await self.send(api.CREATE_REGION, req)

    async def attach_region(
        self,
        handle: str,
        nbytes: int,
        *,
        label: str = "",
        owner: str = "",
        kind: MemoryKind = MemoryKind.HOST,
    ) -> RegionInfo:
        """Attach this process's segment; the daemon releases it when this process exits."""
        req = RegionAttach(handle, nbytes, kind, owner, label, process=_this_process())
        return await self.send(api.ATTACH_REGION, req)

    async def regions(self) -> list[RegionInfo]:
        return await self.send(api.LIST_REGIONS)

    async def delete_region(self, region_id: int) -> RegionInfo:
        return await self.send(api.DELETE_REGION, region_id=region_id)

    async def gc(self, *, dry_run: bool = False) -> GcReport:
        """Free regions of exited clients and stale segments (``dry_run``: only list them)."""
        return await self.send(api.GC, params={"dry_run": dry_run})

    # ------------------------------------------------------------ sources

    async def publish(self, manifest: ManifestIn) -> VersionInfo:
        return await self.send(api.PUBLISH, manifest)

    async def all_versions(self) -> list[VersionInfo]:
        """Every version of every model this daemon holds."""
        return await self.send(api.ALL_VERSIONS)

    async def versions(self, model: str) -> list[VersionInfo]:
        return await self.send(api.MODEL_VERSIONS, model=model)

    async def version(self, model: str, version: int | str = "latest") -> VersionInfo:
        return await self.send(api.GET_VERSION, model=model, version=version)

    async def manifest(self, model: str, version: int) -> MergedManifest:
        return await self.send(api.MANIFEST, model=model, version=version)

    async def delta_info(self, model: str, version: int, wait_s: float = 0.0) -> DeltaInfo:
        """``version``'s delta record (docs/delta.md), after up to ``wait_s`` seconds
        for a comparison still running."""
        return await self.send(
            api.DELTA_INFO, params={"wait": wait_s}, model=model, version=version
        )

    async def delta_pack(self, req: DeltaPackRequest) -> DeltaStaged:
        """Stage the changed units of a planned pull against the base ``req`` states."""
        return await self.send(api.DELTA_PACK, req)

    # ------------------------------------------------------------ cluster registry

    async def cluster_daemons(self) -> list[DaemonRecord]:
        """The daemons registered in this daemon's cluster registry (its trusted peers)."""
        return await self.send(api.CLUSTER_DAEMONS)

    async def cluster_version(self, model: str, version: int | str = "latest") -> ClusterVersion:
        """Which daemons hold ``model`` at ``version`` across hosts (``latest``: the
        newest version whose parts are all published somewhere)."""
        return await self.send(api.CLUSTER_VERSION, model=model, version=version)

    async def next_version(
        self, model: str, after: int = -1, timeout_s: float = 30.0
    ) -> ClusterVersion:
        """Wait (one request; the daemon is woken by the registry's watch) for a complete
        version of ``model`` newer than ``after``; NotFoundError after ``timeout_s``."""
        return await self.send(
            api.CLUSTER_NEXT, params={"after": after, "timeout": timeout_s}, model=model
        )

    async def wait_ready(self, model: str, version: int, timeout_s: float = 30.0) -> VersionInfo:
        """Wait (one request, answered when the daemon takes the last part) until the
        version is READY; after ``timeout_s`` (at most a minute per request) its state
        then, still PENDING. NotFoundError when no part of it was published by then."""
        return await self.send(
            api.WAIT_READY, params={"timeout": timeout_s}, model=model, version=version
        )

    async def wait_drain(
        self, model: str, version: int, timeout_s: float = 60.0, *, retire: bool = False
    ) -> VersionInfo:
        """Return once no lease remains on the version; ConflictError after the timeout.
        ``retire`` first stops the version accepting new leases (before a rewrite)."""
        return await self.send(
            api.DRAIN,
            params={"timeout": timeout_s, "retire": retire},
            model=model,
            version=version,
        )

    # ------------------------------------------------------------ leases

    async def acquire_lease(
        self,
        model: str,
        version: int,
        ttl_s: float = 30.0,
        label: str = "",
        *,
        manifest: bool = False,
    ) -> LeaseInfo:
        """Lease ``model`` ``version``: the grant carries the daemon's signed records of
        what the lease reads (a pull from that daemon presents them as ``grant``), and
        with ``manifest`` the version's merged manifest."""
        req = LeaseRequest(model, version, ttl_s, label, manifest=manifest)
        return await self.send(api.ACQUIRE_LEASE, req)

    async def renew_lease(self, lease_id: str, ttl_s: float = 30.0) -> LeaseInfo:
        return await self.send(api.RENEW_LEASE, params={"ttl": ttl_s}, lease_id=lease_id)

    async def release_lease(self, lease_id: str) -> None:
        await self.send(api.RELEASE_LEASE, lease_id=lease_id)

    async def check_lease(self, lease_id: str, model: str, version: int) -> LeaseInfo:
        """ConflictError unless ``lease_id`` is live on exactly ``(model, version)``."""
        return await self.send(
            api.CHECK_LEASE, params={"model": model, "version": version}, lease_id=lease_id
        )

    # ------------------------------------------------------------ pulls

    async def submit_pull(self, req: PullRequest) -> PullProgress:
        """Validate and start a pull; refusals (400/404/409) raise before any byte moves."""
        return await self.send(api.SUBMIT_PULL, req)

    async def pull_status(self, pull_id: str) -> PullProgress:
        return await self.send(api.GET_PULL, pull_id=pull_id)

    async def pulls(self) -> list[PullProgress]:
        return await self.send(api.LIST_PULLS)

    async def cancel_pull(self, pull_id: str) -> PullProgress:
        return await self.send(api.CANCEL_PULL, pull_id=pull_id)

    async def wait_pull(
        self,
        pull_id: str,
        *,
        on_progress: Callable[[PullProgress], None] | None = None,
        interval_s: float | None = None,
    ) -> PullProgress:
        """Wait for a pull to end, one long poll at a time (the daemon answers the
        moment it ends); ``on_progress`` sees a snapshot at least every ``interval_s``
        (default 0.25 s with ``on_progress``, else 30 s: nothing to report between).
        Raises the pull's error if it failed or was cancelled."""
        if interval_s is None:
            interval_s = 0.25 if on_progress is not None else 30.0
        while True:
            p = await self.send(api.WAIT_PULL, params={"timeout": interval_s}, pull_id=pull_id)
            if on_progress is not None:
                on_progress(p)
            if p.state in _TERMINAL:
                break
        if p.state is not PullState.DONE:
            err = error_from_body(500, p.error, f"pull {pull_id} {p.state.value}")
            err.progress = p  # type: ignore[attr-defined]
            raise err
        return p

    async def pull(
        self, req: PullRequest, *, on_progress: Callable[[PullProgress], None] | None = None
    ) -> PullProgress:
        """Submit and wait; returns the result or raises what refused or failed it. A
        wait that ends before the pull did (cancelled: a refit interrupted; or
        ``on_progress`` raised, the connection broke) cancels the pull at the daemon
        first, which answers once it ended: a pull nobody waits for any more must not
        write the caller's memory later, after its next refit made it live."""
        started = await self.submit_pull(req)
        try:
            return await self.wait_pull(started.pull_id, on_progress=on_progress)
        except BaseException as exc:
            if getattr(exc, "progress", None) is None:  # not the pull's own end
                with contextlib.suppress(RefitError):  # ended already, or the daemon gone
                    await asyncio.shield(self.cancel_pull(started.pull_id))
            raise

    # ------------------------------------------------------------ expert pools

    async def create_pool(
        self,
        name: str,
        *,
        layers: int,
        experts: int,
        slots: int,
        row_bytes: list[int],
        residency: list[HostResidencyName] | None = None,
        cpu_layers: list[int] | None = None,
        owner: str = "",
    ) -> PoolInfo:
        """Create an expert slot pool; the answer names its host and slot regions and
        their byte layouts. ``row_bytes`` is one expert's row per bank, in bytes."""
        spec = PoolCreate(
            name=name,
            layers=layers,
            experts=experts,
            slots=slots,
            row_bytes=row_bytes,
            residency=residency or [],
            cpu_layers=cpu_layers or [],
            owner=owner,
        )
        return await self.send(api.CREATE_POOL, spec)

    async def pools(self) -> list[PoolInfo]:
        return await self.send(api.LIST_POOLS)

    async def pool(self, name: str) -> PoolInfo:
        return await self.send(api.GET_POOL, pool=name)

    async def pool_stats(self, name: str) -> PoolStats:
        return await self.send(api.POOL_STATS, pool=name)

    async def delete_pool(self, name: str) -> PoolInfo:
        """Delete the pool and both of its regions."""
        return await self.send(api.DELETE_POOL, pool=name)

    async def ensure(self, name: str, layer: int, routed: list[int]) -> EnsureResult:
        """Make ``routed`` experts of ``layer`` resident in the pool's slots; a plan
        the executor refuses raises :class:`PlanError` and leaves the pool consistent."""
        return await self.send(api.ENSURE, EnsureRequest(layer, routed), pool=name)

    async def prefetch(
        self,
        name: str,
        layer: int,
        experts: list[int] | None = None,
        *,
        scores: list[float] | None = None,
        budget: int | None = None,
        min_score: float | None = None,
    ) -> PrefetchResult:
        """Prefetch the experts predicted for ``layer``'s next step: ids, most confident
        first, or one score per expert (``min_score`` skips low ones); at most
        ``budget`` copies. The copies land in the background; the next ``ensure``
        naming them waits for them instead of copying again."""
        req = PrefetchRequest(
            layer=layer,
            experts=experts or [],
            scores=scores or [],
            budget=budget,
            min_score=min_score,
        )
        return await self.send(api.PREFETCH, req, pool=name)

    async def invalidate(
        self,
        name: str,
        experts: list[tuple[int, int]] | None = None,
        *,
        layers: list[int] | None = None,
    ) -> InvalidateResult:
        """Drop the slots holding ``experts`` (``(layer, expert)`` pairs) or every expert
        of ``layers``, after their host rows were rewritten."""
        refs = [ExpertRef(layer, e) for layer, e in experts or []]
        return await self.send(api.INVALIDATE, InvalidateRequest(refs, layers or []), pool=name)

    # ------------------------------------------------------------ daemon to daemon

    async def peer_regions(
        self,
        ids: list[int] | None = None,
        lease_id: str = "",
        model: str = "",
        version: int = 0,
    ) -> PeerRegions:
        """Signed region records; under ``lease_id`` (on ``model`` ``version``) only the
        regions that lease may read, each with the byte ranges it may read."""
        params: dict[str, str | int] = {}
        if ids is not None:
            params["ids"] = ",".join(str(i) for i in ids)
        if lease_id:
            params.update(lease=lease_id, model=model, version=version)
        return await self.send(api.PEER_REGIONS, params=params or None)

    async def peer_pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        return await self.send(
            api.PEER_PACK,
            {"model": model, "version": version, "lease_id": lease_id, "specs": specs},
        )

    async def peer_drop(self, region_id: int, lease_id: str) -> None:
        """Release staging region ``region_id``, packed for ``lease_id``."""
        await self.send(api.PEER_DROP, params={"lease": lease_id}, region_id=region_id)
