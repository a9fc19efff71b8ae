"""Trainer layouts publish exactly the boxes a trainer holds, under its own names."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from refitd.errors import ConfigError
from refitd.testing.engines import dense_toy_config, moe_toy_config
from refitd.testing.layouts import (
    SYNTHETIC_RANK_SPAN,
    Published,
    fsdp_dim0,
    full_state,
    megatron_tp_ep,
)

DENSE = dense_toy_config()
MOE = moe_toy_config()


def _read_shard(shard: object, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(shard.shape)  # type: ignore[attr-defined]
    n = 1
    for d in shape:
        n *= d
    raw = (ctypes.c_uint8 * (n * dtype.itemsize)).from_address(shard.addr)  # type: ignore[attr-defined]
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)


def _rebuild(published: Published) -> dict[str, torch.Tensor]:
    """Every trainer tensor reassembled from its shards' bytes; replicas must agree and
    every element must be covered."""
    out = {}
    for name, info in published.sources.items():
        full = torch.zeros(info.global_shape, dtype=info.dtype)
        covered = torch.zeros(info.global_shape, dtype=torch.bool)
        for shard in info.shards:
            box, seen = full, covered
            for d, (o, k) in enumerate(zip(shard.shard_offset, shard.shape)):
                box, seen = box.narrow(d, o, k), seen.narrow(d, o, k)
            data = _read_shard(shard, info.dtype)
            if bool(seen.any()):
                assert torch.equal(box[seen], data[seen]), f"replicas of {name} disagree"
            box.copy_(data)
            seen.fill_(True)
        assert bool(covered.all()), f"{name} is not fully published"
        out[name] = full
    return out


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize(
    "make",
    [
        lambda c, s: fsdp_dim0(c, 3, s),
        lambda c, s: fsdp_dim0(c, 16, s),
        lambda c, s: megatron_tp_ep(c, 2, 1, s),
        lambda c, s: megatron_tp_ep(c, 2, 4 if c.num_experts else 2, s),
        lambda c, s: megatron_tp_ep(c, 2, 4 if c.num_experts else 2, s, unfuse="view"),
    ],
    ids=["fsdp3", "fsdp16", "megatron_tp2", "megatron_tp2_ep", "megatron_by_view"],
)
def test_published_bytes_reassemble_and_convert_back_to_the_checkpoint(cfg, make) -> None:  # type: ignore[no-untyped-def]
    state = full_state(cfg)
    published = make(cfg, state)
    trainer = _rebuild(published)
    checkpoint = published.convert(trainer) if published.convert else trainer
    assert set(checkpoint) == set(state)
    for name, tensor in state.items():
        assert torch.equal(checkpoint[name], tensor), name


def test_fsdp_blocks_are_ceil_sized_with_a_short_last_block() -> None:
    published = fsdp_dim0(DENSE, 3)
    norm = published.sources["model.norm.weight"]  # 32 rows over 3 ranks
    assert [(s.shard_offset, s.shape) for s in norm.shards] == [
        ((0,), (11,)),
        ((11,), (11,)),
        ((22,), (10,)),
    ]


def test_fsdp_ranks_past_the_last_row_publish_no_shard() -> None:
    published = fsdp_dim0(DENSE, 16)
    k_proj = published.sources["model.layers.0.self_attn.k_proj.weight"]  # 8 rows
    assert [s.session for s in k_proj.shards] == [f"fsdp{r}" for r in range(8)]
    assert all(s.shape == (1, DENSE.hidden_size) for s in k_proj.shards)


def test_a_ranks_shards_sit_back_to_back_in_its_buffer() -> None:
    published = fsdp_dim0(DENSE, 4, full_state(DENSE))
    for session, buf in published.buffers.items():
        shards = sorted(
            (s for info in published.sources.values() for s in info.shards if s.session == session),
            key=lambda s: s.addr,
        )
        assert shards[0].addr == buf.data_ptr()
        for before, after in itertools.pairwise(shards):
            n = 1
            for d in before.shape:
                n *= d
            assert after.addr == before.addr + n * before.elsize
        last = shards[-1]
        assert (
            last.addr + last.elsize * torch.Size(last.shape).numel() == buf.data_ptr() + buf.numel()
        )


def test_synthetic_layout_allocates_nothing_and_keeps_each_rank_in_its_own_span() -> None:
    published = megatron_tp_ep(MOE, 2, 4)
    assert published.buffers == {}
    for info in published.sources.values():
        for s in info.shards:
            rank = int(s.session.removeprefix("megatron"))
            assert (rank + 1) * SYNTHETIC_RANK_SPAN <= s.addr < (rank + 2) * SYNTHETIC_RANK_SPAN


def test_megatron_splits_columns_on_dim0_rows_on_dim1_and_replicates_norms() -> None:
    sources = megatron_tp_ep(MOE, 2, 4).sources
    q_up = sources["decoder.layers.0.self_attention.linear_q_up_proj.weight"]
    proj = sources["decoder.layers.0.self_attention.linear_proj.weight"]
    norm = sources["decoder.layers.0.input_layernorm.weight"]
    rows, cols = q_up.global_shape[0] // 2, proj.global_shape[1] // 2
    # World is max(tp, ep) = 4: ranks 2 and 3 hold data-parallel replicas.
    assert [s.shard_offset for s in q_up.shards] == [(0, 0), (rows, 0), (0, 0), (rows, 0)]
    assert [s.shard_offset for s in proj.shards] == [(0, 0), (0, cols), (0, 0), (0, cols)]
    assert [s.shape for s in norm.shards] == [norm.global_shape] * 4


def test_megatron_stacks_experts_and_gives_each_ep_rank_a_contiguous_range() -> None:
    sources = megatron_tp_ep(MOE, 2, 4).sources
    fc1 = sources["decoder.layers.1.mlp.experts.linear_fc1.weight"]
    assert fc1.global_shape == (8, 2 * MOE.moe_intermediate_size, MOE.hidden_size)
    assert [(s.session, s.shard_offset[0], s.shape[0]) for s in fc1.shards] == [
        (f"megatron{r}", 2 * r, 2) for r in range(4)
    ]


def test_megatron_pads_the_vocabulary_to_128_rows_per_tp_rank() -> None:
    sources = megatron_tp_ep(DENSE, 2).sources
    assert sources["embedding.word_embeddings.weight"].global_shape == (256, DENSE.hidden_size)
    assert [s.shape[0] for s in sources["output_layer.weight"].shards] == [128, 128]


def test_megatron_refuses_more_tp_ranks_than_kv_heads_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="2 KV heads"):
        megatron_tp_ep(DENSE, 4)


def test_megatron_refuses_an_unknown_way_to_unfuse() -> None:
    with pytest.raises(ConfigError, match="unfuse"):
        megatron_tp_ep(DENSE, 2, unfuse="guess")


def test_megatron_refuses_tp_and_ep_that_do_not_divide_each_other() -> None:
    with pytest.raises(ConfigError, match="divide each other"):
        megatron_tp_ep(MOE, 2, 3)
