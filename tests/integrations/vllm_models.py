"""Tiny vLLM-servable models written by the tests: config, random weights, no hub.

Weights come from the Hugging Face model class itself (random init under a seed),
so names and shapes are the checkpoint's own; they are saved as safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def hf_model(config: dict[str, Any], seed: int) -> torch.nn.Module:
    """The Hugging Face model for ``config`` with random bf16 weights from ``seed``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cfg.architectures = config["architectures"]
    torch.manual_seed(seed)
    cls = getattr(transformers, config["architectures"][0])
    model = cls(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # spread values so a wrong byte changes tokens
            p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


def save_model(path: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``state`` into ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def write_model(path: Path, config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in hf_model(config, seed).state_dict().items()}
    save_model(path, config, state)
    return state


def vllm_env(cache: Path) -> None:
    os.environ.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(cache),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )


def llm_kwargs() -> dict[str, Any]:
    return {
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "max_model_len": 128,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
    }


def loader_format_mismatches(worker: Any, checkpoint: str) -> list[str]:
    """Run in a vLLM worker (``llm.collective_rpc``): the refit destinations (loader
    format) that differ, bit for bit, from a model built afresh there whose own
    ``load_weights`` read ``checkpoint`` (a safetensors file). Empty: all equal."""
    from safetensors.torch import load_file

    engine = worker.weight_transfer_engine
    with torch.device("cpu"):
        truth = engine._twin()
    truth.load_weights(load_file(checkpoint).items())
    want = dict(truth.named_parameters())
    got = engine.receiver._params
    return [n for n, p in got.items() if not torch.equal(p.data, want[n].data)]
