"""The routes of HTTP API v1, declared once, as data.

Each :class:`Route` is one operation: its method, its path template, the Struct its
request body decodes to, the type its response encodes and a one-line summary. The
three places that need the routes read them from here (as starlette's routing does):

- the daemon registers a handler per route (``refitd.daemon.app.httpio.handles``), and a
  test holds the app's routes and :data:`ROUTES` equal;
- the OpenAPI document (``refitd.daemon.app.openapi``) describes each route from its
  entry here;
- the client (``refitd.client.http``) calls a route by its constant, so a path is
  never spelled twice, and decodes the answer as the route's ``response``.

Path templates are the aiohttp ones (``{name}``); :meth:`Route.url` fills them in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

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

__all__ = ["FLAG", "JSON", "ROUTES", "Flag", "Route"]

JSON = "application/json"
#: the request content types of bodies that may be bulky (descriptor tables, manifests)
_BOTH = (JSON, MSGPACK)
_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")

#: A yes/no query parameter (``dry_run``, ``retire``): exactly these four spellings,
#: anything else is refused (400), so a typo never reads as "no".
Flag = Literal["0", "1", "false", "true"]
#: How the client spells a flag.
FLAG: dict[bool, Flag] = {False: "0", True: "1"}

T = TypeVar("T")


@dataclass(frozen=True)
class Route(Generic[T]):
    """One operation of the API.

    ``response`` is the type the answer decodes to (``type(None)``: no body);
    ``request`` the Struct the body decodes to (None: no body), in any of ``media``;
    ``status`` the status of success; ``query`` the query parameters and their types.
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
    query: Mapping[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> tuple[str, ...]:
        """The path parameters, in the order the template names them."""
        return tuple(_PARAM.findall(self.path))

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
GET_REGION = _r("GET", "/regions/{region_id}", RegionInfo, "One region", tag="regions")
DELETE_REGION = _r("DELETE", "/regions/{region_id}", RegionInfo, "Delete a region", tag="regions")
GC = _r(
    "POST",
    "/gc",
    GcReport,
    "Free exited clients' regions and stale segments (dry_run=1: list)",
    tag="regions",
    query={"dry_run": Flag},
)

# ---------------------------------------------------------------- sources
PUBLISH = _r(
    "POST",
    "/sources",
    VersionInfo,
    "Publish one slot's manifest",
    ManifestIn,
    201,
    _BOTH,
    tag="sources",
)
ALL_VERSIONS = _r("GET", "/sources", list[VersionInfo], "Every version", tag="sources")
MODEL_VERSIONS = _r(
    "GET", "/sources/{model}/versions", list[VersionInfo], "A model's versions", tag="sources"
)
GET_VERSION = _r("GET", _V, VersionInfo, "One version ('latest' = newest READY)", tag="sources")
MANIFEST = _r(
    "GET", _V + "/manifest", MergedManifest, "A READY version's merged manifest", tag="sources"
)
WAIT_READY = _r(
    "GET",
    _V + "/ready",
    VersionInfo,
    "Wait until a version is READY (or no longer pending); after 'timeout', its state now",
    tag="sources",
    query={"timeout": float},
)
DRAIN = _r(
    "POST",
    _V + "/drain",
    VersionInfo,
    "Wait until no lease holds the version (retire=1: retire it first)",
    tag="sources",
    query={"timeout": float, "retire": Flag},
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
    query={"model": str, "version": int},
)
RENEW_LEASE = _r(
    "POST",
    "/leases/{lease_id}/renew",
    LeaseInfo,
    "Renew a lease",
    tag="leases",
    query={"ttl": float},
)
RELEASE_LEASE = _r("DELETE", "/leases/{lease_id}", _NONE, "Release a lease", tag="leases")

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
GET_PULL = _r("GET", "/pulls/{pull_id}", PullProgress, "One pull's progress", tag="pulls")
WAIT_PULL = _r(
    "GET",
    "/pulls/{pull_id}/wait",
    PullProgress,
    "Wait for a pull to end (or timeout)",
    tag="pulls",
    query={"timeout": float},
)
CANCEL_PULL = _r("DELETE", "/pulls/{pull_id}", PullProgress, "Cancel a pull", tag="pulls")

# ---------------------------------------------------------------- deltas (docs/delta.md)
DELTA_INFO = _r(
    "GET",
    _V + "/delta",
    DeltaInfo,
    "A version's delta record: base version, digests, changed units, size",
    tag="deltas",
    query={"wait": float},
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
    query={"ids": str, "lease": str, "model": str, "version": int},
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
    query={"lease": str},
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
GET_POOL = _r("GET", _POOL, PoolInfo, "One expert pool", tag="experts")
POOL_STATS = _r(
    "GET", _POOL + "/stats", PoolStats, "One pool's counters (as in /metrics)", tag="experts"
)
DELETE_POOL = _r("DELETE", _POOL, PoolInfo, "Delete a pool and its regions", tag="experts")
ENSURE = _r(
    "POST",
    _POOL + "/ensure",
    EnsureResult,
    "Make routed experts resident; copy misses into slots",
    EnsureRequest,
    200,
    _BOTH,
    tag="experts",
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
)
CLUSTER_NEXT = _r(
    "GET",
    "/cluster/sources/{model}/next",
    ClusterVersion,
    "Wait for a complete version newer than 'after'",
    tag="cluster",
    query={"after": int, "timeout": float},
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
    query={"after": int, "timeout": float, "lease": str},
)
MIRROR_FEED = _r(
    "GET",
    "/mirrors/{model}/{version}/feed",
    MirrorFeed,
    "A mirror's complete chunks as they land: a stream of length-prefixed frames, each "
    "with records scoped to the lease",
    tag="mirrors",
    query={"lease": str},
    response_media=MSGPACK,
)
MIRROR_DIGESTS = _r(
    "GET",
    "/mirrors/{model}/{version}/digests",
    ChunkDigests,
    "The digest of each chunk of a version this daemon is the source of, under a lease on "
    "it: a mirror checks the chunks it read from another holder against them",
    tag="mirrors",
    query={"lease": str},
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
