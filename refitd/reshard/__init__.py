"""refitd's reshard planner: capture on a meta twin → plan → compile → execute.

Pure code, no I/O. The public names keep ModelExpress's ``refit.reshard`` API so
code written against it ports by changing the import prefix.

Modules:

- `types`: value types shared by every stage (``RecordedCopy``, ``CaptureResult`` …)
- `lazy`: zero-storage placeholders that record how a loader carves a source: their
  common base (interception, sinks, refusals) and the capture's recorders
- `lazy_weight`: `LazyWeight`: the placeholder of one source, and its views
- `lazy_concat`: ``torch.cat``/``torch.stack`` of placeholders, as per-piece copies
- `geometry`: capture of the engine's loaders on placeholders
- `replay`: local replay of recorded movement-op chains
- `chunks`: where each element of a full tensor can be read from: a shard's chunks
- `slice_plan`: one recorded copy → exact, coalesced reads
- `cost`: the per-copy cost model: exact reads, a pack spec, or a full read
- `transfer_plan`: a whole capture → a costed transfer plan
- `coverage`: which destinations a capture leaves unwritten
- `owners`: which destination a loader's write lands in, by the memory it lands in
- `compile`: plans lowered to arrays, bound to a signature
- `reads`: read descriptors, packed reads, `ReadExecutor` and its reference
- `receiver`: `ReshardReceiver`: fail-closed policy, plan once, replay
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
from refitd.reshard.slice_plan import Read, Shard, plan_pull
from refitd.reshard.transfer_plan import (
    FullRead,
    PackPlan,
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
    "FullRead",
    "InMemoryReadExecutor",
    "LazyWeight",
    "OpChain",
    "OpSpec",
    "PackPlan",
    "PackedRead",
    "PlanSignature",
    "Read",
    "ReadDescriptor",
    "RecordedCopy",
    "ReshardReceiver",
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
