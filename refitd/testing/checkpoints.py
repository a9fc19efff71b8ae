"""The Hugging Face checkpoint of a toy model: every tensor's name, full shape and role.

What a trainer publishes and a capture is given, for a :class:`~refitd.testing.engines.ModelConfig`
(dense GQA, MoE, or MLA as in DeepSeek-V3), in checkpoint order, without building a model.
"""

from __future__ import annotations

import torch

from refitd.testing.engines import ModelConfig

__all__ = ["hf_manifest", "param_roles"]


def _layer_shapes(cfg: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, full shape, role) of one decoder layer; see :func:`param_roles`."""
    p, h = f"model.layers.{i}.", cfg.hidden_size
    out: list[tuple[str, tuple[int, ...], str]] = [(p + "input_layernorm.weight", (h,), "norm")]
    a = p + "self_attn."
    if cfg.attention == "gqa":
        d = cfg.head_dim
        out += [
            (a + "q_proj.weight", (cfg.num_heads * d, h), "column"),
            (a + "k_proj.weight", (cfg.num_kv_heads * d, h), "column"),
            (a + "v_proj.weight", (cfg.num_kv_heads * d, h), "column"),
        ]
    else:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        kv_b = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        out += [
            (a + "q_a_proj.weight", (cfg.q_lora_rank, h), "replicated"),
            (a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "norm"),
            (a + "q_b_proj.weight", (cfg.num_heads * qk, cfg.q_lora_rank), "column"),
            (
                a + "kv_a_proj_with_mqa.weight",
                (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                "replicated",
            ),
            (a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm"),
            (a + "kv_b_proj.weight", (kv_b, cfg.kv_lora_rank), "column"),
        ]
    heads_out = cfg.num_heads * (cfg.head_dim if cfg.attention == "gqa" else cfg.v_head_dim)
    out.append((a + "o_proj.weight", (h, heads_out), "row"))
    out.append((p + "post_attention_layernorm.weight", (h,), "norm"))
    m = p + "mlp."
    if not cfg.is_moe_layer(i):
        inter = cfg.intermediate_size
        return [*out, *_mlp_shapes(m, h, inter)]
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    out += [
        (m + "gate.weight", (e, h), "replicated"),
        (m + "gate.e_score_correction_bias", (e,), "norm"),
    ]
    for x in range(e):
        out += [
            (f"{m}experts.{x}.gate_proj.weight", (inter, h), "expert"),
            (f"{m}experts.{x}.up_proj.weight", (inter, h), "expert"),
            (f"{m}experts.{x}.down_proj.weight", (h, inter), "expert"),
        ]
    if cfg.num_shared_experts:
        out += _mlp_shapes(m + "shared_experts.", h, inter * cfg.num_shared_experts)
    return out


def _mlp_shapes(m: str, h: int, inter: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (m + "gate_proj.weight", (inter, h), "column"),
        (m + "up_proj.weight", (inter, h), "column"),
        (m + "down_proj.weight", (h, inter), "row"),
    ]


def param_roles(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """Every full checkpoint tensor as ``(HF name, shape, role)``, in checkpoint order.

    ``role`` says how a tensor-parallel trainer holds it: ``column`` (dim 0 split),
    ``row`` (dim 1 split), ``vocab`` (dim 0 split after padding), ``replicated`` and
    ``norm`` (whole on every rank) or ``expert`` (one routed expert's matrix).
    """
    h = cfg.hidden_size
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (cfg.vocab_size, h), "vocab")
    ]
    for i in range(cfg.num_layers):
        out += _layer_shapes(cfg, i)
    out += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (cfg.vocab_size, h), "vocab")]
    return out


def hf_manifest(cfg: ModelConfig) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The checkpoint as a capture manifest: ``(HF name, dtype, full shape)``."""
    return [(name, cfg.dtype, shape) for name, shape, _role in param_roles(cfg)]
