"""Toy inference engines with the parameter shapes and weight loaders of vLLM.

These models exist so the reshard planner can be judged against what a real engine
does, without importing one. Each parameter is held at the shape one tensor-parallel
rank holds, carries a ``weight_loader`` with vLLM's calling convention, and the model's
``load_weights(iterable of (hf_name, tensor))`` routes Hugging Face checkpoint names to
those loaders with shard ids, exactly the way vLLM's model classes do:

- ``ColumnParallelLinear`` / ``RowParallelLinear``: narrow the output / input dim;
- ``MergedColumnParallelLinear``: ``gate_up_proj`` (and MLA's replicated
  ``fused_qkv_a_proj``), integer shard ids placing each source in its own row block;
- ``QKVParallelLinear``: ``q``/``k``/``v`` shard ids with GQA, KV heads replicated when
  there are fewer KV heads than ranks;
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary padded to a multiple of
  64, padded rows zeroed by the loader with ``fill_(0)`` as vLLM's does (a constant
  write, so a refit needs to move no byte there);
- ``FusedMoE``: stacked ``w13_weight``/``w2_weight`` of the local experts under expert
  parallelism, the per-expert source reached through ``unsqueeze(0).unbind(0)`` as
  vLLM's loader does, then narrowed for the MoE tensor-parallel rank;
- MLA: ``q_b_proj``, and a ``kv_b_proj`` whose loader splits every head into its
  no-position key part and its value part and stores all key parts before all value
  parts (the engine's layout differs from the checkpoint's);
- norms and the router bias have no ``weight_loader``: they go through
  :func:`default_weight_loader`, which capture must be given.

Everything works on real tensors (the ground truth: ``load_weights`` on full tensors)
and under ``torch.device("meta")`` (a twin for capture). Real parameters start at zero,
so anything a loader does not write is observably zero.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from refitd.errors import ConfigError, PlanError

__all__ = [
    "EngineParallel",
    "ModelConfig",
    "ToyEngine",
    "deepseek_v3_config",
    "default_weight_loader",
    "dense_toy_config",
    "moe_toy_config",
]

VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of this many rows before splitting it."""


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


@dataclass(frozen=True)
class EngineParallel:
    """One engine rank's place: ``tp_size`` ranks, of which experts are spread over
    ``ep_size`` groups (vLLM's expert parallelism with DP 1: ``ep_size`` = ``tp_size``
    turns MoE tensor parallelism off). The MoE layers use ``tp_size // ep_size``-way
    tensor parallelism inside each expert group."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        if self.tp_size % self.ep_size:
            raise ConfigError(f"ep_size {self.ep_size} does not divide tp_size {self.tp_size}")

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    def rank(self, tp_rank: int) -> EngineParallel:
        return replace(self, tp_rank=tp_rank)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ConfigError(f"{what} of {total} cannot be split evenly over {parts} ranks")
    return total // parts


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Zeros, so a row no loader writes (vocabulary padding) is observably untouched.
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """The loader for parameters without one (norms, biases): a whole-tensor copy."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise PlanError(
            f"default loader refused a source of shape {tuple(loaded.shape)} for a "
            f"parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(n_out, n_in, dtype=dtype)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]


class ColumnParallelLinear(nn.Module):
    """Output rows split over ranks: rank r holds rows [r*n, (r+1)*n)."""

    def __init__(self, n_in: int, n_out: int, tp_size: int, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        self.tp_rank = tp_rank
        self.weight = _param(_divide(n_out, tp_size, "output rows"), n_in, dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        rows = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))


class RowParallelLinear(nn.Module):
    """Input columns split over ranks: rank r holds a strided column block."""

    def __init__(self, n_in: int, n_out: int, tp_size: int, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        self.tp_rank = tp_rank
        self.weight = _param(n_out, _divide(n_in, tp_size, "input columns"), dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols))


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel outputs fused row-wise; shard id ``i`` is the i-th source.

    Rank r holds, for every source in order, that source's r-th row block.
    """

    def __init__(
        self, n_in: int, sizes: list[int], tp_size: int, tp_rank: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.local_sizes = [_divide(s, tp_size, "merged output rows") for s in sizes]
        self.weight = _param(sum(self.local_sizes), n_in, dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(nn.Module):
    """Fused q, k, v rows of this rank's heads. With fewer KV heads than ranks each
    rank holds one KV head, shared by ``tp_size // num_kv_heads`` consecutive ranks."""

    def __init__(
        self, hidden: int, head_dim: int, heads: int, kv_heads: int, tp: int, rank: int,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tp_rank = rank
        self.head_dim = head_dim
        self.q_heads = _divide(heads, tp, "query heads")
        if tp >= kv_heads:
            self.kv_heads, self.kv_replicas = 1, _divide(tp, kv_heads, "ranks per KV head")
        else:
            self.kv_heads, self.kv_replicas = _divide(kv_heads, tp, "KV heads"), 1
        rows = (self.q_heads + 2 * self.kv_heads) * head_dim
        self.weight = _param(rows, hidden, dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        q_rows, kv_rows = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        if shard_id == "q":
            dest, start, rows = 0, self.tp_rank * q_rows, q_rows
        else:
            dest = q_rows if shard_id == "k" else q_rows + kv_rows
            start, rows = (self.tp_rank // self.kv_replicas) * kv_rows, kv_rows
        param.data.narrow(0, dest, rows).copy_(loaded.narrow(0, start, rows))


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows padded to a multiple of 64 and split evenly; a rank whose block
    runs past the real vocabulary zeroes those rows (possibly all of them), as vLLM's
    loader does."""

    def __init__(self, vocab: int, hidden: int, tp: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.vocab = vocab
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        self.rows = _divide(padded, tp, "padded vocabulary")
        self.start = rank * self.rows
        self.weight = _param(self.rows, hidden, dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        real = min(self.rows, self.vocab - self.start)
        if real > 0:
            param.data.narrow(0, 0, real).copy_(loaded.narrow(0, self.start, real))
        if real < self.rows:
            param.data.narrow(0, max(real, 0), self.rows - max(real, 0)).fill_(0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)  # no weight_loader: the default one


class FusedMoE(nn.Module):
    """The local experts of one EP rank, stacked: ``w13_weight`` [E_local, 2*I_tp, H]
    (gate rows then up rows) and ``w2_weight`` [E_local, H, I_tp].

    The loader takes keywords like vLLM's (``param``, ``loaded_weight``,
    ``weight_name``, ``shard_id`` in ``w1``/``w2``/``w3``, ``expert_id``). A source for
    one expert is lifted to a stack of one with ``unsqueeze(0)`` and walked with
    ``unbind(0)``; ``expert_id=None`` means the source already stacks every expert.
    Experts outside this rank's contiguous range are ignored.
    """

    def __init__(
        self, experts: int, hidden: int, inter: int, par: EngineParallel, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.local = _divide(experts, par.ep_size, "experts")
        self.first = par.ep_rank * self.local
        self.tp_rank = par.moe_tp_rank
        self.inter = _divide(inter, par.moe_tp_size, "MoE intermediate rows")
        self.w13_weight = _param(self.local, 2 * self.inter, hidden, dtype=dtype)
        self.w2_weight = _param(self.local, hidden, self.inter, dtype=dtype)
        self.w13_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self,
        param: torch.Tensor,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int | None,
    ) -> bool:
        if expert_id is not None:
            if not self.first <= expert_id < self.first + self.local:
                return False  # another EP rank's expert
            ids: list[int] = [expert_id]
            loaded_weight = loaded_weight.unsqueeze(0)
        else:
            ids = list(range(loaded_weight.shape[0]))
        for global_id, one in zip(ids, loaded_weight.unbind(0)):
            local = global_id - self.first
            if not 0 <= local < self.local:
                continue
            dest = param.data[local]
            if shard_id == "w2":
                dest.copy_(one.narrow(1, self.tp_rank * self.inter, self.inter))
            elif shard_id in ("w1", "w3"):
                half = dest.narrow(0, 0 if shard_id == "w1" else self.inter, self.inter)
                half.copy_(one.narrow(0, self.tp_rank * self.inter, self.inter))
            else:
                raise PlanError(f"expert loader refused shard id {shard_id!r} of {weight_name}")
        return True


class MLAKVB(nn.Module):
    """``kv_b_proj`` of this rank's heads, stored split: every head's no-position key
    rows first, then every head's value rows (the checkpoint interleaves them per head)."""

    def __init__(self, cfg: ModelConfig, tp: int, rank: int) -> None:
        super().__init__()
        self.rank, self.heads = rank, _divide(cfg.num_heads, tp, "attention heads")
        self.all_heads = cfg.num_heads
        self.nope, self.v, self.lora = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.weight = _param(self.heads * (self.nope + self.v), self.lora, dtype=cfg.dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        h, nope, v, lora = self.heads, self.nope, self.v, self.lora
        mine = loaded.view(self.all_heads, nope + v, lora).narrow(0, self.rank * h, h)
        key, value = mine.split([nope, v], dim=1)  # type: ignore[no-untyped-call]
        param.data.narrow(0, 0, h * nope).view(h, nope, lora).copy_(key)
        param.data.narrow(0, h * nope, h * v).view(h, v, lora).copy_(value)


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
            self.kv_b_proj = MLAKVB(cfg, tp, r)
            self.o_proj = RowParallelLinear(cfg.num_heads * cfg.v_head_dim, h, tp, r, dt)
        else:
            raise ConfigError(f"attention kind {cfg.attention!r} is not 'gqa' or 'mla'")


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp, rank, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, rank, dtype)


class Router(nn.Module):
    def __init__(self, experts: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(experts, hidden, dtype=dtype)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.e_score_correction_bias = _param(experts, dtype=dtype)


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
