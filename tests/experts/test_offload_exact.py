"""Offloaded MoE layers compute exactly what the all-resident model computes, on the CPU.

Tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models built from their configs with random
weights (no hub). The reference is the same model with every expert resident, run
with transformers' eager experts loop; the offloaded copy must give bit-equal logits
for any pool size, policy, prefetch and hybrid setting, over prefill and decode with
a KV cache, through failed copies, and after a refit that rewrites experts.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.errors import ConfigError
from refitd.experts import (
    ExpectedReusePolicy,
    HitDensityPolicy,
    LruPolicy,
    SlotDeviceError,
    SlotGeometry,
)
from refitd.experts.device import Bytes
from refitd.experts.inflight import CopyFence
from refitd.integrations.offload import (
    ExpertOffload,
    HostExpertStore,
    OffloadedExperts,
    TorchSlotMemory,
    moe_blocks,
    offload_experts,
)

pytestmark = pytest.mark.timeout(600)

VOCAB = 64
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
POLICIES: dict[str, Callable[[], Any]] = {
    "ours": HitDensityPolicy,
    "lru": LruPolicy,
    "reuse": ExpectedReusePolicy,
}


@functools.cache
def reference(family: str) -> torch.nn.Module:
    """A tiny all-resident model of ``family`` (3 layers), eager experts, seeded."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=128,
        experts_implementation="eager",
    )
    if family == "qwen3_moe":
        cfg: Any = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=3,
        )
        cls: Any = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(
            **common,
            intermediate_size=16,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=2,
        )
        cls = tf.MixtralForCausalLM
    else:
        cfg = tf.DeepseekV3Config(
            **common,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):  # DeepSeek's routers start at zero
                p.normal_(std=0.5)
    return model


def num_experts(model: torch.nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per layer)."""
    blocks = moe_blocks(model)
    return len(blocks), int(blocks[0].get_parameter("experts.gate_up_proj").shape[0])


def run(model: torch.nn.Module, prompt: Sequence[int], decode: Sequence[int]) -> torch.Tensor:
    """Logits of a prefill of ``prompt`` then one-token decode steps over ``decode``,
    through a KV cache, concatenated over positions."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
    out = []
    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        out.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
        for t in decode:
            ids = torch.tensor([[t]])
            out.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def offloaded(family: str, **kwargs: Any) -> tuple[torch.nn.Module, ExpertOffload]:
    model = copy.deepcopy(reference(family))
    return model, offload_experts(model, **kwargs)


tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)


@settings(max_examples=15, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    extra_slots=st.integers(0, 24),
    policy=st.sampled_from(sorted(POLICIES)),
    prefetch=st.booleans(),
    hybrid=st.one_of(st.none(), st.integers(0, 3)),
    prompt=tokens,
    decode=tokens,
)
def test_offloaded_logits_are_bit_equal_to_the_all_resident_model(
    family: str,
    extra_slots: int,
    policy: str,
    prefetch: bool,
    hybrid: int | None,
    prompt: list[int],
    decode: list[int],
) -> None:
    want = run(reference(family), prompt, decode)
    layers, experts = num_experts(reference(family))
    slots = min(experts + extra_slots, layers * experts)
    model, off = offloaded(
        family, slots=slots, policy=POLICIES[policy](), prefetch=prefetch, max_fetch=hybrid
    )
    try:
        got = run(model, prompt, decode)
        stats = off.stats()
    finally:
        off.close()
    assert torch.equal(got, want)
    assert stats.routes == stats.hits + stats.fetched + stats.cpu
    if hybrid == 0:
        assert stats.fetched == 0  # every miss computed on the CPU
    assert stats.failed_copies == 0


def test_a_small_pool_misses_and_copies_yet_every_logit_matches() -> None:
    want = run(reference("qwen3_moe"), [1, 2, 3], list(range(20)))
    model, off = offloaded("qwen3_moe", slots=8)  # one layer's worth for three layers
    try:
        got = run(model, [1, 2, 3], list(range(20)))
        stats = off.stats()
    finally:
        off.close()
    assert torch.equal(got, want)
    assert 0.0 < stats.hit_rate < 1.0
    assert stats.copied_bytes > 0 and stats.prefetched_bytes > 0
    assert stats.prefetch_used > 0


def test_on_demand_loading_with_no_cache_copies_every_route_and_still_matches() -> None:
    want = run(reference("mixtral"), [5, 6], [7, 8, 9, 10])
    model, off = offloaded("mixtral", slots=6, cache=False)
    try:
        got = run(model, [5, 6], [7, 8, 9, 10])
        stats = off.stats()
    finally:
        off.close()
    assert torch.equal(got, want)
    assert stats.hits == 0 and stats.fetched == stats.routes
    assert stats.prefetched_bytes == 0


def test_the_offloaded_model_holds_no_expert_weights() -> None:
    model, off = offloaded("qwen3_moe", slots=8)
    try:
        names = [n for n, _ in model.named_parameters()]
        assert not [n for n in names if "experts" in n]
        assert all(
            isinstance(b.get_submodule("experts"), OffloadedExperts) for b in moe_blocks(model)
        )
        with pytest.raises(ConfigError, match="offloaded already"):
            offload_experts(model, slots=8)
    finally:
        off.close()


# --------------------------------------------------------------------------------- refit


def rewrite(
    family: str,
    reference_model: torch.nn.Module,
    off: ExpertOffload,
    layer: int,
    experts: Sequence[int],
    seed: int,
) -> int:
    """New random weights for ``experts`` of MoE layer ``layer``: written into the
    reference's parameters and through the offload's refit; returns slots dropped."""
    block = moe_blocks(reference_model)[layer]
    gate_up = block.get_parameter("experts.gate_up_proj")
    down = block.get_parameter("experts.down_proj")
    g = torch.Generator().manual_seed(seed)
    new_gu = torch.randn((len(experts), *gate_up.shape[1:]), generator=g) * 0.05
    new_dn = torch.randn((len(experts), *down.shape[1:]), generator=g) * 0.05
    with torch.no_grad():
        for i, e in enumerate(experts):
            gate_up[e].copy_(new_gu[i])
            down[e].copy_(new_dn[i])
    return off.write_experts(layer, experts, new_gu, new_dn)


@settings(max_examples=8, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    extra_slots=st.integers(0, 16),
    prefetch=st.booleans(),
    layer=st.integers(0, 1),
    rewritten=st.sets(st.integers(0, 5), min_size=1, max_size=4),
    pending=st.booleans(),
    before=tokens,
    after=tokens,
)
def test_after_a_refit_that_rewrites_experts_the_logits_match_the_refitted_model(
    family: str,
    extra_slots: int,
    prefetch: bool,
    layer: int,
    rewritten: set[int],
    pending: bool,
    before: list[int],
    after: list[int],
) -> None:
    ref = copy.deepcopy(reference(family))
    layers, experts = num_experts(ref)
    model, off = offloaded(family, slots=min(experts + extra_slots, layers * experts))
    off.prefetch = prefetch
    try:
        assert torch.equal(run(model, [1], before), run(ref, [1], before))
        if pending:  # old rows of the rewritten experts still being copied in
            pre = off.cache.prefetch(layer, sorted(rewritten))
            off.slots.prefetch_copy_plan(layer, pre.copy, off.store, off.slot_device)
        rewrite(family, ref, off, layer, sorted(rewritten), seed=len(before))
        assert all(off.cache.slot_of(layer, e) is None for e in rewritten)
        assert torch.equal(run(model, [2], after), run(ref, [2], after))
    finally:
        off.close()


def test_a_refit_drops_exactly_the_stale_slots_and_without_that_the_logits_go_wrong() -> None:
    ref = copy.deepcopy(reference("qwen3_moe"))
    layers, experts = num_experts(ref)
    prompt = list(range(12))  # a prefill routes every expert of every layer
    # Every expert fits: nothing is evicted, so a stale slot would be read.
    model, off = offloaded("qwen3_moe", slots=layers * experts)
    stale_model, stale = offloaded("qwen3_moe", slots=layers * experts)
    try:
        run(model, prompt, [])
        run(stale_model, prompt, [])
        assert all(off.cache.slot_of(0, e) is not None for e in range(experts))
        dropped = rewrite("qwen3_moe", ref, off, 0, list(range(experts)), seed=7)
        assert dropped == experts
        assert all(off.cache.slot_of(0, e) is None for e in range(experts))
        assert all(off.cache.slot_of(1, e) is not None for e in range(experts))
        # The same rows rewritten behind the cache's back: its slots keep the old bytes.
        block = moe_blocks(ref)[0]
        for e in range(experts):
            stale.store.write(
                0,
                e,
                block.get_parameter("experts.gate_up_proj")[e],
                block.get_parameter("experts.down_proj")[e],
            )
        want = run(ref, [3], [4, 5])
        assert torch.equal(run(model, [3], [4, 5]), want)
        assert not torch.equal(run(stale_model, [3], [4, 5]), want)
    finally:
        off.close()
        stale.close()


# ------------------------------------------------------------------------- failed copies


class FlakySlotMemory(TorchSlotMemory):
    """Slots whose every ``every``-th copy fails, synchronous or not: the fault a CPU
    copy cannot be made to produce, written as an implementation of the interface."""

    def __init__(self, geometry: SlotGeometry, every: int) -> None:
        super().__init__(geometry)
        self.every, self.calls, self.failed = every, 0, 0

    def _fail(self) -> bool:
        self.calls += 1
        if self.calls % self.every == 0:
            self.failed += 1
            return True
        return False

    def write_slot(self, bank: int, dst_slot: int, src: Bytes) -> None:
        if self._fail():
            raise SlotDeviceError(f"injected: copy {self.calls} into slot {dst_slot} refused")
        super().write_slot(bank, dst_slot, src)

    def write_slots_async(self, writes: Sequence[tuple[int, int, Bytes]]) -> CopyFence:
        if self._fail():
            fail = SlotDeviceError(f"injected: asynchronous plan {self.calls} failed")

            def job() -> None:
                raise fail

            return self._copier.submit(job)
        return super().write_slots_async(writes)


@pytest.mark.parametrize("every", [2, 3, 7])
def test_failed_copies_cost_their_slots_never_the_answer(every: int) -> None:
    devices: list[FlakySlotMemory] = []

    def flaky(geometry: SlotGeometry) -> FlakySlotMemory:
        devices.append(FlakySlotMemory(geometry, every))
        return devices[-1]

    want = run(reference("qwen3_moe"), [1, 2], list(range(16)))
    model, off = offloaded("qwen3_moe", slots=10, slot_memory=flaky)
    try:
        got = run(model, [1, 2], list(range(16)))
        stats = off.stats()
    finally:
        off.close()
    assert torch.equal(got, want)
    assert devices[0].failed > 0
    assert stats.failed_copies > 0
    # Every slot the cache names holds that expert: no failed copy is ever read.
    for slot in range(off.geometry.slots):
        named = off.cache.resident_in(slot)
        if named is not None:
            assert off.slots.occupant(slot) == named


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/gpu/ runs the device")
def test_slots_on_a_gpu_that_is_not_there_are_refused_and_the_model_is_left_as_it_was() -> None:
    from refitd.experts.cuda import CudaSlotMemory, cuda_available

    assert not cuda_available()
    with pytest.raises(ConfigError, match="CUDA"):
        CudaSlotMemory(SlotGeometry(1, 2, (8, 8)))
    model = copy.deepcopy(reference("mixtral"))
    with pytest.raises(ConfigError, match="CUDA"):
        offload_experts(model, slots=6, device="cuda")
    with pytest.raises(ConfigError, match="smaller than one layer"):
        offload_experts(model, slots=5)
    assert not any(
        isinstance(b.get_submodule("experts"), OffloadedExperts) for b in moe_blocks(model)
    )
    assert torch.equal(run(model, [1, 2], [3]), run(reference("mixtral"), [1, 2], [3]))


def test_host_rows_in_a_shared_segment_serve_the_model_and_a_refit_written_there_is_followed() -> (
    None
):
    from multiprocessing import shared_memory

    ref = copy.deepcopy(reference("qwen3_moe"))
    layers, experts = num_experts(ref)
    gu0 = moe_blocks(ref)[0].get_parameter("experts.gate_up_proj")
    dn0 = moe_blocks(ref)[0].get_parameter("experts.down_proj")
    row_bytes = (gu0[0].numel() * 4, dn0[0].numel() * 4)
    segment = shared_memory.SharedMemory(
        create=True, size=HostExpertStore.nbytes(layers, experts, row_bytes)
    )
    model = copy.deepcopy(ref)
    off = offload_experts(model, slots=layers * experts, host_buffer=segment.buf)
    try:
        # The prefill routes every expert: all are resident after it.
        assert torch.equal(run(model, list(range(12)), [4, 5]), run(ref, list(range(12)), [4, 5]))
        # A refit writes expert 2 of MoE layer 0 into the segment at the daemon pool's
        # host layout (bank b at its offset, rows layer-major), as a pull would.
        new_gu, new_dn = torch.randn_like(gu0[2]) * 0.05, torch.randn_like(dn0[2]) * 0.05
        with torch.no_grad():
            gu0[2].copy_(new_gu)
            dn0[2].copy_(new_dn)
        bank_at = (0, layers * experts * row_bytes[0])
        for bank, w in enumerate((new_gu, new_dn)):
            at = bank_at[bank] + (0 * experts + 2) * row_bytes[bank]
            segment.buf[at : at + row_bytes[bank]] = (
                w.contiguous().view(torch.uint8).numpy().tobytes()
            )
        assert off.invalidate([(0, 2)]) == 1
        assert torch.equal(run(model, list(range(12)), [6]), run(ref, list(range(12)), [6]))
    finally:
        off.close()
        segment.unlink()
    del off, model
    gc.collect()  # the store's views of the segment go with the model
    segment.close()


def test_a_model_configured_for_grouped_experts_is_offloaded_to_the_eager_loop() -> None:
    # transformers' default experts implementation is a grouped kernel; the offloaded
    # layers compute as the eager loop does, whatever the config says.
    model = copy.deepcopy(reference("qwen3_moe"))
    model.config._experts_implementation = "grouped_mm"
    grouped = run(model, [1, 2, 3], [4, 5])
    off = offload_experts(model, slots=8)
    try:
        got = run(model, [1, 2, 3], [4, 5])
    finally:
        off.close()
    assert torch.equal(got, run(reference("qwen3_moe"), [1, 2, 3], [4, 5]))
    torch.testing.assert_close(got, grouped)  # equal but for float rounding
