"""The offload snippet of docs/experts.md runs as written, and what it computes is the
all-resident model's answer."""

from __future__ import annotations

from typing import Any

import torch
from support.docs import python_blocks

from refitd.integrations.offload import ExpertOffload


def test_the_offload_snippet_runs_as_written_and_matches_the_all_resident_model() -> None:
    from transformers import Qwen3MoeForCausalLM

    (block,) = python_blocks("## Offloaded MoE layers in a transformers model", "docs/experts.md")
    ns: dict[str, Any] = {}
    torch.manual_seed(0)
    exec(block, ns)
    offload: ExpertOffload = ns["offload"]
    # The same seed builds the same random model: the all-resident reference.
    torch.manual_seed(0)
    reference = Qwen3MoeForCausalLM(ns["config"]).eval()
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.equal(ns["logits"], want)
    assert offload.stats().routes > 0
    # The refit the snippet made wrote expert 5's rows and dropped its slot.
    assert offload.cache.slot_of(0, 5) is None
    assert torch.equal(offload.store.weight(0, 0, 5), torch.zeros(64, 64))
