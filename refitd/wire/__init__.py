"""The wire contract of HTTP API v1, declared once: schemas and the error map.

Every request and response body the daemon accepts or returns is a msgspec Struct
here. Handlers decode with these types (so validation is the decode), the client
encodes with them, and the OpenAPI document is generated from them. The daemon
(:mod:`refitd.daemon`) and the client (:mod:`refitd.client`) both import this
package and nothing of each other: it imports only :mod:`refitd.errors`,
:mod:`refitd.signing` and :mod:`refitd.memory_kinds`.

One module per idea, every public name re-exported here (``from refitd.wire import
PullRequest``):

- :mod:`~refitd.wire.fields`: bounded field types, body limits, the content type;
- :mod:`~refitd.wire.status`: :class:`ErrorBody` and the error <-> HTTP status map;
- :mod:`~refitd.wire.regions`: a daemon's identity and its regions (a region's kind
  is :class:`~refitd.memory_kinds.MemoryKind`, re-exported here);
- :mod:`~refitd.wire.versions`: manifests and versions;
- :mod:`~refitd.wire.leases`: leases on a version;
- :mod:`~refitd.wire.pulls`: pulls, their descriptors and pack specs;
- :mod:`~refitd.wire.pools`: MoE expert slot pools;
- :mod:`~refitd.wire.records`: the records daemons sign for each other;
- :mod:`~refitd.wire.mirrors`: host mirrors and relay, daemon to daemon;
- :mod:`~refitd.wire.digests`: a version's chunk digests, as its source computed them;
- :mod:`~refitd.wire.deltas`: delta records and staged deltas (delta refit);
- :mod:`~refitd.wire.args`: each route's path and query parameters, declared once as
  a Struct (type, default, bounds), and how they are read from text;
- :mod:`~refitd.wire.routes`: the route table: every operation's method, path,
  parameters and bodies, from which the daemon's routes, the OpenAPI document and
  the client's paths are built.

The route table and the parameters are imported as modules (``from refitd.wire import
routes as api``), not re-exported here.

Units: every ``*_offset``, ``nbytes`` and ``byte_offset`` is in **bytes**; every
``shape`` and tensor ``offset`` is in **elements** of the tensor's global shape.
"""

from __future__ import annotations

from refitd.memory_kinds import MemoryKind
from refitd.wire.deltas import (
    CHUNK_BYTES,
    DeltaChunk,
    DeltaInfo,
    DeltaPackRequest,
    DeltaStaged,
    DeltaState,
    DeltaStreamHead,
    DeltaStreamRequest,
)
from refitd.wire.digests import ChunkDigests
from refitd.wire.fields import (
    API_PREFIX,
    MAX_MANIFEST_TENSORS,
    MAX_PARTS,
    MAX_RANK,
    MAX_TENSOR_SHARDS,
    MSGPACK,
    gc_paused,
)
from refitd.wire.leases import (
    MAX_LEASE_TTL_S,
    LeaseInfo,
    LeaseRequest,
)
from refitd.wire.mirrors import HolderAssign, HolderJoin, MirrorState
from refitd.wire.pools import (
    EnsureRequest,
    EnsureResult,
    ExpertRef,
    HostResidencyName,
    InvalidateRequest,
    InvalidateResult,
    PoolCreate,
    PoolInfo,
    PoolStats,
    PrefetchRequest,
    PrefetchResult,
)
from refitd.wire.pulls import (
    DescriptorTable,
    PackRequest,
    PackSpec,
    PullProgress,
    PullRequest,
    PullState,
    StagedPack,
)
from refitd.wire.records import (
    ClusterVersion,
    DaemonRecord,
    PeerRegions,
    SourceRecord,
)
from refitd.wire.regions import (
    GcReport,
    NodeInfo,
    RegionAttach,
    RegionCreate,
    RegionInfo,
)
from refitd.wire.status import (
    ERROR_OF_STATUS,
    STATUS_OF,
    ErrorBody,
    status_of,
)
from refitd.wire.versions import (
    DTYPE_SIZES,
    ManifestHead,
    ManifestIn,
    MergedManifest,
    ShardEntry,
    TensorEntry,
    VersionInfo,
    VersionState,
)

__all__ = [
    "API_PREFIX",
    "CHUNK_BYTES",
    "DTYPE_SIZES",
    "ERROR_OF_STATUS",
    "MAX_LEASE_TTL_S",
    "MAX_MANIFEST_TENSORS",
    "MAX_PARTS",
    "MAX_RANK",
    "MAX_TENSOR_SHARDS",
    "MSGPACK",
    "STATUS_OF",
    "ChunkDigests",
    "ClusterVersion",
    "DaemonRecord",
    "DeltaChunk",
    "DeltaInfo",
    "DeltaPackRequest",
    "DeltaStaged",
    "DeltaState",
    "DeltaStreamHead",
    "DeltaStreamRequest",
    "DescriptorTable",
    "EnsureRequest",
    "EnsureResult",
    "ErrorBody",
    "ExpertRef",
    "GcReport",
    "HolderAssign",
    "HolderJoin",
    "HostResidencyName",
    "InvalidateRequest",
    "InvalidateResult",
    "LeaseInfo",
    "LeaseRequest",
    "ManifestHead",
    "ManifestIn",
    "MemoryKind",
    "MergedManifest",
    "MirrorState",
    "NodeInfo",
    "PackRequest",
    "PackSpec",
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
    "ShardEntry",
    "SourceRecord",
    "StagedPack",
    "TensorEntry",
    "VersionInfo",
    "VersionState",
    "gc_paused",
    "status_of",
]
