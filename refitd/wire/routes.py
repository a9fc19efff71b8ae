"""The routes of HTTP API v1, declared once, as data.

Each :class:`Route` is one operation: its method, its path template, the Struct its
path and query parameters decode to (``args``, :mod:`refitd.wire.args`: each
parameter's type, default and bounds), the Struct its request body decodes to, the
type its response encodes and a one-line summary. The three places that need the
routes read them from here (as starlette's routing does):

- the daemon registers a handler per route (``refitd.daemon.app.httpio.RouteTable``),
  which gets the route's ``args`` decoded, and a test holds the app's routes and
  :data:`ROUTES` equal;
- the OpenAPI document (``refitd.daemon.app.openapi``) describes each route, its
  parameters included, from its entry here;
- the client (``refitd.client.http``) calls a route by its constant, so a path is
  never spelled twice, sends only the query parameters its ``args`` declare, and
  decodes the answer as the route's ``response``.

Path templates are the aiohttp ones (``{name}``); :meth:`Route.url` fills them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from refitd.wire import args as a
from refitd.wire.deltas import (
    DeltaInfo,
    DeltaPackRequest,
    DeltaStaged,
    DeltaStreamHead,
    DeltaStreamRequest,
)
from refitd.wire.digests import ChunkDigests
from refitd.wire.fields import API_PREFIX, MSGPACK
from refitd.wire.leases import LeaseInfo, LeaseRequest
from refitd.wire.mirrors import HolderAssign, HolderJoin, MirrorFeed, MirrorLease, MirrorState
from refitd.wire.pools import (
    EnsureRequest,
    EnsureResult,
    InvalidateRequest,
    InvalidateResult,
    PoolCreate,
    PoolInfo,
    PoolStats,
    PrefetchRequest,
    PrefetchResult,
)
from refitd.wire.pulls import PackRequest, PullProgress, PullRequest, StagedPack
from refitd.wire.records import ClusterVersion, DaemonRecord, PeerRegions
from refitd.wire.regions import GcReport, NodeInfo, RegionAttach, RegionCreate, RegionInfo
from refitd.wire.versions import ManifestIn, MergedManifest, VersionInfo

__all__ = ["JSON", "ROUTES", "Route"]

JSON = "application/json"
#: the request content types of bodies that may be bulky (descriptor tables, manifests)
_BOTH = (JSON, MSGPACK)
_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")

T = TypeVar("T")


@dataclass(frozen=True)
class Route(Generic[T]):
    """One operation of the API.

    ``response`` is the type the answer decodes to (``type(None)``: no body);
    ``request`` the Struct the body decodes to (None: no body), in any of ``media``;
    ``status`` the status of success; ``args`` the Struct its path and query
    parameters decode to (None: it has none), a field for each path parameter.
    """

    method: str
    path: str
    response: type[T]
    summary: str
    request: Any = None
    status: int = 200
    media: tuple[str, ...] = (JSON,)
    response_media: str = JSON
    tag: str = ""
    args: type[a.Args] | None = None

    def __post_init__(self) -> None:
        fields = () if self.args is None else self.args.__struct_fields__
        missing = [p for p in self.params if p not in fields]
        if missing:
            raise TypeError(f"{self.method} {self.path}: its args declare no {missing}")

    @property
    def params(self) -> tuple[str, ...]:
        """The path parameters, in the order the template names them."""
        return tuple(_PARAM.findall(self.path))

    @property
    def query(self) -> tuple[str, ...]:
        """The query parameters: the fields of ``args`` the path does not name."""
        fields = () if self.args is None else self.args.__struct_fields__
        return tuple(f for f in fields if f not in self.params)

    def url(self, **params: object) -> str:
        """The path with every parameter filled in (as ``str(value)``, unquoted, as
        every refitd name is URL-safe); refuses a missing or unknown one."""
        if set(params) != set(self.params):
            raise TypeError(f"{self.method} {self.path} takes {self.params}, got {sorted(params)}")
        return _PARAM.sub(lambda m: str(params[m.group(1)]), self.path)


def _r(
    method: str,
    path: str,
    response: type[T],
    summary: str,
    request: Any = None,
    status: int = 200,
    media: tuple[str, ...] = (JSON,),
    **extra: Any,
) -> Route[T]:
    return Route(method, API_PREFIX + path, response, summary, request, status, media, **extra)


_NONE = type(None)
_V = "/sources/{model}/versions/{version}"

# ---------------------------------------------------------------- node
HEALTH = _r("GET", "/health", dict[str, str], "Liveness", tag="node")
READY = _r("GET", "/ready", dict[str, str], "Readiness: the data plane is up", tag="node")
NODE = _r("GET", "/node", NodeInfo, "This daemon's identity", tag="node")

# ---------------------------------------------------------------- regions
CREATE_REGION = _r(
    "POST",
    "/regions",
    RegionInfo,
    "Create a daemon-owned region",
    RegionCreate,
    201,
    _BOTH,
    tag="regions",
)
ATTACH_REGION = _r(
    "POST",
    "/regions/attach",
    RegionInfo,
    "Attach a client's region",
    RegionAttach,
    201,
    _BOTH,
    tag="regions",
)
LIST_REGIONS = _r("GET", "/regions", list[RegionInfo], "List regions", tag="regions")
_REGION = "/regions/{region_id}"
GET_REGION = _r("GET", _REGION, RegionInfo, "One region", tag="regions", args=a.RegionAt)
DELETE_REGION = _r("DELETE", _REGION, RegionInfo, "Delete a region", tag="regions", args=a.RegionAt)
GC = _r(
    "POST",
    "/gc",
    GcReport,
    "Free exited clients' regions and stale segments (dry_run=1: list)",
    tag="regions",
    args=a.GcArgs,
)

# ---------------------------------------------------------------- sources
PUBLISH = _r(
    "POST",
    "/sources",
    VersionInfo,
    "Publish one part's manifest",
    ManifestIn,
    201,
    _BOTH,
    tag="sources",
)
ALL_VERSIONS = _r("GET", "/sources", list[VersionInfo], "Every version", tag="sources")
MODEL_VERSIONS = _r(
    "GET",
    "/sources/{model}/versions",
    list[VersionInfo],
    "A model's versions",
    tag="sources",
    args=a.ModelAt,
)
GET_VERSION = _r(
    "GET", _V, VersionInfo, "One version ('latest' = newest READY)", tag="sources", args=a.VersionAt
)
MANIFEST = _r(
    "GET",
    _V + "/manifest",
    MergedManifest,
    "A READY version's merged manifest",
    tag="sources",
    args=a.VersionAt,
)
WAIT_READY = _r(
    "GET",
    _V + "/ready",
    VersionInfo,
    "Wait until a version is READY (or no longer pending); after 'timeout', its state now",
    tag="sources",
    args=a.WaitReadyArgs,
)
DRAIN = _r(
    "POST",
    _V + "/drain",
    VersionInfo,
    "Wait until no lease holds the version (retire=1: retire it first)",
    tag="sources",
    args=a.DrainArgs,
)

# ---------------------------------------------------------------- leases
ACQUIRE_LEASE = _r(
    "POST",
    "/leases",
    LeaseInfo,
    "Lease a READY version",
    LeaseRequest,
    201,
    _BOTH,
    tag="leases",
)
CHECK_LEASE = _r(
    "GET",
    "/leases/{lease_id}",
    LeaseInfo,
    "Check a lease",
    tag="leases",
    args=a.LeaseCheckArgs,
)
RENEW_LEASE = _r(
    "POST",
    "/leases/{lease_id}/renew",
    LeaseInfo,
    "Renew a lease",
    tag="leases",
    args=a.RenewArgs,
)
RELEASE_LEASE = _r(
    "DELETE", "/leases/{lease_id}", _NONE, "Release a lease", tag="leases", args=a.LeaseAt
)

# ---------------------------------------------------------------- pulls
SUBMIT_PULL = _r(
    "POST",
    "/pulls",
    PullProgress,
    "Validate and start a pull",
    PullRequest,
    202,
    _BOTH,
    tag="pulls",
)
LIST_PULLS = _r("GET", "/pulls", list[PullProgress], "Every pull", tag="pulls")
_PULL = "/pulls/{pull_id}"
GET_PULL = _r("GET", _PULL, PullProgress, "One pull's progress", tag="pulls", args=a.PullAt)
WAIT_PULL = _r(
    "GET",
    _PULL + "/wait",
    PullProgress,
    "Wait for a pull to end (or timeout)",
    tag="pulls",
    args=a.PullWaitArgs,
)
CANCEL_PULL = _r("DELETE", _PULL, PullProgress, "Cancel a pull", tag="pulls", args=a.PullAt)

# ---------------------------------------------------------------- deltas (docs/delta.md)
DELTA_INFO = _r(
    "GET",
    _V + "/delta",
    DeltaInfo,
    "A version's delta record: base version, digests, changed units, size",
    tag="deltas",
    args=a.DeltaInfoArgs,
)
DELTA_PACK = _r(
    "POST",
    "/deltas/pack",
    DeltaStaged,
    "Stage the changed units of a planned pull against a checked base",
    DeltaPackRequest,
    201,
    _BOTH,
    tag="deltas",
)
DELTA_STREAM = _r(
    "POST",
    "/deltas/stream",
    DeltaStreamHead,
    "The changed units of a planned pull against a checked base, streamed chunk by "
    "chunk as they are encoded: length-prefixed msgpack frames, each chunk's payload "
    "after its frame",
    DeltaStreamRequest,
    200,
    _BOTH,
    tag="deltas",
    response_media=MSGPACK,
)

# ---------------------------------------------------------------- daemon to daemon
PEER_REGIONS = _r(
    "GET",
    "/peer/regions",
    PeerRegions,
    "Signed region records for a peer daemon (under a lease: what it may read)",
    tag="peer",
    args=a.PeerRegionsArgs,
)
PEER_PACK = _r(
    "POST",
    "/peer/pack",
    StagedPack,
    "Pack strided blocks into staging",
    PackRequest,
    201,
    _BOTH,
    tag="peer",
)
PEER_DROP = _r(
    "DELETE",
    "/peer/staging/{region_id}",
    _NONE,
    "Drop a staging region",
    tag="peer",
    args=a.PeerDropArgs,
)

# ---------------------------------------------------------------- expert pools
_POOL = "/experts/{pool}"
CREATE_POOL = _r(
    "POST",
    "/experts",
    PoolInfo,
    "Create an expert slot pool",
    PoolCreate,
    201,
    _BOTH,
    tag="experts",
)
LIST_POOLS = _r("GET", "/experts", list[PoolInfo], "List expert pools", tag="experts")
GET_POOL = _r("GET", _POOL, PoolInfo, "One expert pool", tag="experts", args=a.PoolAt)
POOL_STATS = _r(
    "GET",
    _POOL + "/stats",
    PoolStats,
    "One pool's counters (as in /metrics)",
    tag="experts",
    args=a.PoolAt,
)
DELETE_POOL = _r(
    "DELETE", _POOL, PoolInfo, "Delete a pool and its regions", tag="experts", args=a.PoolAt
)
ENSURE = _r(
    "POST",
    _POOL + "/ensure",
    EnsureResult,
    "Make routed experts resident; copy misses into slots",
    EnsureRequest,
    200,
    _BOTH,
    tag="experts",
    args=a.PoolAt,
)
PREFETCH = _r(
    "POST",
    _POOL + "/prefetch",
    PrefetchResult,
    "Prefetch experts predicted for a layer's next step (copies land in the background)",
    PrefetchRequest,
    200,
    _BOTH,
    tag="experts",
    args=a.PoolAt,
)
INVALIDATE = _r(
    "POST",
    _POOL + "/invalidate",
    InvalidateResult,
    "Drop slots of experts whose rows were rewritten",
    InvalidateRequest,
    200,
    _BOTH,
    tag="experts",
    args=a.PoolAt,
)

# ---------------------------------------------------------------- cluster registry
CLUSTER_DAEMONS = _r(
    "GET",
    "/cluster/daemons",
    list[DaemonRecord],
    "Daemons registered in the cluster registry (the trusted peers)",
    tag="cluster",
)
CLUSTER_VERSION = _r(
    "GET",
    "/cluster" + _V,
    ClusterVersion,
    "Which daemons hold a version ('latest' = newest complete)",
    tag="cluster",
    args=a.VersionAt,
)
CLUSTER_NEXT = _r(
    "GET",
    "/cluster/sources/{model}/next",
    ClusterVersion,
    "Wait for a complete version newer than 'after'",
    tag="cluster",
    args=a.ClusterNextArgs,
)

# ---------------------------------------------------------------- host mirrors and relay
MIRROR_HOLDERS = _r(
    "POST",
    "/mirrors/holders",
    HolderAssign,
    "A mirror joins the holder pipeline of a version this daemon is the source of",
    HolderJoin,
    200,
    _BOTH,
    tag="mirrors",
)
MIRROR_STATE = _r(
    "GET",
    "/mirrors/{model}/{version}",
    MirrorState,
    "A mirror's progress (waits for more than 'after' complete chunks)",
    tag="mirrors",
    args=a.MirrorStateArgs,
)
MIRROR_FEED = _r(
    "GET",
    "/mirrors/{model}/{version}/feed",
    MirrorFeed,
    "A mirror's complete chunks as they land: a stream of length-prefixed frames, each "
    "with records scoped to the lease",
    tag="mirrors",
    args=a.MirrorReadArgs,
    response_media=MSGPACK,
)
MIRROR_DIGESTS = _r(
    "GET",
    "/mirrors/{model}/{version}/digests",
    ChunkDigests,
    "The digest of each chunk of a version this daemon is the source of, under a lease on "
    "it: a mirror checks the chunks it read from another holder against them",
    tag="mirrors",
    args=a.MirrorReadArgs,
)
MIRROR_LEASE = _r(
    "POST",
    "/mirrors/leases",
    LeaseInfo,
    "A peer daemon leases a mirrored version under its lease at the source",
    MirrorLease,
    201,
    _BOTH,
    tag="mirrors",
)

# ---------------------------------------------------------------- meta
OPENAPI = _r("GET", "/openapi.json", _NONE, "This OpenAPI 3.1 document", tag="meta")
#: outside ``/v1``: Prometheus scrapes ``/metrics`` by default
METRICS = Route(
    "GET", "/metrics", _NONE, "Prometheus metrics", response_media="text/plain", tag="meta"
)

#: Every route the daemon serves, in the order of the document above.
ROUTES: tuple[Route[Any], ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Route)
)
