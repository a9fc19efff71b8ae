"""refitd as vLLM's weight-transfer backend on a tiny Qwen3-MoE (4 experts, top-2).

The same flow as the dense module: a real ``LLM`` with the ``refitd`` backend, a real
daemon, a 2-rank FSDP2 trainer publishing its local shards (the stacked expert
weights split by expert rows). Truth is a fresh ``LLM`` loaded from the trainer's
weights on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_models import (
    QWEN3_MOE,
    greedy,
    live_params,
    llm_kwargs,
    loader_format_mismatches,
    run_fsdp_trainer,
    write_model,
)

pytestmark = pytest.mark.timeout(600)


def test_an_fsdp2_trainer_refits_a_moe_engine_exactly(tmp_path: Path, vllm_daemon_url: str) -> None:
    url = vllm_daemon_url
    from vllm import LLM

    from refitd.integrations.vllm.worker import refit_stats

    write_model(tmp_path / "engine", QWEN3_MOE, seed=1)
    llm = LLM(
        model=str(tmp_path / "engine"), weight_transfer_config={"backend": "refitd"}, **llm_kwargs()
    )
    seen: dict[str, Any] = {}

    def on_event(message: Any) -> Any:
        _, _version, checkpoint, _timing = message
        [seen["stats"]] = llm.collective_rpc(refit_stats)
        [seen["wrong"]] = llm.collective_rpc(
            loader_format_mismatches, args=(str(Path(checkpoint) / "model.safetensors"),)
        )
        [seen["live"]] = llm.collective_rpc(live_params)
        seen["tokens"], seen["checkpoint"] = greedy(llm), checkpoint
        return ("ok", None)

    before = greedy(llm)
    job = {
        "config": QWEN3_MOE,
        "seeds": [2],
        "model": "moe",
        "url": url,
        "out": str(tmp_path / "fsdp"),
    }
    assert run_fsdp_trainer(job, on_event, llm) == [0, 0]
    assert seen["wrong"] == [] and seen["stats"]["version"] == 1
    assert seen["tokens"] != before
    fresh = LLM(model=seen["checkpoint"], **llm_kwargs())
    [truth] = fresh.collective_rpc(live_params)
    assert sorted(seen["live"]) == sorted(truth)
    assert [n for n in truth if not torch.equal(seen["live"][n], truth[n])] == []
    assert seen["tokens"] == greedy(fresh)
