"""refitd as vLLM's weight-transfer backend on a tiny Qwen3-MoE (4 experts, top-2).

The same flow as the dense module: a real ``LLM`` with the ``refitd`` backend, a real
daemon, a 2-rank FSDP2 trainer publishing its local shards (the stacked expert
weights split by expert rows). Truth is a fresh ``LLM`` loaded from the trainer's
weights on disk.
"""

from __future__ import annotations

import gc
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
    stop_engine,
    write_model,
)

pytestmark = pytest.mark.timeout(600)


def refit_by_fsdp(root: Path, url: str) -> dict[str, Any]:
    """Start an engine with the ``refitd`` backend, refit it from a 2-rank FSDP2
    trainer, and return what it served then; the engine is gone on return (one
    in-process engine at a time: vLLM's parallel state is per process)."""
    from vllm import LLM

    from refitd.integrations.vllm.worker import refit_stats

    write_model(root / "engine", QWEN3_MOE, seed=1)
    llm = LLM(
        model=str(root / "engine"), weight_transfer_config={"backend": "refitd"}, **llm_kwargs()
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

    try:
        seen["before"] = greedy(llm)
        job = {
            "config": QWEN3_MOE,
            "seeds": [2],
            "model": "moe",
            "url": url,
            "out": str(root / "fsdp"),
        }
        seen["exits"] = run_fsdp_trainer(job, on_event, llm)
        return seen
    finally:
        stop_engine(llm)


def test_an_fsdp2_trainer_refits_a_moe_engine_exactly(tmp_path: Path, vllm_daemon_url: str) -> None:
    from vllm import LLM

    seen = refit_by_fsdp(tmp_path, vllm_daemon_url)
    assert seen["exits"] == [0, 0]
    assert seen["wrong"] == [] and seen["stats"]["version"] == 1
    assert seen["tokens"] != seen["before"]
    fresh = LLM(model=seen["checkpoint"], **llm_kwargs())
    try:
        [truth] = fresh.collective_rpc(live_params)
        assert sorted(seen["live"]) == sorted(truth)
        assert [n for n in truth if not torch.equal(seen["live"][n], truth[n])] == []
        assert seen["tokens"] == greedy(fresh)
    finally:
        stop_engine(fresh)
        del fresh
        gc.collect()
