"""vLLM's parallel layers, toy-sized: each holds one tensor-parallel rank's share and
carries a ``weight_loader`` with vLLM's calling convention (the models built of them:
:mod:`refitd.testing.engines`).

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
- MLA: a ``kv_b_proj`` whose loader splits every head into its no-position key part
  and its value part and stores all key parts before all value parts (the engine's
  layout differs from the checkpoint's);
- norms and the router bias have no ``weight_loader``: they go through
  :func:`default_weight_loader`, which capture must be given.

:class:`EngineParallel` is the rank's place they are built for (tensor and expert
parallelism). Parameters start at zero, so anything a loader does not write is
observably zero.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from refitd.errors import ConfigError, PlanError

__all__ = [
    "MLAKVB",
    "VOCAB_PADDING",
    "ColumnParallelLinear",
    "EngineParallel",
    "FusedMoE",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "Router",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "default_weight_loader",
]

VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of this many rows before splitting it."""


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

    def __init__(
        self, heads: int, nope: int, v: int, lora: int, tp: int, rank: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.rank, self.heads = rank, _divide(heads, tp, "attention heads")
        self.all_heads = heads
        self.nope, self.v, self.lora = nope, v, lora
        self.weight = _param(self.heads * (self.nope + self.v), self.lora, dtype=dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        h, nope, v, lora = self.heads, self.nope, self.v, self.lora
        mine = loaded.view(self.all_heads, nope + v, lora).narrow(0, self.rank * h, h)
        key, value = mine.split([nope, v], dim=1)  # type: ignore[no-untyped-call]
        param.data.narrow(0, 0, h * nope).view(h, nope, lora).copy_(key)
        param.data.narrow(0, h * nope, h * v).view(h, v, lora).copy_(value)


class Router(nn.Module):
    def __init__(self, experts: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(experts, hidden, dtype=dtype)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.e_score_correction_bias = _param(experts, dtype=dtype)
