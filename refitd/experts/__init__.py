"""MoE expert residency, pure: the cache (planner), eviction policies, host residency,
the slot executor, and routing traces.

No I/O happens here except ``traces.read_trace_file``, the one function that reads a
recorded routing trace. The daemon hosts these pools; the decode hot path can run the
same classes in-process.
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
