"""Toy inference engines with the parameter shapes and weight loaders of vLLM.

These models exist so the reshard planner can be judged against what a real engine
does, without importing one. Each parameter is held at the shape one tensor-parallel
rank holds, carries a ``weight_loader`` with vLLM's calling convention (the layers:
:mod:`refitd.testing.layers`), and the model's ``load_weights(iterable of (hf_name,
tensor))`` routes Hugging Face checkpoint names to those loaders with shard ids,
exactly the way vLLM's model classes do: stacked q/k/v, gate/up and MLA's
``q_a_proj``/``kv_a_proj_with_mqa`` to their fused parameters, routed experts (one
per tensor, or all stacked) to ``FusedMoE``, everything else by its own name.

Models are Llama-shaped (GQA) or DeepSeek-shaped (MLA: ``q_b_proj``, a ``kv_b_proj``
stored split; dense layers first, then MoE layers with a router, routed and shared
experts), sized by a :class:`ModelConfig`.

Everything works on real tensors (the ground truth: ``load_weights`` on full tensors)
and under ``torch.device("meta")`` (a twin for capture). Real parameters start at zero,
so anything a loader does not write is observably zero.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from refitd.errors import ConfigError, PlanError
from refitd.testing.layers import (
    MLAKVB,
    VOCAB_PADDING,
    ColumnParallelLinear,
    EngineParallel,
    FusedMoE,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    Router,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)

__all__ = [
    "EngineParallel",
    "ModelConfig",
    "ToyEngine",
    "deepseek_v3_config",
    "default_weight_loader",
    "dense_toy_config",
    "moe_toy_config",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a decoder-only model, in elements.

    ``attention`` is ``"gqa"`` (Llama-style q/k/v/o with ``num_kv_heads`` and
    ``head_dim``) or ``"mla"`` (DeepSeek-style low-rank projections). Layers from
    ``first_k_dense`` on are MoE layers when ``num_experts`` > 0.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    attention: str = "gqa"
    num_kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0
    dtype: torch.dtype = torch.float32

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def dense_toy_config(dtype: torch.dtype = torch.float32) -> ModelConfig:
    """A small Llama-shaped model: GQA with 8 query heads and 2 KV heads."""
    return ModelConfig(
        vocab_size=200,
        hidden_size=32,
        num_layers=2,
        intermediate_size=48,
        num_heads=8,
        num_kv_heads=2,
        head_dim=4,
        dtype=dtype,
    )


def moe_toy_config(dtype: torch.dtype = torch.float32) -> ModelConfig:
    """A small DeepSeek-shaped model: MLA, one dense layer, then MoE layers."""
    return ModelConfig(
        vocab_size=100,
        hidden_size=32,
        num_layers=3,
        intermediate_size=48,
        num_heads=8,
        attention="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
        num_experts=8,
        moe_intermediate_size=16,
        num_shared_experts=1,
        first_k_dense=1,
        dtype=dtype,
    )


def deepseek_v3_config(num_layers: int = 61) -> ModelConfig:
    """DeepSeek-V3's shapes in bf16; ``num_layers`` < 61 keeps the 3 dense layers first."""
    return ModelConfig(
        vocab_size=129280,
        hidden_size=7168,
        num_layers=num_layers,
        intermediate_size=18432,
        num_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        first_k_dense=min(3, num_layers),
        dtype=torch.bfloat16,
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, par: EngineParallel) -> None:
        super().__init__()
        tp, r, h, dt = par.tp_size, par.tp_rank, cfg.hidden_size, cfg.dtype
        if cfg.attention == "gqa":
            d = cfg.head_dim
            self.qkv_proj = QKVParallelLinear(h, d, cfg.num_heads, cfg.num_kv_heads, tp, r, dt)
            self.o_proj = RowParallelLinear(cfg.num_heads * d, h, tp, r, dt)
        elif cfg.attention == "mla":
            rope, qk = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            sizes = [cfg.q_lora_rank, cfg.kv_lora_rank + rope]
            self.fused_qkv_a_proj = MergedColumnParallelLinear(h, sizes, 1, 0, dt)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dt)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * qk, tp, r, dt)
            self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, dt)
            self.kv_b_proj = MLAKVB(
                cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, tp, r, dt
            )
            self.o_proj = RowParallelLinear(cfg.num_heads * cfg.v_head_dim, h, tp, r, dt)
        else:
            raise ConfigError(f"attention kind {cfg.attention!r} is not 'gqa' or 'mla'")


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp, rank, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, rank, dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, par: EngineParallel) -> None:
        super().__init__()
        h, dt = cfg.hidden_size, cfg.dtype
        self.gate = Router(cfg.num_experts, h, dt)
        self.experts = FusedMoE(cfg.num_experts, h, cfg.moe_intermediate_size, par, dt)
        if cfg.num_shared_experts:
            inter = cfg.moe_intermediate_size * cfg.num_shared_experts
            self.shared_experts = MLP(h, inter, par.tp_size, par.tp_rank, dt)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, par: EngineParallel, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.dtype)
        self.self_attn = Attention(cfg, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.dtype)
        self.mlp: nn.Module
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, par)
        else:
            tp, r = par.tp_size, par.tp_rank
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, r, cfg.dtype)


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, par: EngineParallel) -> None:
        super().__init__()
        tp, r = par.tp_size, par.tp_rank
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp, r, cfg.dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, par, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.dtype)


# (engine parameter part, checkpoint part, shard id), checked in order like vLLM's
# stacked_params_mapping. Routed experts are matched before this table.
_STACKED: tuple[tuple[str, str, Any], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
    (".fused_qkv_a_proj.", ".q_a_proj.", 0),
    (".fused_qkv_a_proj.", ".kv_a_proj_with_mqa.", 1),
)
_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(?:(\d+)\.)?(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class ToyEngine(nn.Module):
    """One engine rank of a model: ``model.embed_tokens``, ``model.layers.N.*``,
    ``model.norm``, ``lm_head``, with vLLM's parameter names and fused layouts."""

    def __init__(self, config: ModelConfig, parallel: EngineParallel | None = None) -> None:
        super().__init__()
        par = parallel or EngineParallel()
        self.config, self.parallel = config, par
        self.model = _Body(config, par)
        self.lm_head = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, par.tp_size, par.tp_rank, config.dtype
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route Hugging Face checkpoint tensors to parameter loaders; returns the
        engine parameter names that were offered a tensor. An unknown name is refused."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, loaded in weights:
            expert = _EXPERT.fullmatch(name)
            if expert is not None:
                prefix, index, proj = expert.groups()
                shard = _EXPERT_SHARD[proj]
                target = prefix + ("w2_weight" if shard == "w2" else "w13_weight")
                param = self._lookup(params, target, name)
                param.weight_loader(  # type: ignore[attr-defined]
                    param=param,
                    loaded_weight=loaded,
                    weight_name=name,
                    shard_id=shard,
                    expert_id=None if index is None else int(index),
                )
                seen.add(target)
                continue
            for engine_part, ckpt_part, shard_id in _STACKED:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, engine_part)
                    param = self._lookup(params, target, name)
                    param.weight_loader(param, loaded, shard_id)  # type: ignore[attr-defined]
                    break
            else:
                target = name
                param = self._lookup(params, target, name)
                getattr(param, "weight_loader", default_weight_loader)(param, loaded)
            seen.add(target)
        return seen

    @staticmethod
    def _lookup(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        try:
            return params[target]
        except KeyError:
            raise PlanError(
                f"engine has no parameter {target!r} for checkpoint tensor {name!r}"
            ) from None
