"""Offloaded MoE layers in a Hugging Face transformers model, driven by ``refitd.experts``.

``offload_experts(model, slots=...)`` replaces the experts module of every MoE block
(Qwen3-MoE, Mixtral, DeepSeek-V3 and any block of the same shape: a ``gate`` router
returning ``(logits, weights, indices)`` and an ``experts`` module holding
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) with ``OffloadedExperts``:

- the expert weights move to host memory, ``HostExpertStore`` (page-locked when the
  slots are on a GPU), one row per expert in two banks (``gate_up``, ``down``);
- a bounded pool of ``slots`` sits on the model's device (``TorchSlotMemory`` on the
  CPU, ``refitd.experts.cuda.CudaSlotMemory`` on a GPU), shared by all MoE layers;
- each forward reads the router's choice, calls ``ExpertCache.ensure`` and the slot
  executor (``ExpertSlots``), predicts the next MoE layer's experts (its router on this
  layer's hidden state) and issues ``prefetch`` copies for it, then computes every
  routed expert from its slot. In hybrid mode (``max_fetch``) experts left unfetched
  are computed on the CPU from their host rows.

The computation is transformers' eager experts loop, operation for operation, with
each expert's weights read from its slot instead of the stacked parameter: on the CPU
the logits are bit-equal to the all-resident model's run with
``experts_implementation="eager"``, whatever the pool size, policy or prefetch.

A failed copy costs its slots, never the answer: the slots are forgotten in the cache
and the experts they would have held are computed from their host rows.
``write_experts`` rewrites experts' host rows (a refit) and drops every slot that
still holds their old bytes.

Modules:

- `layers`: finding MoE blocks, the stand-in experts module, the residency driving it
- `memory`: host rows (`HostExpertStore`) and the CPU's slot pool (`TorchSlotMemory`)
"""

from __future__ import annotations

from refitd.integrations.offload.layers import (
    ExpertOffload,
    OffloadedExperts,
    OffloadStats,
    Predictor,
    SlotMemoryFactory,
    moe_blocks,
    offload_experts,
)
from refitd.integrations.offload.memory import HostExpertStore, TorchSlotMemory

__all__ = [
    "ExpertOffload",
    "HostExpertStore",
    "OffloadStats",
    "OffloadedExperts",
    "Predictor",
    "SlotMemoryFactory",
    "TorchSlotMemory",
    "moe_blocks",
    "offload_experts",
]
