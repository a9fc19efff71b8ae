"""Quantized refit on a real vLLM engine (CPU): a bf16 trainer refits a W8A8 INT8 engine.

One ``LLM`` serves the module: a tiny dense Llama loaded from a compressed-tensors
W8A8 checkpoint (int8 weights with per-output-channel scales; the config written by
the library's ``W8A8`` preset), with ``weight_transfer_config={"backend": "refitd"}``
and a real ``refitd serve`` next to it. The trainers hold bf16 weights and publish
through :class:`~refitd.integrations.quant.QuantizingSource`. Truth is a fresh ``LLM``
loaded from the quantized checkpoint the same quantizer writes from the same bf16
weights: every parameter and buffer bit for bit (the scales and the ``azp_adj`` that
post-load processing derives), the output of every quantized linear on a fixed input
(its repacked oneDNN weight is not readable; what it computes is), and the greedy
tokens and logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.vllm_world import fresh_serving, refit_engine, vllm_daemon
from vllm_models import (
    LLAMA,
    greedy_logprobs,
    hf_model,
    loader_format_mismatches,
    run_fsdp_trainer,
    same_tensors,
)

from refitd.integrations.quant import (
    QuantizingSource,
    checkpoint_modules,
    quantization_config,
    save_quantized_model,
)

pytestmark = pytest.mark.timeout(900)

TRUTH_SEEDS = (3, 4)
"""The bf16 weights whose fresh quantized load the refits are judged against."""


@dataclass
class World:
    root: Path
    url: str
    llm: Any
    truths: dict[int, tuple[dict[str, Any], Any]]
    """Bf16 seed -> what a fresh ``LLM`` of its quantized checkpoint served."""


def bf16_state(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf_model(LLAMA, seed).state_dict().items()}


def write_quantized(path: Path, state: dict[str, torch.Tensor]) -> Path:
    return save_quantized_model(path, LLAMA, state, quantization_config("int8"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with vllm_daemon(tmp_path_factory, "quant") as url:
        root = tmp_path_factory.mktemp("models")
        # The truths first: one in-process engine at a time (vLLM's parallel state is
        # per process), so the fresh loads run before the refitted engine starts.
        truths = {
            seed: fresh_load(write_quantized(root / f"truth{seed}", bf16_state(seed)))
            for seed in TRUTH_SEEDS
        }
        write_quantized(root / "engine", bf16_state(1))
        with refit_engine(root / "engine") as llm:
            yield World(root, url, llm, truths)


# ---------------------------------------------------------------- what an engine serves


def served_state(worker: Any) -> dict[str, Any]:
    """Run in a vLLM worker: every parameter and buffer the model computes with (all
    names, shared ones included), and each quantized linear's output on a fixed input."""
    model = worker.model_runner.get_model()
    tensors = {
        n: t.detach().clone()
        for n, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    }
    outputs = {}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            method = type(getattr(module, "quant_method", None)).__name__
            if method == "CompressedTensorsLinearMethod":
                x = torch.randn(3, module.input_size, generator=g).to(torch.bfloat16)
                out = module(x)
                outputs[name] = (out[0] if isinstance(out, tuple) else out).clone()
    return {"tensors": tensors, "outputs": outputs}


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Names whose tensors (or linear outputs) differ, bit for bit, or exist on one side."""
    out = []
    for kind in ("tensors", "outputs"):
        a, b = got[kind], want[kind]
        out += [f"{kind}: only one side has {n}" for n in sorted(set(a) ^ set(b))]
        out += [
            f"{kind}: {n}"
            for n in sorted(set(a) & set(b))
            if a[n].dtype != b[n].dtype
            or a[n].shape != b[n].shape
            or not torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8))
        ]
    return out


def fresh_load(checkpoint: Path) -> tuple[dict[str, Any], Any]:
    """What a fresh ``LLM`` loaded from ``checkpoint`` serves."""
    return fresh_serving(
        checkpoint, lambda fresh: (fresh.collective_rpc(served_state)[0], greedy_logprobs(fresh))
    )


def stats(llm: Any) -> dict[str, Any]:
    from refitd.integrations.vllm.worker import refit_stats

    [only] = llm.collective_rpc(refit_stats)
    return dict(only)


def checkpoint_mismatches(worker: Any, checkpoint: str) -> list[str]:
    """Run in a vLLM worker: the refit's destinations that differ from the engine's own
    loaders reading ``checkpoint``, but the KV-cache scales an unquantized KV cache
    never loads (the refit leaves them as the engine set them)."""
    computed = set(worker.weight_transfer_engine._computed)
    return [n for n in loader_format_mismatches(worker, checkpoint) if n not in computed]


def mismatches(llm: Any, checkpoint: Path) -> list[str]:
    [only] = llm.collective_rpc(
        checkpoint_mismatches, args=(str(checkpoint / "model.safetensors"),)
    )
    return list(only)


def trainer(world: World, source: Any, model: str = "llama") -> Any:
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    info = RefitdTrainerInitInfo(rank=0, model=model, url=world.url)
    return RefitdTrainerEngine.trainer_init(info, client=LLMSyncClient(world.llm), source=source)


# ---------------------------------------------------------------- tests


def test_a_quantized_manifest_missing_a_scale_is_refused_before_any_byte_moves(
    world: World,
) -> None:
    from refitd.integrations.sources import TensorSource

    before = (world.llm.collective_rpc(served_state)[0], greedy_logprobs(world.llm))
    dropped = "model.layers.1.self_attn.k_proj.weight_scale"

    class WithoutOneScale:
        """The quantizing source's shards but one scale: a broken trainer."""

        def __init__(self, inner: QuantizingSource) -> None:
            self.inner = inner

        def shards(self) -> Iterator[Any]:
            return (s for s in self.inner.shards() if s.name != dropped)

    inner = QuantizingSource(
        TensorSource(bf16_state(6)), world.root / "engine", checkpoint_modules(LLAMA)
    )
    t = trainer(world, WithoutOneScale(inner), model="no-scale")
    try:
        with pytest.raises(
            Exception, match=r"unwritten.*model\.layers\.1\.self_attn\.qkv_proj\.weight_scale"
        ):
            t.send_weights()
    finally:
        t.shutdown()
    after = (world.llm.collective_rpc(served_state)[0], greedy_logprobs(world.llm))
    assert differences(after[0], before[0]) == [] and after[1] == before[1]


def test_a_bf16_trainer_refits_a_w8a8_engine_as_a_fresh_quantized_load_and_the_next_update_replays(
    world: World,
) -> None:
    from refitd.integrations.sources import TensorSource

    state = bf16_state(2)
    modules = checkpoint_modules(LLAMA)
    source = QuantizingSource(TensorSource(state), world.root / "engine", modules)
    served: list[Any] = []
    refits: list[dict[str, Any]] = []
    t = trainer(world, source, model="one-rank")
    try:
        for seed in (2, 3):
            fresh = bf16_state(seed)
            for name, tensor in state.items():  # the trainer's tensors, updated in place
                tensor.copy_(fresh[name])
            t.send_weights()
            refits.append(stats(world.llm))
            assert mismatches(world.llm, write_quantized(world.root / f"one{seed}", state)) == []
            served.append((world.llm.collective_rpc(served_state)[0], greedy_logprobs(world.llm)))
    finally:
        t.shutdown()
    assert [(r["replayed"], r["plans"]) for r in refits] == [(False, 1), (True, 1)]
    assert refits[0]["bytes"] == refits[1]["bytes"] == source.wire_bytes
    quantized = source.schemes  # int8 plus float32 scales per row; the rest as bf16
    assert source.wire_bytes == sum(
        t.numel() + t.shape[0] * 4 if n in quantized else t.numel() * 2 for n, t in state.items()
    )
    assert served[0][1] != served[1][1]

    truth, truth_tokens = world.truths[3]
    assert differences(served[1][0], truth) == []
    assert served[1][1] == truth_tokens


def test_an_fsdp2_trainer_refits_a_w8a8_engine_exactly_from_each_ranks_own_rows(
    world: World,
) -> None:
    seen: list[tuple[str, dict[str, Any], Any, Any, list[str]]] = []

    def on_event(message: Any) -> Any:
        _, _version, checkpoint, _timing = message
        wrong = mismatches(world.llm, Path(checkpoint))
        seen.append(
            (
                checkpoint,
                stats(world.llm),
                world.llm.collective_rpc(served_state)[0],
                greedy_logprobs(world.llm),
                wrong,
            )
        )
        return ("ok", None)

    job = {
        "config": LLAMA,
        "seeds": [4, 5],
        "model": "fsdp",
        "url": world.url,
        "out": str(world.root / "fsdp"),
        "quant": "int8",
    }
    assert run_fsdp_trainer(job, on_event, world.llm) == [0, 0]
    (ck1, s1, live1, served1, wrong1), (_, s2, _, served2, wrong2) = seen
    assert wrong1 == wrong2 == []
    assert (s1["replayed"], s2["replayed"], s2["plans"] - s1["plans"]) == (False, True, 0)
    assert served1 != served2
    # The trainer's checkpoint of seed 4 is the one the fixture's truth was loaded from.
    assert same_tensors(Path(ck1), world.root / "truth4")
    truth, truth_tokens = world.truths[4]
    assert differences(live1, truth) == []
    assert served1 == truth_tokens
