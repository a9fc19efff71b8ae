"""Offloaded MoE layers with their slots in GPU memory (``CudaSlotMemory``).

Every test needs a CUDA device and skips, naming why, without one (the ``gpu``
fixture); the module also needs transformers. NOTE: written without a GPU; none of
these has run yet. The exactness tests run with deterministic kernels (cuBLAS
workspace configured before CUDA starts), where the offloaded model reads each
expert from a slot with the same kernel the all-resident model runs on its stacked
parameter.

The device check (one script, results under ``$OUT``), from the project root after
``make install`` and ``../shared/tools/device-pack``; the GPU image has no
transformers, so its wheels for Python 3.12 (transformers 5.x, huggingface-hub,
tokenizers, safetensors, regex, pyyaml, typer, tqdm) must travel in the pack too::

    source .device-pack/setup.sh
    python -m pytest -q -rs -p no:cacheprovider tests/gpu/test_offload_gpu.py \
        | tee $OUT/offload-tests.txt
    python -c 'from refitd.cli import main; raise SystemExit(main())' \
        bench offload --device cuda | tee $OUT/bench-offload.txt
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import pytest

# Before anything initialises cuBLAS: deterministic GEMMs need a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.experts import (
    CopyPlan,
    ExpertId,
    ExpertSlots,
    SlotDeviceError,
    SlotGeometry,
)
from refitd.experts.device import Bytes
from refitd.experts.inflight import CopyFence

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("gpu")]

transformers = pytest.importorskip("transformers")

SHAPE = {"layers": 3, "experts": 16, "top_k": 4, "hidden": 128, "moe_intermediate": 64}


def cpu_model(dtype: torch.dtype = torch.float32) -> Any:
    from refitd.bench.offload import build_model

    return build_model(**SHAPE, dtype=dtype, seed=0)


def decode(model: Any, prompt: Sequence[int], stream: Sequence[int]) -> torch.Tensor:
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        ids = torch.tensor([list(prompt)], device=device)
        out.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
        for t in stream:
            ids = torch.tensor([[t]], device=device)
            out.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1).cpu()


def resident_logits(prompt: Sequence[int], stream: Sequence[int]) -> torch.Tensor:
    model = cpu_model().to("cuda")
    return decode(model, prompt, stream)


@pytest.fixture(autouse=True, scope="module")
def deterministic() -> Any:
    previous = torch.are_deterministic_algorithms_enabled()
    # warn_only: an op with no deterministic kernel warns instead of failing the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous)


# ------------------------------------------------------------------------ the device


def test_cuda_slots_hold_the_host_rows_byte_for_byte_after_copies_and_prefetches() -> None:
    from refitd.experts.cuda import CudaSlotMemory
    from refitd.integrations.offload import HostExpertStore

    # 4 MiB rows, so an asynchronous copy is still running when the step waits on it.
    store = HostExpertStore(2, 8, [(1024, 1024), (1024, 512)], torch.float32, pin=True)
    g = torch.Generator().manual_seed(1)
    for layer in range(2):
        for e in range(8):
            store.write(
                layer, e, torch.randn(1024, 1024, generator=g), torch.randn(1024, 512, generator=g)
            )
    geometry = SlotGeometry(2, 8, store.row_bytes)
    device = CudaSlotMemory(geometry)
    slots = ExpertSlots(geometry)
    slots.apply_copy_plan(0, CopyPlan((0, 1, 2), (5, 6, 7)), store, device)
    slots.prefetch_copy_plan(1, CopyPlan((3, 4, 5, 6, 7), (0, 1, 2, 3, 4)), store, device)
    # In flight until its fence is waited on: no step may read it before then.
    assert slots.occupant(3) is None and slots.in_flight(3) == ExpertId(1, 0)
    slots.wait_for(range(8))  # the fence, never a sleep
    for slot, (layer, e) in enumerate(
        [(0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    ):
        for bank in (0, 1):
            want = torch.frombuffer(store.row(bank, layer, e), dtype=torch.uint8)  # type: ignore[arg-type]
            assert torch.equal(device.bank(bank)[slot].cpu(), want)
    assert device.copy_seconds() > 0.0 and device.prefetch_copy_seconds() > 0.0


def test_a_row_the_gpu_cannot_take_is_a_slot_device_error() -> None:
    from refitd.experts.cuda import CudaSlotMemory

    device = CudaSlotMemory(SlotGeometry(1, 2, (64, 32)))
    with pytest.raises(SlotDeviceError, match="not 64"):
        device.write_slot(0, 1, bytearray(48))


# ---------------------------------------------------------------------- exactness


@settings(max_examples=8, deadline=None)
@given(
    extra_slots=st.integers(0, 32),
    prefetch=st.booleans(),
    prompt=st.lists(st.integers(0, 1023), min_size=1, max_size=8),
    stream=st.lists(st.integers(0, 1023), min_size=1, max_size=12),
)
def test_offloaded_logits_on_the_gpu_equal_the_all_resident_models(
    extra_slots: int, prefetch: bool, prompt: list[int], stream: list[int]
) -> None:
    from refitd.integrations.offload import offload_experts

    want = resident_logits(prompt, stream)
    model = cpu_model()
    off = offload_experts(
        model, slots=SHAPE["experts"] + extra_slots, device="cuda", prefetch=prefetch
    )
    model.to("cuda")
    try:
        got = decode(model, prompt, stream)
    finally:
        off.close()
    assert torch.equal(got, want)


def test_a_refit_on_the_gpu_drops_the_stale_slots_and_the_logits_follow_it() -> None:
    from refitd.integrations.offload import moe_blocks, offload_experts

    ref = cpu_model()
    model = copy.deepcopy(ref)
    off = offload_experts(model, slots=SHAPE["layers"] * SHAPE["experts"], device="cuda")
    model.to("cuda")
    try:
        decode(model, list(range(16)), [1, 2])
        g = torch.Generator().manual_seed(3)
        block = moe_blocks(ref)[1]
        gu, dn = (
            block.get_parameter("experts.gate_up_proj"),
            block.get_parameter("experts.down_proj"),
        )
        new_gu = torch.randn((4, *gu.shape[1:]), generator=g) * 0.05
        new_dn = torch.randn((4, *dn.shape[1:]), generator=g) * 0.05
        with torch.no_grad():
            gu[:4].copy_(new_gu)
            dn[:4].copy_(new_dn)
        assert off.write_experts(1, [0, 1, 2, 3], new_gu, new_dn) > 0
        want = decode(ref.to("cuda"), [5, 6], [7, 8, 9])
        assert torch.equal(decode(model, [5, 6], [7, 8, 9]), want)
    finally:
        off.close()


def test_hybrid_mode_on_the_gpu_computes_unfetched_experts_on_the_cpu_closely() -> None:
    from refitd.integrations.offload import offload_experts

    want = resident_logits([1, 2, 3], list(range(10)))
    model = cpu_model()
    off = offload_experts(model, slots=SHAPE["experts"], device="cuda", max_fetch=1)
    model.to("cuda")
    try:
        got = decode(model, [1, 2, 3], list(range(10)))
        stats = off.stats()
    finally:
        off.close()
    assert stats.cpu > 0
    # The CPU's kernels are not the GPU's: close, not bit-equal.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------- failed copies


def flaky_cuda(every: int) -> Any:
    from refitd.experts.cuda import CudaSlotMemory

    class FlakyCudaSlotMemory(CudaSlotMemory):
        """Every ``every``-th plan refused: the fault a healthy GPU cannot be made to
        produce, written as an implementation of the interface."""

        calls = 0

        def _fail(self) -> bool:
            FlakyCudaSlotMemory.calls += 1
            return FlakyCudaSlotMemory.calls % every == 0

        def write_slot(self, bank: int, dst_slot: int, src: Bytes) -> None:
            if self._fail():
                raise SlotDeviceError("injected: copy refused")
            super().write_slot(bank, dst_slot, src)

        def write_slots_async(self, writes: Sequence[tuple[int, int, Bytes]]) -> CopyFence:
            if self._fail():
                raise SlotDeviceError("injected: plan refused")
            return super().write_slots_async(writes)

    return FlakyCudaSlotMemory


def test_failed_gpu_copies_cost_their_slots_never_the_answer() -> None:
    from refitd.integrations.offload import offload_experts

    want = resident_logits([1, 2], list(range(12)))
    model = cpu_model()
    cls = flaky_cuda(5)
    off = offload_experts(
        model, slots=SHAPE["experts"] + 8, device="cuda", slot_memory=lambda g: cls(g, "cuda")
    )
    model.to("cuda")
    try:
        got = decode(model, [1, 2], list(range(12)))
        stats = off.stats()
    finally:
        off.close()
    assert stats.failed_copies > 0
    # Experts whose copy failed were computed on the CPU: close, not bit-equal.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------ the bench


def test_the_offload_bench_runs_on_the_gpu_and_prints_its_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from refitd.cli import main

    small = ["--layers", "2", "--experts", "16", "--top-k", "4", "--hidden", "256"]
    small += ["--moe-intermediate", "128", "--tokens", "16", "--warmup", "4"]
    code = main(["bench", "offload", "--device", "cuda", *small])
    out = capsys.readouterr().out
    assert code == 0, out
    pairs = dict(p.split("=", 1) for p in out.strip().splitlines()[-1].split())
    assert pairs["device"] == "gpu"
    assert float(pairs["offload_tps_ratio_50"]) > 0.0
    assert float(pairs["naive_tps_ratio_50"]) > 0.0
