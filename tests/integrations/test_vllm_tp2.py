"""refitd's vLLM backend on a tensor-parallel engine: TP 2 on CPU, two workers.

Each worker plans its own pull from the same published version and reads only the
bytes its loaders keep. The result is checked on every rank against the model's
own loaders, and against vLLM's own reload of the same weights from disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_models import (
    LLAMA,
    greedy,
    llm_kwargs,
    loader_format_mismatches,
    stop_engine,
    write_model,
)

from refitd.bench.vllm import served_digest

pytestmark = pytest.mark.timeout(600)


def test_each_tp_rank_pulls_only_its_own_shard_and_the_engine_matches_a_reload_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vllm_daemon_url: str
) -> None:
    url = vllm_daemon_url
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

    write_model(tmp_path / "engine", LLAMA, seed=1)
    state = write_model(tmp_path / "trainer", LLAMA, seed=2)
    total = sum(t.numel() * t.element_size() for t in state.values())
    llm = LLM(
        model=str(tmp_path / "engine"),
        weight_transfer_config={"backend": "refitd"},
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        **llm_kwargs(),
    )
    try:
        info = RefitdTrainerInitInfo(rank=0, model="tp2", url=url)
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=LLMSyncClient(llm), source=TensorSource(state)
        )
        trainer.send_weights()
        trainer.shutdown()
        ranks = llm.collective_rpc(refit_stats)
        assert [s["version"] for s in ranks] == [1, 1]
        # Sharded weights are split; only norms are read by both ranks.
        assert all(s["bytes"] < 0.6 * total for s in ranks)
        checkpoint = str(tmp_path / "trainer" / "model.safetensors")
        assert llm.collective_rpc(loader_format_mismatches, args=(checkpoint,)) == [[], []]
        refitted = (llm.collective_rpc(served_digest), greedy(llm))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "trainer")})
        assert (llm.collective_rpc(served_digest), greedy(llm)) == refitted
    finally:
        stop_engine(llm)
        del llm  # a failure's traceback must not keep the TP workers alive
