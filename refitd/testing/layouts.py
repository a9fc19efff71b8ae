"""Trainer layouts: how a training job holds a model, published as reshard sources.

A layout takes a model's full checkpoint (Hugging Face names, :mod:`refitd.testing.engines`)
and says which trainer rank holds which box of which tensor, under the trainer's own
tensor names. It returns one :class:`~refitd.reshard.transfer_plan.SourceInfo` per
trainer tensor, whose :class:`~refitd.reshard.slice_plan.Shard` s point either into
real per-rank buffers (given the full tensors: the plan can be executed and checked)
or at synthetic addresses (given shapes only: the plan can be measured on ``meta``).

Two layouts:

- :func:`fsdp_dim0` — FSDP2-style: every tensor split into dim-0 blocks of
  ``ceil(rows / N)`` rows over N ranks (the last block short, trailing ranks possibly
  empty); trainer names are the checkpoint's, so no conversion.
- :func:`megatron_tp_ep` — Megatron-Core-style tensor and expert parallelism under
  Megatron names: column-parallel weights split on dim 0, row-parallel on dim 1, the
  vocabulary padded to a multiple of ``128 * tp`` rows, q/k/v fused per query group
  (``linear_qkv``), gate/up fused per TP rank (``linear_fc1``), routed experts stacked
  (``[E, 2*I, H]`` / ``[E, H, I]``) and split over EP ranks, norms and small
  projections replicated on every rank. Its ``convert`` maps Megatron tensors back to
  checkpoint names with ``view``/``select``/``narrow``/``reshape`` only, so capture can
  trace it.

Every rank's shards sit back to back in one buffer (one session per rank), in tensor
order, each aligned to its element size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from refitd.errors import ConfigError
from refitd.reshard.geometry import capture_geometry, capture_weights, convert_source_weights
from refitd.reshard.slice_plan import Shard
from refitd.reshard.transfer_plan import SourceInfo
from refitd.reshard.types import CaptureResult
from refitd.testing.checkpoints import param_roles
from refitd.testing.engines import ModelConfig, default_weight_loader

__all__ = [
    "Published",
    "TrainerTensor",
    "capture_published",
    "fsdp_dim0",
    "full_state",
    "megatron_tp_ep",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offset, shape)`` of a block of a tensor, in elements per dim."""

Convert = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]

SYNTHETIC_RANK_SPAN = 1 << 40
"""Synthetic address space per rank (bytes): rank r's buffer starts at (r + 1) * span."""


@dataclass(frozen=True)
class TrainerTensor:
    """One tensor as the trainer names and holds it: its full shape, and for each
    trainer rank the box of it that rank holds (ranks may repeat a box: replicas)."""

    name: str
    shape: tuple[int, ...]
    placement: tuple[tuple[int, Box], ...]


@dataclass
class Published:
    """What a trainer layout publishes.

    ``manifest`` lists ``(trainer name, dtype, full shape)`` for capture;
    ``convert`` (or ``None``) maps trainer tensors to checkpoint names;
    ``buffers`` maps session to the rank's buffer (empty when synthetic), and must
    stay alive while any plan built on ``sources`` is executed.
    """

    layout: str
    sources: dict[str, SourceInfo]
    manifest: list[tuple[str, torch.dtype, tuple[int, ...]]]
    convert: Convert | None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def published_bytes(self) -> int:
        """Bytes over all shards, replicas included."""
        return sum(
            _numel(s.shape) * info.elsize for info in self.sources.values() for s in info.shards
        )


def capture_published(model: torch.nn.Module, published: Published) -> CaptureResult:
    """Capture ``model`` (a meta twin of an engine rank from :mod:`refitd.testing.engines`)
    against what ``published`` holds, through its ``convert`` when it has one."""
    if published.convert is None:
        return capture_geometry(model, published.manifest, default_weight_loader)
    weights = convert_source_weights(published.convert, published.manifest)
    return capture_weights(model, weights, default_weight_loader)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def full_state(cfg: ModelConfig, *, seed: int | None = None) -> dict[str, torch.Tensor]:
    """A full checkpoint for ``cfg``. Without ``seed`` every element of the whole
    model holds a distinct value (needs a dtype exact on integers, e.g. float32), so
    any misplaced element is caught; with ``seed`` values are random normal."""
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    base = 1
    for name, shape, _role in param_roles(cfg):
        n = _numel(shape)
        if gen is None:
            values = torch.arange(base, base + n, dtype=torch.float64).to(cfg.dtype)
        else:
            values = torch.randn(n, generator=gen, dtype=torch.float32).to(cfg.dtype)
        out[name] = values.reshape(shape)
        base += n
    return out


def _blocks(shape: tuple[int, ...], dim: int, parts: int) -> list[Box]:
    """Even blocks of ``ceil(size / parts)`` along ``dim``; the last may be short and
    trailing ranks may get an empty block (returned with a zero-size dim)."""
    size = shape[dim]
    step = -(-size // parts)
    before, after = shape[:dim], shape[dim + 1 :]
    zeros = (0,) * len(shape)
    out: list[Box] = []
    for r in range(parts):
        start = min(r * step, size)
        length = min(step, size - start)
        out.append(((*zeros[:dim], start, *zeros[dim + 1 :]), (*before, length, *after)))
    return out


def _publish(
    layout: str,
    tensors: list[TrainerTensor],
    dtype: torch.dtype,
    state: Mapping[str, torch.Tensor] | None,
    convert: Convert | None,
) -> Published:
    """Pack every rank's boxes back to back into that rank's buffer and describe them."""
    elsize = dtype.itemsize
    cursor: dict[int, int] = {}
    placed: list[tuple[TrainerTensor, int, Box, int]] = []  # tensor, rank, box, byte offset
    for t in tensors:
        for rank, box in t.placement:
            if _numel(box[1]) == 0:
                continue
            at = -(-cursor.get(rank, 0) // elsize) * elsize
            placed.append((t, rank, box, at))
            cursor[rank] = at + _numel(box[1]) * elsize
    buffers: dict[str, torch.Tensor] = {}
    bases: dict[int, int] = {}
    for rank, size in sorted(cursor.items()):
        if state is None:
            bases[rank] = (rank + 1) * SYNTHETIC_RANK_SPAN
        else:
            buf = torch.zeros(size, dtype=torch.uint8)
            buffers[f"{layout}{rank}"] = buf
            bases[rank] = buf.data_ptr()
    shards: dict[str, list[Shard]] = {t.name: [] for t in tensors}
    for t, rank, (off, shape), at in placed:
        session = f"{layout}{rank}"
        if state is not None:
            nbytes = _numel(shape) * elsize
            dest = buffers[session][at : at + nbytes].view(dtype).view(shape)
            block = state[t.name]
            for d, (o, n) in enumerate(zip(off, shape)):
                block = block.narrow(d, o, n)
            dest.copy_(block)
        shards[t.name].append(Shard(off, shape, session, bases[rank] + at, elsize))
    sources = {t.name: SourceInfo(t.shape, dtype, elsize, shards[t.name]) for t in tensors}
    manifest = [(t.name, dtype, t.shape) for t in tensors]
    return Published(layout, sources, manifest, convert, buffers)


def fsdp_dim0(
    cfg: ModelConfig, world_size: int, state: Mapping[str, torch.Tensor] | None = None
) -> Published:
    """Every checkpoint tensor in dim-0 blocks over ``world_size`` ranks, under its
    checkpoint name. ``state`` (full tensors) gives real buffers; ``None`` synthetic."""
    if world_size < 1:
        raise ConfigError(f"FSDP world size must be positive, not {world_size}")
    tensors = [
        TrainerTensor(name, shape, tuple(enumerate(_blocks(shape, 0, world_size))))
        for name, shape, _role in param_roles(cfg)
    ]
    return _publish("fsdp", tensors, cfg.dtype, state, None)


@dataclass(frozen=True)
class _Mapped:
    """A Megatron tensor built from checkpoint tensors (``pack``, real tensors only)
    and taken apart again by ``unpack`` (lazy tensors during capture)."""

    tensor: TrainerTensor
    pack: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
    unpack: Convert


def megatron_tp_ep(
    cfg: ModelConfig,
    tp: int,
    ep: int = 1,
    state: Mapping[str, torch.Tensor] | None = None,
    *,
    unfuse: str = "cat",
) -> Published:
    """Megatron-Core TP ``tp`` × EP ``ep`` under Megatron names, with ``convert``.

    ``unfuse`` is how ``convert`` takes fused ``linear_qkv``/``linear_fc1`` apart:
    ``"cat"`` concatenates the per-group / per-rank row blocks of each part
    (``torch.cat`` of ``narrow`` s), ``"view"`` reshapes the fused tensor to expose
    the blocks, ``select``/``narrow`` s the part and ``reshape`` s it back (a copy,
    since the part is not contiguous). Both give the same tensors.

    The job has ``max(tp, ep)`` ranks (one must divide the other): rank r holds TP
    shard ``r % tp`` of dense weights and the experts of EP rank ``r % ep``; ranks
    beyond ``tp`` hold data-parallel replicas, and every rank a copy of replicated
    tensors. Megatron needs ``num_kv_heads % tp == 0`` for fused q/k/v.
    """
    world = max(tp, ep)
    if world % tp or world % ep:
        raise ConfigError(f"Megatron layout needs tp ({tp}) and ep ({ep}) to divide each other")
    if unfuse not in ("cat", "view"):
        raise ConfigError(f"unfuse must be 'cat' or 'view', not {unfuse!r}")
    mapped = _megatron_tensors(cfg, tp, ep, world, unfuse == "view")

    def convert(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for m in mapped:
            out.update(m.unpack(sd))
        return out

    built = None
    if state is not None:
        built = {m.tensor.name: m.pack(state).contiguous() for m in mapped}
    return _publish("megatron", [m.tensor for m in mapped], cfg.dtype, built, convert)


def _megatron_tensors(
    cfg: ModelConfig, tp: int, ep: int, world: int, by_view: bool
) -> list[_Mapped]:
    h = cfg.hidden_size
    out: list[_Mapped] = []

    def split(shape: tuple[int, ...], dim: int | None, parts: int) -> tuple[tuple[int, Box], ...]:
        if dim is None:
            whole: Box = ((0,) * len(shape), shape)
            return tuple((r, whole) for r in range(world))
        if shape[dim] % parts:
            raise ConfigError(f"dim {dim} of {shape} does not split over {parts} Megatron ranks")
        blocks = _blocks(shape, dim, parts)
        return tuple((r, blocks[r % parts]) for r in range(world))

    def rename(mname: str, hf: str, shape: tuple[int, ...], dim: int | None) -> None:
        out.append(
            _Mapped(
                TrainerTensor(mname, shape, split(shape, dim, tp)),
                lambda sd: sd[hf],
                lambda sd: {hf: sd[mname]},
            )
        )

    # The vocabulary is padded so each TP rank holds a multiple of 128 rows.
    vocab, unit = cfg.vocab_size, 128 * tp
    padded = -(-vocab // unit) * unit

    def padded_vocab(mname: str, hf: str) -> _Mapped:
        def pack(sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return torch.cat([sd[hf], sd[hf].new_zeros(padded - vocab, h)])

        def unpack(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {hf: sd[mname].narrow(0, 0, vocab)}

        return _Mapped(TrainerTensor(mname, (padded, h), split((padded, h), 0, tp)), pack, unpack)

    out.append(padded_vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"))
    out.append(padded_vocab("output_layer.weight", "lm_head.weight"))
    roles = {name: (shape, role) for name, shape, role in param_roles(cfg)}
    rename("decoder.final_layernorm.weight", "model.norm.weight", (h,), None)
    for i in range(cfg.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        plain = {
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
            "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
            "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
            "self_attn.q_a_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
            "self_attn.kv_a_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
            "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
            "mlp.gate.weight": "mlp.router.weight",
            "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
            "mlp.down_proj.weight": "mlp.linear_fc2.weight",
            "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
        }
        dim_of = {"column": 0, "row": 1, "replicated": None, "norm": None}
        for hname, mname in plain.items():
            if hp + hname in roles:
                shape, role = roles[hp + hname]
                rename(mp + mname, hp + hname, shape, dim_of[role])
        if cfg.attention == "gqa":
            out.append(
                _fused_qkv(cfg, tp, hp, mp + "self_attention.linear_qkv.weight", split, by_view)
            )
        if not cfg.is_moe_layer(i):
            out.append(
                _fused_fc1(cfg.intermediate_size, h, tp, hp + "mlp.", mp + "mlp.", split, by_view)
            )
            continue
        if cfg.num_shared_experts:
            inter = cfg.moe_intermediate_size * cfg.num_shared_experts
            hs, ms = hp + "mlp.shared_experts.", mp + "mlp.shared_experts."
            out.append(_fused_fc1(inter, h, tp, hs, ms, split, by_view))
        out += _stacked_experts(cfg, ep, hp + "mlp.experts.", mp + "mlp.experts.", split)
    return out


Splitter = Callable[[tuple[int, ...], int | None, int], tuple[tuple[int, Box], ...]]


def _fused_qkv(
    cfg: ModelConfig, tp: int, hp: str, mname: str, split: Splitter, by_view: bool
) -> _Mapped:
    """Megatron's ``linear_qkv``: per query group, its q heads then its k then its v."""
    h, d, groups = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    per = cfg.num_heads // groups
    if groups % tp:
        raise ConfigError(f"Megatron fused qkv needs {groups} KV heads to divide over tp {tp}")
    q, k, v = (hp + f"self_attn.{x}_proj.weight" for x in "qkv")
    shape = (groups * (per + 2) * d, h)

    def pack(sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
        parts = [sd[q].view(groups, per * d, h), sd[k].view(groups, d, h), sd[v].view(groups, d, h)]
        return torch.cat(parts, dim=1).reshape(shape)

    def unpack(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not by_view:
            fused, g = sd[mname], (per + 2) * d
            return {
                name: torch.cat([fused.narrow(0, i * g + at, rows) for i in range(groups)])
                for name, at, rows in ((q, 0, per * d), (k, per * d, d), (v, (per + 1) * d, d))
            }
        grouped = sd[mname].view(groups, per + 2, d, h)
        return {
            q: grouped.narrow(1, 0, per).reshape(groups * per * d, h),
            k: grouped.select(1, per).reshape(groups * d, h),
            v: grouped.select(1, per + 1).reshape(groups * d, h),
        }

    return _Mapped(TrainerTensor(mname, shape, split(shape, 0, tp)), pack, unpack)


def _fused_fc1(
    inter: int, h: int, tp: int, hp: str, mp: str, split: Splitter, by_view: bool
) -> _Mapped:
    """Megatron's ``linear_fc1``: rank r holds its gate rows then its up rows."""
    if inter % tp:
        raise ConfigError(f"intermediate size {inter} does not split over tp {tp}")
    gate, up, mname = hp + "gate_proj.weight", hp + "up_proj.weight", mp + "linear_fc1.weight"
    shape, rows = (2 * inter, h), inter // tp

    def pack(sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
        both = [sd[gate].view(tp, rows, h), sd[up].view(tp, rows, h)]
        return torch.cat(both, dim=1).reshape(shape)

    def unpack(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not by_view:
            fused = sd[mname]
            return {
                name: torch.cat([fused.narrow(0, (2 * r + half) * rows, rows) for r in range(tp)])
                for name, half in ((gate, 0), (up, 1))
            }
        per_rank = sd[mname].view(tp, 2, rows, h)
        return {
            gate: per_rank.select(1, 0).reshape(inter, h),
            up: per_rank.select(1, 1).reshape(inter, h),
        }

    return _Mapped(TrainerTensor(mname, shape, split(shape, 0, tp)), pack, unpack)


def _stacked_experts(cfg: ModelConfig, ep: int, hp: str, mp: str, split: Splitter) -> list[_Mapped]:
    """Routed experts stacked on dim 0 and split over EP ranks; fc1 holds each
    expert's gate rows then its up rows."""
    e, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if e % ep:
        raise ConfigError(f"{e} experts do not split over ep {ep}")
    fc1, fc2 = mp + "linear_fc1.weight", mp + "linear_fc2.weight"
    name = hp + "{}.{}_proj.weight"

    def pack1(sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.stack(
            [torch.cat([sd[name.format(x, "gate")], sd[name.format(x, "up")]]) for x in range(e)]
        )

    def unpack1(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for x in range(e):
            one = sd[fc1].select(0, x)
            out[name.format(x, "gate")] = one.narrow(0, 0, inter)
            out[name.format(x, "up")] = one.narrow(0, inter, inter)
        return out

    def pack2(sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.stack([sd[name.format(x, "down")] for x in range(e)])

    def unpack2(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name.format(x, "down"): sd[fc2].select(0, x) for x in range(e)}

    s1, s2 = (e, 2 * inter, h), (e, h, inter)
    return [
        _Mapped(TrainerTensor(fc1, s1, split(s1, 0, ep)), pack1, unpack1),
        _Mapped(TrainerTensor(fc2, s2, split(s2, 0, ep)), pack2, unpack2),
    ]
