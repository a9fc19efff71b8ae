"""MLA models (DeepSeek-V2/V3, Kimi-K2) refit exactly, on one rank and on two.

vLLM derives MLA's absorbed ``W_UK``/``W_UV`` from ``kv_b_proj`` when it loads a
model; the backend derives them again after every update with vLLM's own
processing. ``test_vllm_families`` judges the TP 1 engines (first update and
replay, tokens and top-3 logprobs against a fresh load). Here:

- an update refused before any byte moves leaves an MLA engine serving exactly
  what it served before;
- a TP 2 engine (a worker process per rank, each pulling only its own heads and
  experts) refits to what a fresh TP 2 load of the same weights serves, first
  update and replay, each from parameters overwritten with noise (one engine per
  family: its own fresh load is the truth).

A module of its own: its engines must not share a test process with another
in-process engine (vLLM's parallel state is one per process).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from test_vllm_families import Family, checkpoint_state, served
from vllm_models import (
    DEEPSEEK_V2,
    KIMI_K2,
    greedy_logprobs,
    llm_kwargs,
    poison_weights,
    save_model,
    stop_engine,
)

pytestmark = pytest.mark.timeout(900)


def test_an_mla_update_refused_before_any_byte_moves_leaves_the_engine_serving_as_before(
    vllm_daemon_url: str, tmp_path: Path
) -> None:
    from vllm import LLM

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    family = Family("deepseek-v2-mla", DEEPSEEK_V2)
    save_model(tmp_path / "b", family.config, checkpoint_state(family, 12, retie=True))
    llm = LLM(
        model=str(tmp_path / "b"), weight_transfer_config={"backend": "refitd"}, **llm_kwargs()
    )
    try:
        before = served(llm)
        a = checkpoint_state(family, 11, retie=False)
        missing = "model.layers.1.self_attn.kv_b_proj.weight"
        del a[missing]  # the engine's MLA layer could not be rebuilt: refused whole
        info = RefitdTrainerInitInfo(rank=0, model=family.name, url=vllm_daemon_url)
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=LLMSyncClient(llm), source=TensorSource(a)
        )
        try:
            with pytest.raises(Exception, match=r"unwritten.*layers\.1\.self_attn\.kv_b_proj"):
                trainer.send_weights()
        finally:
            trainer.shutdown()
        tokens, params = served(llm)
        assert [n for n in before[1] if params.get(n) != before[1][n]] == []
        assert tokens == before[0]
    finally:
        stop_engine(llm)
        del llm
        gc.collect()


@pytest.mark.parametrize(
    "family",
    [Family("deepseek-v2-lite-mla-tp2", DEEPSEEK_V2), Family("kimi-k2-mla-tp2", KIMI_K2)],
    ids=lambda f: f.name,
)
def test_a_tp2_mla_engine_refits_to_what_a_fresh_tp2_load_serves_first_update_and_replay(
    family: Family, vllm_daemon_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One TP 2 engine, loaded fresh from B: what it serves then is the truth. Its
    parameters are overwritten with noise and it refits to B (the first update, which
    plans), to A (a replay: it must serve otherwise), and, noise again, to B (a
    replay): B's two refits serve exactly what the fresh load did, from nothing but
    the refit's bytes."""
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

    a = checkpoint_state(family, 11, retie=False)
    b = checkpoint_state(family, 12, retie=True)
    save_model(tmp_path / "b", family.config, b)
    tp2 = {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        # One sequence a step: with worker processes the two prompts share a step in
        # some generations and not in others, and a TP 2 MLA engine serves other
        # tokens by batch (measured, docs/vllm.md); one a step it serves one answer.
        "max_num_seqs": 1,
        **llm_kwargs(),
    }
    llm = LLM(model=str(tmp_path / "b"), weight_transfer_config={"backend": "refitd"}, **tp2)
    try:
        truth_b = greedy_logprobs(llm)
        tensors = {n: t.clone() for n, t in b.items()}
        info = RefitdTrainerInitInfo(rank=0, model=family.name, url=vllm_daemon_url)
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=LLMSyncClient(llm), source=TensorSource(tensors)
        )
        try:
            assert greedy_logprobs(llm) == truth_b  # the init changed nothing served
            for i, weights in enumerate([b, a, b]):
                if weights is b:
                    assert all(n > 0 for n in llm.collective_rpc(poison_weights))
                for name, t in tensors.items():
                    t.copy_(weights[name])
                trainer.send_weights()
                ranks = llm.collective_rpc(refit_stats)
                assert [r["replayed"] for r in ranks] == [i > 0, i > 0]
                # Each rank pulls its own heads and half the experts, not the model.
                total = sum(t.numel() * t.element_size() for t in b.values())
                assert all(0 < r["bytes"] < total for r in ranks)
                served_now = greedy_logprobs(llm)
                if weights is b:
                    assert served_now == truth_b, f"update {i}"
                else:  # A serves otherwise, or the replays below test nothing
                    assert served_now != truth_b
        finally:
            trainer.shutdown()
    finally:
        stop_engine(llm)
        del llm
        gc.collect()
