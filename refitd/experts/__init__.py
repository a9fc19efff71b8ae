"""MoE expert residency, pure: the cache (planner), eviction policies, host residency,
the slot executor, and routing traces.

No I/O happens here except ``tracefile.read_trace_file``, the one function that reads a
recorded routing trace. The daemon hosts these pools; the decode hot path can run the
same classes in-process.

Modules:

- `cache`: the expert cache: which experts sit in a bounded pool, what to copy
- `plans`: its value types: experts, plans, counters
- `policy`: eviction policies: who leaves the pool on a miss
- `reuse`: `ExpectedReusePolicy`: evict the expert used furthest ahead
- `density`: `HitDensityPolicy`: evict the least expected hits per slot
- `lookahead`: predictions, and the slots they hold
- `prediction`: synthetic routing predictions of a chosen recall
- `oracle`: an oracle policy told the true routing probabilities
- `bound`: model-knowing oracles that bound an online policy
- `residency`: host residency of each layer's expert rows
- `slots`: the slot executor: apply the cache's plans to a pool of slots
- `device`: where slot bytes live: pool geometry, `SlotDevice`, the host device
- `cuda`: expert slots in GPU memory: the CUDA `SlotDevice`
- `inflight`: asynchronous slot copies: fences and the copier thread
- `flights`: the executor's slots in flight: the plan each waits on, landed on its fence
- `faults`: the slot executor's refusals and failures, one class per case
- `traces`: routing traces: which experts each token routes to, and the generator
- `tracefile`: recorded routing traces: the JSON-lines format, parsed and read
"""

from __future__ import annotations

from refitd.experts.cache import (
    CacheStats,
    CopyPlan,
    EnsurePlan,
    ExpertCache,
    ExpertId,
    GatherPlan,
    PrefetchPlan,
)
from refitd.experts.density import HitDensityPolicy
from refitd.experts.policy import (
    BeladyPolicy,
    EvictionPolicy,
    LruPolicy,
    PoolView,
)
from refitd.experts.residency import (
    BankResidency,
    CopyRoute,
    HostResidency,
    InconsistentResidency,
    ResidencyError,
    SlotRemapOnUnpinnedLayer,
)
from refitd.experts.reuse import ExpectedReusePolicy
from refitd.experts.slots import (
    Applied,
    DegenerateGeometry,
    DeviceFault,
    DeviceFlushFault,
    ExpertRows,
    ExpertSlots,
    HostExpertRows,
    HostSlotMemory,
    LayerOutOfRange,
    PlanHalvesDisagree,
    ResidencyRefused,
    RowMissing,
    RowSizeMismatch,
    SlotDevice,
    SlotDeviceError,
    SlotFault,
    SlotGeometry,
    SlotOutOfRange,
    SlotStats,
    SlotWrittenTwice,
    UnknownGatherSource,
)

__all__ = [
    "Applied",
    "BankResidency",
    "BeladyPolicy",
    "CacheStats",
    "CopyPlan",
    "CopyRoute",
    "DegenerateGeometry",
    "DeviceFault",
    "DeviceFlushFault",
    "EnsurePlan",
    "EvictionPolicy",
    "ExpectedReusePolicy",
    "ExpertCache",
    "ExpertId",
    "ExpertRows",
    "ExpertSlots",
    "GatherPlan",
    "HitDensityPolicy",
    "HostExpertRows",
    "HostResidency",
    "HostSlotMemory",
    "InconsistentResidency",
    "LayerOutOfRange",
    "LruPolicy",
    "PlanHalvesDisagree",
    "PoolView",
    "PrefetchPlan",
    "ResidencyError",
    "ResidencyRefused",
    "RowMissing",
    "RowSizeMismatch",
    "SlotDevice",
    "SlotDeviceError",
    "SlotFault",
    "SlotGeometry",
    "SlotOutOfRange",
    "SlotRemapOnUnpinnedLayer",
    "SlotStats",
    "SlotWrittenTwice",
    "UnknownGatherSource",
]
