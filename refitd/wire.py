"""The wire contract of HTTP API v1, declared once: schemas and the error map.

Every request and response body the daemon accepts or returns is a msgspec Struct
here. Handlers decode with these types (so validation is the decode), the client
encodes with them, and the OpenAPI document is generated from them. The daemon
(:mod:`refitd.daemon`) and the client (:mod:`refitd.client`) both import this
module and nothing of each other: it imports only :mod:`refitd.errors`.

Refusals travel as :class:`ErrorBody`; :data:`STATUS_OF` maps each
:class:`~refitd.errors.RefitError` branch to its one HTTP status (the daemon's
error middleware answers with it) and :data:`ERROR_OF_STATUS` maps a status back
to a class (the client raises it when a body names no known class).

Units: every ``*_offset``, ``nbytes`` and ``byte_offset`` is in **bytes**; every
``shape`` and tensor ``offset`` is in **elements** of the tensor's global shape.

Bulk descriptor payloads are not JSON lists of dicts: a :class:`DescriptorTable`
carries one little-endian int64 matrix of shape ``(n, 5)`` as raw bytes, sent inside
a msgpack body (``application/msgpack``).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import hashlib
import hmac
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Literal, Self

import msgspec
import numpy as np

from refitd.errors import (
    AccessDenied,
    AccessError,
    ConfigError,
    ConflictError,
    InsufficientStorage,
    NotFoundError,
    PlanError,
    ProtocolError,
    QuotaExceeded,
    RefitError,
    RequestTooLarge,
    TransportError,
    Unauthenticated,
)

if TYPE_CHECKING:
    from refitd.experts.cache import CacheStats
    from refitd.experts.slots import SlotStats

__all__ = [
    "API_PREFIX",
    "ERROR_OF_STATUS",
    "MAX_LEASE_TTL_S",
    "MAX_MANIFEST_TENSORS",
    "MAX_RANK",
    "MAX_TENSOR_SHARDS",
    "MSGPACK",
    "STATUS_OF",
    "ClusterVersion",
    "DaemonRecord",
    "DescriptorTable",
    "EnsureRequest",
    "EnsureResult",
    "ErrorBody",
    "ExpertRef",
    "GcReport",
    "InvalidateRequest",
    "InvalidateResult",
    "LeaseGrant",
    "LeaseRequest",
    "ManifestHead",
    "ManifestIn",
    "MergedManifest",
    "NodeInfo",
    "PackRequest",
    "PackSpec",
    "PeerRecord",
    "PeerRegions",
    "PoolCreate",
    "PoolInfo",
    "PoolStats",
    "PrefetchRequest",
    "PrefetchResult",
    "PullProgress",
    "PullRequest",
    "PullState",
    "RegionAttach",
    "RegionCreate",
    "RegionInfo",
    "RegionKind",
    "ShardEntry",
    "SourceRecord",
    "StagedPack",
    "TensorEntry",
    "VersionInfo",
    "VersionState",
    "gc_paused",
    "status_of",
]

API_PREFIX = "/v1"
MSGPACK = "application/msgpack"

# Every wire integer is bounded to int64: msgspec would otherwise accept any JSON
# integer (and msgpack up to 2**64 - 1), and an id, offset or size past int64 can
# neither be checked against numpy's int64 records nor encoded back in a reply.
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=INT64_MAX)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
HolderTag = Annotated[str, msgspec.Meta(max_length=48, pattern=r"^([0-9]{1,10}\.[0-9]{1,20})?$")]
#: free-text fields of a request (owner, label, holder): bounded, may be empty
Label = Annotated[str, msgspec.Meta(max_length=256)]
#: a tensor's name in a manifest (module paths of real models stay far below this)
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
DtypeName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
#: the most publisher slots one version may expect (one per trainer rank)
MAX_SLOTS = 65536
SlotCount = Annotated[int, msgspec.Meta(gt=0, le=MAX_SLOTS)]
Url = Annotated[str, msgspec.Meta(max_length=2048)]
#: the most dimensions a manifest's tensor may have (torch allows far fewer in practice)
MAX_RANK = 64
Shape = Annotated[tuple[Int64, ...], msgspec.Meta(max_length=MAX_RANK)]
#: the most shards one tensor may list in one manifest; a msgpack body past it is
#: refused from its array header, before any shard is decoded
MAX_TENSOR_SHARDS = 65536
#: the most tensors one manifest may list
MAX_MANIFEST_TENSORS = 1 << 20


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk decode or merge.

    A 100k-tensor manifest is ~500k small acyclic objects; with the default
    thresholds the collector runs thousands of passes over them while they are
    built, which costs more than the decoding itself.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class ErrorBody(msgspec.Struct, frozen=True):
    """Every refusal: ``error`` is the RefitError class name, ``detail`` says what and why."""

    error: str
    detail: str


class NodeInfo(msgspec.Struct, frozen=True):
    """Identity of one daemon. ``epoch`` changes on every start, so a peer can tell a
    restarted daemon (whose regions and keys are gone) from the one it knew.
    ``shm_huge_pages`` is the ``huge=`` mode of the tmpfs holding its segments
    (``transports.segments.huge_page_mode``): under ``never`` they get 4 KiB pages and
    same-host UCX pulls from them move about half as much per thread."""

    node_id: str
    epoch: int
    transport: str
    worker_info: dict[str, str] = {}
    version: str = "1"
    shm_huge_pages: str = ""
    #: ``transport/device`` pairs the daemon's UCX can use here (``ucx_info -d``),
    #: e.g. ``tcp/eth0``, ``rc_mlx5/mlx5_0:1``; empty without a UCX data plane.
    ucx_transports: list[str] = []
    #: per known peer (trusted URL, or node a pull read from): the data path a pull
    #: from it takes or would take, and why (``refitd status``)
    paths: dict[str, str] = {}


# ---------------------------------------------------------------- regions


class RegionKind(enum.StrEnum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


class RegionCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ask the daemon to create (own) a region of ``nbytes`` for a client."""

    nbytes: NonNeg
    kind: RegionKind = RegionKind.SHM
    owner: Label = ""
    label: Label = ""
    #: the client process the region lives with, as ``<pid>.<start time>``
    #: (``transports.segments.owner_tag``; "" for none): when that process exits the
    #: daemon releases the region. The client library sends its own.
    holder: HolderTag = ""


class RegionAttach(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ask the daemon to attach a region a client created: for ``shm`` ``handle`` is the
    segment name; for ``cuda_ipc`` it is the hex IPC handle (refused without a GPU)."""

    handle: Name
    nbytes: NonNeg
    kind: RegionKind = RegionKind.SHM
    owner: Label = ""
    label: Label = ""
    #: the client process the region lives with, as ``<pid>.<start time>``
    #: (``transports.segments.owner_tag``; "" for none): when that process exits the
    #: daemon releases the region. The client library sends its own.
    holder: HolderTag = ""


class RegionInfo(msgspec.Struct, frozen=True):
    """The daemon's record of a region: what every descriptor is checked against.

    ``region_id`` is unique within one daemon epoch and is also the id the region is
    registered under with the daemon's transport."""

    region_id: int
    kind: RegionKind
    handle: str
    nbytes: int
    epoch: int
    owner: str = ""
    label: str = ""
    daemon_owned: bool = False
    #: the client process whose exit releases this region (``<pid>.<start>``, "" none)
    holder: str = ""


class GcReport(msgspec.Struct, frozen=True):
    """What ``POST /v1/gc`` freed (or, with ``dry_run``, would free): regions whose
    holder process exited and that no version, lease or running pull still needs,
    and shared-memory segments of this user whose creator process is gone."""

    dry_run: bool
    regions: list[RegionInfo]
    segments: list[str]


# ---------------------------------------------------------------- sources


class ShardEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One block of a full tensor held in a region: ``offset``/``shape`` in elements of the
    global tensor, the block stored C-contiguous at ``byte_offset`` of ``region``."""

    offset: Shape
    shape: Shape
    region: Int64
    byte_offset: NonNeg


class TensorEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A full tensor by name: global shape, dtype (torch name, e.g. ``"bfloat16"``), shards."""

    name: TensorName
    shape: Shape
    dtype: DtypeName
    shards: Annotated[list[ShardEntry], msgspec.Meta(max_length=MAX_TENSOR_SHARDS)]


class ManifestIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one publisher slot publishes for ``(model, version)``.

    A version becomes READY once every slot in ``range(expected_slots)`` has published;
    every slot of one version must agree on ``expected_slots`` and on each tensor's
    global shape and dtype.
    """

    model: Name
    version: NonNeg
    slot: NonNeg
    expected_slots: SlotCount
    tensors: Annotated[list[TensorEntry], msgspec.Meta(max_length=MAX_MANIFEST_TENSORS)]


class ManifestHead(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """:class:`ManifestIn` with each tensor still encoded: the daemon decodes the
    tensors one at a time off its event loop, counting shards as it goes."""

    model: Name
    version: NonNeg
    slot: NonNeg
    expected_slots: SlotCount
    tensors: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_MANIFEST_TENSORS)]


class VersionState(enum.StrEnum):
    PENDING = "pending"
    READY = "ready"
    RETIRED = "retired"


class VersionInfo(msgspec.Struct, frozen=True):
    model: str
    version: int
    state: VersionState
    published_slots: list[int]
    expected_slots: int
    leases: int


class MergedManifest(msgspec.Struct, frozen=True):
    """A READY version's tensors, replicas removed (one shard per distinct block).

    ``node_id``/``epoch`` name the daemon holding every listed region, so a receiver's
    daemon knows whom to read from and can detect that daemon restarting.
    """

    model: str
    version: int
    node_id: str
    epoch: int
    tensors: list[TensorEntry]


# ---------------------------------------------------------------- leases


#: the longest lease (acquired or renewed) a daemon grants, in seconds
MAX_LEASE_TTL_S = 3600.0


class LeaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: Name
    version: NonNeg
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_TTL_S)] = 30.0
    holder: Label = ""


class LeaseGrant(msgspec.Struct, frozen=True):
    """A lease on one version; ``expires_in_s`` is relative to when the daemon answered."""

    lease_id: str
    model: str
    version: int
    expires_in_s: float


# ---------------------------------------------------------------- pulls


class DescriptorTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``n`` region-relative reads, packed.

    ``table`` is ``n * 5`` little-endian int64 values, row-major: ``(src_region,
    src_offset, dst_region, dst_offset, nbytes)``; region ids as the daemons recorded
    them, offsets and sizes in bytes.
    """

    table: bytes

    @staticmethod
    def pack(rows: np.ndarray) -> DescriptorTable:
        arr = np.ascontiguousarray(rows, dtype="<i8").reshape(-1, 5)
        return DescriptorTable(arr.tobytes())

    def rows(self) -> np.ndarray:
        """The ``(n, 5)`` int64 matrix; refuses a payload that is not whole rows."""
        if len(self.table) % 40:
            raise ProtocolError(
                f"descriptor table of {len(self.table)} bytes is not a whole number of "
                "40-byte rows (5 little-endian int64 each)"
            )
        return np.frombuffer(self.table, dtype="<i8").reshape(-1, 5)

    def __len__(self) -> int:
        return len(self.table) // 40


class PackSpec(msgspec.Struct, frozen=True, array_like=True):
    """A strided block the *source* daemon packs contiguous into staging, then the
    destination reads in one descriptor landing at ``dst_offset`` of ``dst_region``.

    ``src_offset`` is the byte offset of the first element; ``shape`` in elements,
    ``strides`` in **elements**; ``itemsize`` in bytes.
    """

    src_region: Int64
    src_offset: NonNeg
    shape: tuple[Int64, ...]
    strides: tuple[Int64, ...]
    itemsize: Positive
    dst_region: Int64
    dst_offset: NonNeg

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Move bytes into this daemon's regions from ``source`` (a peer daemon's base URL,
    or ``""`` for this daemon itself), reading version ``version`` of ``model`` under
    ``lease_id`` (held at the source). Nothing moves until every descriptor and pack
    spec has been checked against both daemons' region records."""

    model: Name
    version: NonNeg
    lease_id: Name
    descriptors: DescriptorTable
    pack_specs: list[PackSpec] = []
    source: Url = ""


class PullState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PullProgress(msgspec.Struct, frozen=True):
    """Progress or result of a pull. ``suspect`` lists ``(dst_region, dst_offset, nbytes)``
    ranges that may hold partial bytes after a failure or cancel. ``path`` is how the
    bytes move: ``shm`` (copied through shared memory: the source is this daemon, or
    a daemon proven to be on this host) or the transport's scheme (``ucx``)."""

    pull_id: str
    state: PullState
    bytes_total: int
    bytes_done: int
    descriptors_total: int
    descriptors_done: int
    seconds: float
    rate_gbps: float
    error: ErrorBody | None = None
    suspect: list[tuple[int, int, int]] = []
    path: str = ""


# ---------------------------------------------------------------- peers


class PeerRecord(msgspec.Struct, frozen=True):
    """What one daemon tells another about a region it may read: only ever exchanged
    daemon to daemon. ``transport_key`` is the transport's advertised (packed) record,
    opaque here; for the shared-memory path it is the segment name."""

    node_id: str
    epoch: int
    region: RegionInfo
    transport_key: bytes = b""


Health = Literal["ok"]


# ---------------------------------------------------------------- expert pools

PoolName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]
HostResidencyName = Literal["pinned", "locked", "pageable"]


class PoolCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Create an MoE expert slot pool hosted by the daemon.

    ``row_bytes`` is one expert's row per bank (gate, up, down by convention), in
    bytes. ``residency`` gives each layer's host residency (empty: every layer
    pinned); a layer that is not pinned must be listed in ``cpu_layers``, since its
    experts can only be computed on the CPU. ``slots`` must be at least ``experts``.
    """

    name: PoolName
    layers: Positive
    experts: Positive
    slots: Positive
    row_bytes: list[Positive]
    residency: list[HostResidencyName] = []
    cpu_layers: list[NonNeg] = []
    owner: Label = ""


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A pool and where its bytes live (all offsets and sizes in bytes).

    Host rows, region ``host_region``: bank ``b``'s rows start at
    ``host_bank_offsets[b]``, layer-major, so row ``(layer, expert)`` of bank ``b``
    is at ``host_bank_offsets[b] + (layer * experts + expert) * row_bytes[b]``.
    Slot memory, region ``slot_region``: slot ``s`` of bank ``b`` is at
    ``slot_bank_offsets[b] + s * row_bytes[b]``. A refit writes new expert rows into
    the host region (a pull, or the trainer's own mapping followed by ``invalidate``).
    """

    name: str
    layers: int
    experts: int
    slots: int
    row_bytes: list[int]
    residency: list[HostResidencyName]
    cpu_layers: list[int]
    host_region: int
    slot_region: int
    host_bank_offsets: list[int]
    slot_bank_offsets: list[int]
    owner: str = ""
    occupied_slots: int = 0
    #: ensure calls applied, and those that moved nothing
    plans: int = 0
    warm_plans: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    #: bytes copied from host rows into slots since creation
    copied_bytes: int = 0
    #: slots dropped because a refit rewrote (or a caller invalidated) their expert
    stale_invalidations: int = 0
    #: bytes copied by prefetches (also in ``copied_bytes``), and prefetched experts
    #: a step used / that left unused
    prefetched_bytes: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    #: slots whose prefetch copy has not been seen to land yet
    in_flight_slots: int = 0


class EnsureRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Make ``routed`` experts (layer-local ids, duplicates allowed) of ``layer`` resident."""

    layer: NonNeg
    routed: list[NonNeg]


class EnsureResult(msgspec.Struct, frozen=True, kw_only=True):
    """Where each routed expert lives now (``slots[i]`` for ``routed[i]``), and what moved.

    ``copied_slots[i]`` received expert ``copied_experts[i]`` of the layer in this
    call; ``copied_bytes`` is the bytes copied from host rows (0 on a warm step).
    """

    layer: int
    slots: list[int]
    active: int
    missing: int
    fetched: int
    copied_slots: list[int] = []
    copied_experts: list[int] = []
    copied_bytes: int = 0
    warm: bool = False
    #: slots the step uses whose prefetch copy it waited for (never copied again)
    waited: int = 0


class PrefetchRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A prediction of ``layer``'s next step: ``experts`` (layer-local ids, most
    confident first) or ``scores`` (one per expert of the layer, e.g. the layer's
    router applied to the current hidden state; highest first, ``min_score`` skips
    the rest), never both. At most ``budget`` copies (``None``: one per prediction)."""

    layer: NonNeg
    experts: list[NonNeg] = []
    scores: list[float] = []
    budget: NonNeg | None = None
    min_score: float | None = None


class PrefetchResult(msgspec.Struct, frozen=True, kw_only=True):
    """Copies issued in the background: ``copied_slots[i]`` is receiving expert
    ``copied_experts[i]``; the next ``ensure`` naming them waits for them to land.
    ``resident`` predicted experts were already there (now kept for the layer's
    step); ``skipped`` were neither copied nor resident (budget, ``min_score``, or
    no slot a prefetch may take)."""

    layer: int
    copied_slots: list[int] = []
    copied_experts: list[int] = []
    copied_bytes: int = 0
    resident: int = 0
    skipped: int = 0


class ExpertRef(msgspec.Struct, frozen=True, array_like=True):
    """One expert of one layer, both zero-based; on the wire ``[layer, expert]``."""

    layer: NonNeg
    expert: NonNeg


class InvalidateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Drop the slots holding these experts (a refit rewrote their rows); ``layers``
    drops every expert of the listed layers. The next ``ensure`` fetches them again."""

    experts: list[ExpertRef] = []
    layers: list[NonNeg] = []


class InvalidateResult(msgspec.Struct, frozen=True):
    """Slots dropped, and the experts they held."""

    slots: list[int]
    experts: list[ExpertRef]


# ---------------------------------------------------------------- cluster registry


class _Signed(msgspec.Struct, frozen=True):
    """A record MAC'd with the deployment secret: HMAC-SHA256 over its msgpack
    encoding with ``mac`` empty. A subclass declares ``mac: bytes = b""`` as its
    last field and names itself in a refusal through ``_what``."""

    if TYPE_CHECKING:  # a field of each subclass (it must come last)

        @property
        def mac(self) -> bytes: ...

    def _what(self) -> str:
        raise NotImplementedError

    def _digest(self, secret: bytes) -> bytes:
        body = msgspec.msgpack.encode(msgspec.structs.replace(self, mac=b""))
        return hmac.new(secret, body, hashlib.sha256).digest()

    def signed(self, secret: bytes) -> Self:
        """This record with its ``mac`` set for ``secret``."""
        return msgspec.structs.replace(self, mac=self._digest(secret))

    def verify(self, secret: bytes) -> None:
        """Refuse (:class:`ProtocolError`) a record whose ``mac`` is not this one's
        for ``secret``: tampered with, or signed outside this deployment."""
        if not hmac.compare_digest(self._digest(secret), self.mac):
            raise ProtocolError(
                f"{self._what()} refused: MAC does not verify (tampered, or a daemon "
                "outside this deployment)"
            )


class DaemonRecord(_Signed, frozen=True):
    """One daemon as registered in the cluster registry (etcd), MAC'd with the
    deployment secret: only a record that verifies makes its ``url`` a trusted peer.
    ``epoch`` changes with every start of the daemon."""

    node_id: Name
    url: str
    epoch: int
    transport: str
    boot_id: str = ""
    mac: bytes = b""

    def _what(self) -> str:
        return f"registry record of {self.node_id!r}"


class SourceRecord(_Signed, frozen=True):
    """The publisher slots of one version that one daemon holds, as published to the
    cluster registry (MAC'd like :class:`DaemonRecord`)."""

    node_id: Name
    url: str
    epoch: int
    model: Name
    version: NonNeg
    state: VersionState
    slots: list[NonNeg]
    expected_slots: Positive
    mac: bytes = b""

    def _what(self) -> str:
        return f"registry record of {self.model!r} v{self.version} from {self.node_id!r}"


class ClusterVersion(msgspec.Struct, frozen=True):
    """Where a version lives across hosts: every daemon holding slots of it.
    ``complete`` when the holders' READY slots together cover ``range(expected_slots)``."""

    model: str
    version: int
    expected_slots: int
    complete: bool
    holders: list[SourceRecord]


# ---------------------------------------------------------------- daemon to daemon


class PeerRegions(_Signed, frozen=True):
    """Region records one daemon sends another, MAC'd with the deployment secret.

    ``transport`` is the sender's data-plane mode and ``advert`` its transport's own
    signed advertisement (empty when it runs no transport, i.e. ``shm``).
    ``boot_id`` is the sender's kernel boot id and ``files`` maps each listed region
    to ``(st_dev, st_ino)`` of its segment: a reader uses the shared-memory path only
    when its own boot id matches and the file it maps by name is that very file."""

    node_id: str
    epoch: int
    transport: str
    regions: list[RegionInfo]
    advert: bytes = b""
    boot_id: str = ""
    files: dict[int, tuple[int, int]] = {}
    #: the lease these records were given under ("" for none), and per listed region
    #: the byte ranges ``[start, end)`` that lease may read: a reader reads nothing else
    lease_id: str = ""
    scope: dict[int, list[tuple[int, int]]] = {}
    #: every data plane the sender serves, by scheme: its signed advertisement
    #: (``advert`` is the first of them), so the reader picks the path
    adverts: dict[str, bytes] = {}
    mac: bytes = b""

    def _what(self) -> str:
        return f"region records from {self.node_id!r}"


class StagedPack(msgspec.Struct, frozen=True):
    """Pack specs executed by a source daemon: the staging region and, per spec, the
    byte offset of its packed bytes inside it."""

    region: RegionInfo
    offsets: list[int]


class PackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: Name
    version: NonNeg
    lease_id: Name
    specs: list[PackSpec]


# ---------------------------------------------------------------- metrics


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """One expert slot pool, as the daemon's pool reports it. Counters are totals
    since the pool was created; ``copied_bytes`` in bytes."""

    pool: str
    layers: int
    slots: int
    occupied_slots: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    copied_bytes: int = 0
    #: Slots dropped because a refit rewrote the expert they held.
    stale_invalidations: int = 0

    @classmethod
    def from_pool(
        cls,
        pool: str,
        *,
        layers: int,
        slots: int,
        occupied_slots: int,
        cache: CacheStats,
        executor: SlotStats,
        stale_invalidations: int = 0,
    ) -> PoolStats:
        """Bridge from :mod:`refitd.experts`: the planner's :class:`CacheStats` (hits,
        misses, evictions) and the executor's :class:`SlotStats` (bytes copied into
        slots, from host rows and from other slots)."""
        return cls(
            pool=pool,
            layers=layers,
            slots=slots,
            occupied_slots=occupied_slots,
            hits=cache.hits,
            misses=cache.misses,
            evictions=cache.evictions,
            copied_bytes=executor.host_bytes + executor.device_bytes,
            stale_invalidations=stale_invalidations,
        )


# ---------------------------------------------------------------- errors

# Most specific first: the first isinstance match wins.
STATUS_OF: list[tuple[type[RefitError], int]] = [
    (RequestTooLarge, 413),
    (ProtocolError, 400),
    (Unauthenticated, 401),
    (AccessError, 403),
    (NotFoundError, 404),
    (ConflictError, 409),
    (PlanError, 422),
    (QuotaExceeded, 429),
    (InsufficientStorage, 507),
    (TransportError, 502),
    (ConfigError, 500),
    (RefitError, 500),
]


def status_of(exc: RefitError) -> int:
    """The HTTP status a refusal is answered with: the first match in ``STATUS_OF``."""
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return 500


#: Status code back to the error class, for a refusal whose body names no class.
ERROR_OF_STATUS: dict[int, type[RefitError]] = {
    400: ProtocolError,
    401: Unauthenticated,
    403: AccessDenied,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLarge,
    422: PlanError,
    429: QuotaExceeded,
    500: RefitError,
    502: TransportError,
    503: TransportError,
    507: InsufficientStorage,
}
