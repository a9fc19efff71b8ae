"""refitd's reshard planner: capture on a meta twin → plan → compile → execute.

Pure code, no I/O. The public names keep ModelExpress's ``refit.reshard`` API so
code written against it ports by changing the import prefix; the modules are:

- :mod:`~refitd.reshard.types`: value types (``RecordedCopy``, ``CaptureResult`` …);
- :mod:`~refitd.reshard.geometry`: capture of the engine's loaders on placeholders;
- :mod:`~refitd.reshard.replay`: local replay of recorded movement-op chains;
- :mod:`~refitd.reshard.slice_plan`: one copy → exact, coalesced byte segments;
- :mod:`~refitd.reshard.transfer_plan`: a whole capture → a costed transfer plan;
- :mod:`~refitd.reshard.reads`: read descriptors, pack specs, reference transport;
- :mod:`~refitd.reshard.compile`: plans lowered to arrays, bound to a signature;
- :mod:`~refitd.reshard.receiver`: fail-closed policy and execution.
"""

from __future__ import annotations

from refitd.reshard.compile import (
    BoundPlan,
    CompiledPlan,
    PlanSignature,
    SignatureMismatch,
    compile_plan,
    dest_layout_of,
)
from refitd.reshard.geometry import (
    LazyWeight,
    build_lazy_weights,
    capture_geometry,
    capture_weights,
    convert_source_weights,
)
from refitd.reshard.reads import InMemoryReadExecutor, PackedRead, ReadDescriptor
from refitd.reshard.receiver import ReshardReceiver
from refitd.reshard.replay import replay_ops
from refitd.reshard.slice_plan import Segment, Shard, plan_pull
from refitd.reshard.transfer_plan import (
    FullPull,
    PackSpec,
    SourceInfo,
    TransferPlan,
    exact_descriptors,
    execute_transfer,
    plan_transfer,
)
from refitd.reshard.types import (
    CaptureResult,
    OpChain,
    OpSpec,
    RecordedCopy,
    UnsupportedReshard,
    summarize_unsupported,
)

__all__ = [
    "BoundPlan",
    "CaptureResult",
    "CompiledPlan",
    "FullPull",
    "InMemoryReadExecutor",
    "LazyWeight",
    "OpChain",
    "OpSpec",
    "PackSpec",
    "PackedRead",
    "PlanSignature",
    "ReadDescriptor",
    "RecordedCopy",
    "ReshardReceiver",
    "Segment",
    "Shard",
    "SignatureMismatch",
    "SourceInfo",
    "TransferPlan",
    "UnsupportedReshard",
    "build_lazy_weights",
    "capture_geometry",
    "capture_weights",
    "compile_plan",
    "convert_source_weights",
    "dest_layout_of",
    "exact_descriptors",
    "execute_transfer",
    "plan_pull",
    "plan_transfer",
    "replay_ops",
    "summarize_unsupported",
]
