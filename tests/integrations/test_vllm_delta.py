"""The vLLM backend refits by delta: a tied Llama (its ``lm_head`` computes from the
embeddings through a GEMM kernel its post-load processing packs) updated by one full
refit and then two deltas serves exactly what a fresh load of the last weights
serves: greedy tokens, top logprobs at every step, every parameter.

The daemon runs with ``[pulls] deltas = true``; the trainer double-buffers its
rounds (``buffers=2``); the workers refit with ``delta=True``, their post-load
processing run inside each delta (rolled back with it). docs/delta.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.vllm_world import fresh_serving, refit_engine, vllm_daemon
from vllm_models import (
    LLAMA,
    greedy_logprobs,
    hf_model,
    param_digests,
    save_model,
)

pytestmark = pytest.mark.timeout(600)

CONFIG = {**LLAMA, "tie_word_embeddings": True}


def stepped(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """``state`` with a fraction ``frac`` of every tensor's values moved by one ulp."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        bits = t.view(torch.int16).reshape(-1)
        bits[torch.rand(bits.numel(), generator=g) < frac] += 1
        out[name] = t
    return out


@pytest.fixture(scope="module")
def daemon_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with vllm_daemon(tmp_path_factory, "delta", "pulls.deltas=true") as url:
        yield url


def test_a_tied_llama_refitted_by_deltas_serves_what_a_fresh_load_serves(
    daemon_url: str, tmp_path: Path
) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    a = {k: v.detach().clone() for k, v in hf_model(CONFIG, 21).state_dict().items()}
    del a["lm_head.weight"]  # tied: what Hugging Face saves
    b = stepped(a, 0.02, 1)
    c = stepped(b, 0.02, 2)
    save_model(tmp_path / "a", CONFIG, a)
    save_model(tmp_path / "c", CONFIG, c)
    truth_tokens, [truth_params] = fresh_serving(
        tmp_path / "c", lambda fresh: (greedy_logprobs(fresh), fresh.collective_rpc(param_digests))
    )
    with refit_engine(tmp_path / "a") as llm:
        tensors = {n: t.clone() for n, t in a.items()}
        info = RefitdTrainerInitInfo(
            rank=0, model="delta-llama", url=daemon_url, buffers=2, worker={"delta": True}
        )
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=LLMSyncClient(llm), source=TensorSource(tensors)
        )
        try:
            assert greedy_logprobs(llm) != truth_tokens, "A must serve otherwise than C"
            kinds = []
            for state in (a, b, c):
                for name, t in tensors.items():
                    t.copy_(state[name])
                trainer.send_weights()
                [stats] = llm.collective_rpc(refit_stats)
                kinds.append((stats["kind"], stats["reason"]))
            assert [k for k, _ in kinds] == ["full", "delta", "delta"], kinds
            [params] = llm.collective_rpc(param_digests)
            assert [n for n in truth_params if params.get(n) != truth_params[n]] == []
            assert greedy_logprobs(llm) == truth_tokens
        finally:
            trainer.shutdown()
