"""The toy-engine suite: real trainer layouts refitted into vLLM-shaped engine ranks.

For every engine rank: capture on a meta twin of the engine, plan against the trainer's
published shards, pull through the reference transport into a zeroed engine, and
compare every parameter bit for bit with the engine's own loader run on the full
checkpoint. Every element of the checkpoint holds a distinct value, so a misplaced,
missing or doubled element fails the comparison.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import pytest
import torch

from refitd.reshard.reads import InMemoryReadExecutor
from refitd.reshard.transfer_plan import TransferPlan, execute_transfer, plan_transfer
from refitd.reshard.types import CaptureResult
from refitd.testing.checkpoints import hf_manifest
from refitd.testing.engines import (
    EngineParallel,
    ModelConfig,
    ToyEngine,
    dense_toy_config,
    moe_toy_config,
)
from refitd.testing.layouts import (
    Published,
    capture_published,
    fsdp_dim0,
    full_state,
    megatron_tp_ep,
)

DENSE = dense_toy_config()
MOE = moe_toy_config()


def _truth(cfg: ModelConfig, par: EngineParallel, state: dict[str, torch.Tensor]) -> ToyEngine:
    engine = ToyEngine(cfg, par)
    engine.load_weights(state.items())
    return engine


# ---------------------------------------------------------------- engine behaviour


def test_meta_twin_has_the_real_engines_parameter_names_and_shapes() -> None:
    par = EngineParallel(tp_size=4, tp_rank=1, ep_size=2)
    real = ToyEngine(MOE, par)
    with torch.device("meta"):
        twin = ToyEngine(MOE, par)
    assert {n: p.shape for n, p in real.named_parameters()} == {
        n: p.shape for n, p in twin.named_parameters()
    }
    assert all(p.is_meta for p in twin.parameters())


def test_loader_writes_every_parameter_element_except_vocabulary_padding() -> None:
    state = full_state(DENSE)
    for rank in range(8):
        engine = _truth(DENSE, EngineParallel(8, rank), state)
        for name, param in engine.named_parameters():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                continue
            assert bool((param != 0).all()), f"rank {rank} left zeros in {name}"


def test_vocabulary_padding_rows_stay_zero_and_a_fully_padded_rank_holds_only_zeros() -> None:
    # 200 rows pad to 256; over 8 ranks of 32 rows, rank 6 holds 8 real rows, rank 7 none.
    state = full_state(DENSE)
    six = _truth(DENSE, EngineParallel(8, 6), state).model.embed_tokens.weight
    seven = _truth(DENSE, EngineParallel(8, 7), state).lm_head.weight
    assert torch.equal(six[:8], state["model.embed_tokens.weight"][192:200])
    assert bool((six[8:] == 0).all())
    assert bool((seven == 0).all())


def test_ranks_sharing_a_kv_head_hold_the_same_key_and_value_rows() -> None:
    # 2 KV heads over 8 ranks: ranks 0-3 share head 0, ranks 4-7 head 1.
    state = full_state(DENSE)
    qkv = [
        _truth(DENSE, EngineParallel(8, r), state).model.layers[0].self_attn.qkv_proj.weight
        for r in range(8)
    ]
    d = DENSE.head_dim
    k_full = state["model.layers.0.self_attn.k_proj.weight"]
    for r in range(8):
        assert torch.equal(qkv[r][d : 2 * d], k_full[(r // 4) * d : (r // 4 + 1) * d])
    assert not torch.equal(qkv[3][d:], qkv[4][d:])


def test_expert_parallel_rank_holds_only_its_contiguous_experts() -> None:
    state = full_state(MOE)
    engine = _truth(MOE, EngineParallel(4, 2, ep_size=4), state)  # experts 4 and 5
    w13 = engine.model.layers[1].mlp.experts.w13_weight
    inter = MOE.moe_intermediate_size
    for local, expert in enumerate((4, 5)):
        up = state[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"]
        assert torch.equal(w13[local, inter:], up)


def test_moe_tensor_parallel_narrows_each_expert_and_keeps_all_experts() -> None:
    state = full_state(MOE)
    engine = _truth(MOE, EngineParallel(2, 1, ep_size=1), state)
    w2 = engine.model.layers[2].mlp.experts.w2_weight
    half = MOE.moe_intermediate_size // 2
    down = state["model.layers.2.mlp.experts.7.down_proj.weight"]
    assert w2.shape[0] == MOE.num_experts
    assert torch.equal(w2[7], down[:, half:])


def test_mla_kv_b_is_stored_with_all_key_parts_before_all_value_parts() -> None:
    state = full_state(MOE)
    engine = _truth(MOE, EngineParallel(2, 1), state)
    kv_b = engine.model.layers[0].self_attn.kv_b_proj.weight
    nope, v, lora, heads = MOE.qk_nope_head_dim, MOE.v_head_dim, MOE.kv_lora_rank, 4
    full = state["model.layers.0.self_attn.kv_b_proj.weight"].view(-1, nope + v, lora)
    mine = full[heads : 2 * heads]
    assert torch.equal(kv_b[: heads * nope].view(heads, nope, lora), mine[:, :nope])
    assert torch.equal(kv_b[heads * nope :].view(heads, v, lora), mine[:, nope:])


def test_unknown_checkpoint_name_is_refused_with_its_name() -> None:
    from refitd.errors import PlanError

    with pytest.raises(PlanError, match=re.escape("model.layers.0.bogus.weight")):
        ToyEngine(DENSE).load_weights([("model.layers.0.bogus.weight", torch.zeros(1))])


# ---------------------------------------------------------------- refit through the planner


def _layouts(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """name -> (kind, size, ep): FSDP over 3 ranks (uneven blocks) and over 16 (ranks
    past the last row of small tensors hold nothing); Megatron TP 2
    (with EP 4 for MoE) whose fused tensors convert back by ``torch.cat`` of blocks or
    by view/select/reshape."""
    ep = 4 if cfg.num_experts else 1
    return {
        "fsdp3": ("fsdp", 3, 1),
        "fsdp16": ("fsdp", 16, 1),
        "megatron_tp2": ("cat", 2, ep),
        "megatron_tp2_by_view": ("view", 2, ep),
    }


def _publish(cfg: ModelConfig, layout: str, state: dict[str, torch.Tensor]) -> Published:
    kind, size, ep = _layouts(cfg)[layout]
    if kind == "fsdp":
        return fsdp_dim0(cfg, size, state)
    return megatron_tp_ep(cfg, size, ep, state, unfuse=kind)


def _capture(cfg: ModelConfig, par: EngineParallel, published: Published) -> CaptureResult:
    """Capture an engine rank's loads on its meta twin (no engine memory allocated)."""
    with torch.device("meta"):
        twin = ToyEngine(cfg, par)
    return capture_published(twin, published)


def _assert_pull_lands_exactly(
    plan: TransferPlan,
    cfg: ModelConfig,
    par: EngineParallel,
    state: dict[str, torch.Tensor],
    where: str,
) -> None:
    """Execute ``plan`` through the reference transport into a fresh engine rank and
    require every parameter to equal, bit for bit, the loader's result on ``state``."""
    engine = ToyEngine(cfg, par)
    params = dict(engine.named_parameters())
    execute_transfer(
        plan,
        resolve_param_ptr=lambda name: params[name].data_ptr(),
        transport=InMemoryReadExecutor(),
    )
    truth = dict(_truth(cfg, par, state).named_parameters())
    for name, param in params.items():
        assert torch.equal(param, truth[name]), f"{where}: {name}"


_STATE: dict[str, dict[str, torch.Tensor]] = {}


def _state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    key = cfg.attention
    if key not in _STATE:
        _STATE[key] = full_state(cfg)
    return _STATE[key]


def _cases() -> list[tuple[str, str, int, int]]:
    out = []
    for model, cfg in (("dense", DENSE), ("moe", MOE)):
        for layout in _layouts(cfg):
            for tp in (1, 2, 4, 8):
                for ep in sorted({1, tp}) if cfg.num_experts else [1]:
                    out.append((model, layout, tp, ep))
    return out


@pytest.mark.parametrize(("model", "layout", "tp", "ep"), _cases())
def test_every_engine_rank_equals_its_loader_on_the_full_checkpoint(
    model: str, layout: str, tp: int, ep: int
) -> None:
    cfg = DENSE if model == "dense" else MOE
    state = _state(cfg)
    published = _publish(cfg, layout, state)
    for rank in range(tp):
        par = EngineParallel(tp, rank, ep)
        capture = _capture(cfg, par, published)
        assert capture.unsupported == [], capture.unsupported_reasons
        assert capture.unattributed == 0

        plan = plan_transfer(capture, published.sources)
        assert plan.fallback == []
        assert plan.bytes_planned() >= plan.exact_bytes
        assert plan.bytes_planned() <= 1.02 * plan.exact_bytes

        _assert_pull_lands_exactly(plan, cfg, par, state, f"{layout} tp{tp} ep{ep} rank {rank}")


def test_the_checkpoint_manifest_names_every_tensor_the_engine_loads() -> None:
    names = [name for name, _dtype, _shape in hf_manifest(MOE)]
    seen = ToyEngine(MOE, EngineParallel(2, 0, 2)).load_weights(
        (name, tensor) for name, tensor in _state(MOE).items()
    )
    assert len(names) == len(set(names)) == len(_state(MOE))
    assert seen == {name for name, _ in ToyEngine(MOE, EngineParallel(2, 0, 2)).named_parameters()}


def test_stacked_expert_sources_reach_each_local_expert_through_unbind() -> None:
    # A convert may hand the engine one stacked tensor per projection (vLLM's fused
    # checkpoint path, expert_id=None): the loader unbinds it and keeps its own experts.
    cfg, state = MOE, _state(MOE)
    published = megatron_tp_ep(cfg, 2, 4, state)
    per_expert = published.convert
    assert per_expert is not None
    inter = cfg.moe_intermediate_size

    def stacked(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in per_expert(sd).items() if ".mlp.experts." not in k}
        for i in range(cfg.first_k_dense, cfg.num_layers):
            fc1 = sd[f"decoder.layers.{i}.mlp.experts.linear_fc1.weight"]
            hp = f"model.layers.{i}.mlp.experts."
            out[hp + "gate_proj.weight"] = fc1.narrow(1, 0, inter)
            out[hp + "up_proj.weight"] = fc1.narrow(1, inter, inter)
            out[hp + "down_proj.weight"] = sd[f"decoder.layers.{i}.mlp.experts.linear_fc2.weight"]
        return out

    published = dataclasses.replace(published, convert=stacked)
    for par in (EngineParallel(4, 1, ep_size=4), EngineParallel(4, 3, ep_size=2)):
        capture = _capture(cfg, par, published)
        assert capture.unsupported == [], capture.unsupported_reasons
        ops = {op[0] for c in capture.copies for op in c.op_chain}
        assert "unbind" in ops and "unsqueeze" not in ops  # the stacked path, not per expert
        plan = plan_transfer(capture, published.sources)
        assert plan.fallback == []
        _assert_pull_lands_exactly(plan, cfg, par, state, f"{par}")


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("layout", ["fsdp3", "megatron_tp2"])
@pytest.mark.parametrize(("budget", "packs"), [(1, True), (1, False), (4, True)])
def test_tight_descriptor_budgets_trade_reads_for_bytes_and_still_land_exactly(
    model: str, layout: str, budget: int, packs: bool
) -> None:
    # A budget of one read per copy forces pack specs, or full reads of bounding rows
    # replayed locally (or, where no rows bound the shards, exact reads over budget);
    # every parameter must still equal the loader's result.
    cfg = DENSE if model == "dense" else MOE
    state = _state(cfg)
    published = _publish(cfg, layout, state)
    traded = 0
    for rank in range(4):
        par = EngineParallel(4, rank, 2 if cfg.num_experts else 1)
        capture = _capture(cfg, par, published)
        plan = plan_transfer(capture, published.sources, budget, pack_specs=packs)
        assert plan.fallback == []
        assert plan.descriptor_count() <= plan.exact_descriptor_count
        if not packs:
            assert plan.packs == []
        # Sources split on dim 1 have no bounding rows to pull whole: they stay exact.
        traded += len(plan.packs) + len(plan.full_reads) + len(plan.unbounded_sources)
        _assert_pull_lands_exactly(plan, cfg, par, state, f"budget {budget} rank {rank}")
    assert traded > 0  # the budget really bound somewhere
