"""gpt-oss refits exactly on two tensor-parallel ranks (issue 48).

vLLM's gpt-oss ``load_weights`` writes the experts (gate and up interleaved in one
``[E, H, 2I]`` tensor, each rank taking its columns and transposing them), their
biases and the attention sinks (each rank its heads) into the parameters itself,
outside every ``weight_loader``; on every rank but the first it zeroes the
down-projection bias it reads before copying it in. ``test_vllm_families`` judges
the TP 1 engine. Here a TP 2 engine (a worker process per rank) refits to what a
fresh TP 2 load of the same weights serves: greedy tokens, the top logprobs at every
step, and every parameter of every rank, first update and replay.

One engine, loaded fresh from B: what it serves then, and every parameter of every
rank, is the truth. vLLM's in-place ``reload_weights`` is no truth for this family
(measured at TP 2, an engine loaded with A and reloaded from B keeps A's attention
sinks, experts and expert biases: the parameters ``load_weights`` writes outside a
``weight_loader``, which the layer-wise reload does not replay), so nothing is
reloaded: the engine's parameters are overwritten with noise, and it refits to B (the
first update), to A (a replay, which must serve otherwise) and, noise again, to B (a
replay). B's two refits must rebuild every parameter from the refit's bytes alone.

A module of its own: its engines must not share a test process with another
in-process engine (vLLM's parallel state is one per process).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from test_vllm_families import Family, checkpoint_state
from vllm_models import (
    GPT_OSS,
    greedy_logprobs,
    llm_kwargs,
    param_digests,
    poison_weights,
    save_model,
    stop_engine,
)

pytestmark = pytest.mark.timeout(900)


def served(llm: Any) -> tuple[Any, list[dict[str, str]]]:
    """Tokens and top logprobs, and every rank's parameter digests."""
    return greedy_logprobs(llm), llm.collective_rpc(param_digests)


def test_a_tp2_gpt_oss_engine_refits_to_what_a_fresh_tp2_load_serves_first_update_and_replay(
    vllm_daemon_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a worker process per rank
    from vllm import LLM

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    family = Family("gpt-oss-tp2", GPT_OSS)
    a = checkpoint_state(family, 11, retie=False)
    b = checkpoint_state(family, 12, retie=True)
    save_model(tmp_path / "b", family.config, b)
    # One sequence a step: with worker processes two prompts share a step in some
    # generations and not in others (see test_vllm_mla); one a step serves one answer.
    tp2 = {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "max_num_seqs": 1,
        **llm_kwargs(),
    }
    llm = LLM(model=str(tmp_path / "b"), weight_transfer_config={"backend": "refitd"}, **tp2)
    try:
        truth_b = served(llm)
        tensors = {n: t.clone() for n, t in b.items()}
        info = RefitdTrainerInitInfo(rank=0, model=family.name, url=vllm_daemon_url)
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=LLMSyncClient(llm), source=TensorSource(tensors)
        )
        try:
            assert served(llm) == truth_b  # the init changed nothing served
            for i, weights in enumerate([b, a, b]):
                if weights is b:  # noise: B's refit must write every byte it serves
                    assert all(n > 0 for n in llm.collective_rpc(poison_weights))
                    noisy = llm.collective_rpc(param_digests)
                    assert all(got != want for got, want in zip(noisy, truth_b[1], strict=True))
                for name, t in tensors.items():
                    t.copy_(weights[name])
                trainer.send_weights()
                ranks = llm.collective_rpc(refit_stats)
                assert [r["replayed"] for r in ranks] == [i > 0, i > 0]
                # Each rank pulls its own heads, columns and sinks, not the model.
                total = sum(t.numel() * t.element_size() for t in b.values())
                assert all(0 < r["bytes"] < total for r in ranks)
                tokens, params = served(llm)
                if weights is not b:  # A serves otherwise, or the replays test nothing
                    assert tokens != truth_b[0]
                    continue
                for rank, (got, want) in enumerate(zip(params, truth_b[1], strict=True)):
                    assert sorted(got) == sorted(want)
                    assert [n for n in want if got[n] != want[n]] == [], f"rank {rank}"
                assert tokens == truth_b[0], f"update {i}"
        finally:
            trainer.shutdown()
    finally:
        stop_engine(llm)
        del llm
        gc.collect()
