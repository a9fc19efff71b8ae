"""refitd's vLLM backend on a tensor-parallel engine: TP 2 on CPU, two workers.

Each worker plans its own pull from the same published version and reads only the
bytes its loaders keep. The result is checked on every rank against the model's
own loaders, and against vLLM's own reload of the same weights from disk. One engine
for the module: each test sets the workers up afresh (a model name of its own), so
neither depends on what the other left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class TP2:
    llm: Any
    url: str


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TP2]:
    from support.vllm_world import vllm_daemon
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("tp2")
    with vllm_daemon(tmp_path_factory, "tp2-daemon", mp=mp) as url:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a worker process per rank
        write_model(root / "engine", LLAMA, seed=1)
        llm = LLM(
            model=str(root / "engine"),
            weight_transfer_config={"backend": "refitd"},
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            **llm_kwargs(),
        )
        try:
            yield TP2(llm, url)
        finally:
            stop_engine(llm)
            del llm  # a failure's traceback must not keep the TP workers alive
            mp.undo()


def test_each_tp_rank_pulls_only_its_own_shard_and_the_engine_matches_a_reload_from_disk(
    tmp_path: Path, tp2: TP2
) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    url, llm = tp2.url, tp2.llm
    state = write_model(tmp_path / "trainer", LLAMA, seed=2)
    total = sum(t.numel() * t.element_size() for t in state.values())
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


def _session(llm: Any, update_info: Any) -> None:
    """One vLLM weight-update session carrying ``update_info`` (a dict for every rank,
    or a list with one per rank)."""
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info})
    llm.finish_weight_update()


def test_when_one_tp_rank_cannot_prefetch_no_rank_swaps_and_both_serve_on(
    tmp_path: Path, tp2: TP2
) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo
    from refitd.integrations.vllm.worker import inflight_state

    llm = tp2.llm
    state = write_model(tmp_path / "trainer", LLAMA, seed=3)
    trainer = RefitdTrainerEngine(
        RefitdTrainerInitInfo(rank=0, model="tp2-inflight", url=tp2.url),
        client=None,
        source=TensorSource(state),
        is_sender=True,
    )

    def settled(llm: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 120
        while True:
            states: list[dict[str, Any]] = llm.collective_rpc(inflight_state)
            if all(s["state"] != "running" for s in states):
                return states
            assert time.monotonic() < deadline, states
            time.sleep(0.05)  # the state is asked: vLLM offers nothing to wait on

    try:
        llm.init_weight_transfer_engine({"init_info": {"model": "tp2-inflight"}})
        before = (llm.collective_rpc(served_digest), greedy(llm))
        version = trainer.publish_ready()
        # Rank 1 is asked for a version never published: its prefetch fails.
        _session(llm, [{"phase": "prefetch", "version": v} for v in (version, version + 50)])
        assert [s["state"] for s in settled(llm)] == ["ready", "failed"]
        with pytest.raises(Exception, match=r"refused on every rank.*rank 1: its prefetch"):
            _session(llm, {"phase": "swap", "version": version})
        # Rank 0 refused quietly (see the worker): its session is still open; closing
        # it is refused by rank 1 alone, whose session the refusal ended.
        with pytest.raises(Exception, match="without a matching start"):
            llm.finish_weight_update()
        assert (llm.collective_rpc(served_digest), greedy(llm)) == before  # N-1 on both
        _session(llm, {"phase": "abandon"})
        _session(llm, {"phase": "prefetch", "version": version})
        assert [s["state"] for s in settled(llm)] == ["ready", "ready"]
        _session(llm, {"phase": "swap", "version": version})
        swapped = (llm.collective_rpc(served_digest), greedy(llm))
        assert swapped != before
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "trainer")})
        assert (llm.collective_rpc(served_digest), greedy(llm)) == swapped
    finally:
        trainer.shutdown()


class ServingLLMControl:
    """:class:`~refitd.integrations.vllm.inflight.EngineControl` over the module's
    synchronous ``LLM``, which generates only inside its own calls: between them it is
    paused already, so pause and resume do nothing. Every state poll (the driver polls
    while the workers prefetch) first serves one request, so requests run while the
    version lands; each one's end goes to ``served``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.served: list[str] = []
        self.pauses = 0

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    async def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    async def pause(self) -> None:
        self.pauses += 1

    async def resume(self) -> None:
        pass

    async def set_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    async def states(self) -> list[dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from refitd.integrations.vllm.worker import inflight_state

        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
        prompt = TokensPrompt(prompt_token_ids=[5, 17, 33 + len(self.served) % 50])
        [out] = self.llm.generate([prompt], params, use_tqdm=False)
        self.served.append(f"{out.outputs[0].finish_reason} {len(out.outputs[0].token_ids)}")
        return list(self.llm.collective_rpc(inflight_state))


def test_the_in_flight_driver_updates_both_tp_ranks_while_requests_run_equal_to_a_reload(
    tmp_path: Path, tp2: TP2
) -> None:
    import asyncio

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.inflight import inflight_update
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    llm = tp2.llm
    control = ServingLLMControl(llm)
    trainer = RefitdTrainerEngine(
        RefitdTrainerInitInfo(rank=0, model="tp2-driver", url=tp2.url),
        client=None,
        source=TensorSource(write_model(tmp_path / "trainer", LLAMA, seed=4)),
        is_sender=True,
    )
    try:
        asyncio.run(control.init_weight_transfer_engine({"model": "tp2-driver"}))
        before = (llm.collective_rpc(served_digest), greedy(llm))
        stats = asyncio.run(inflight_update(control, trainer.publish_ready()))
    finally:
        trainer.shutdown()
    assert [s["state"] for s in stats.ranks] == ["ready", "ready"]
    assert control.pauses == 1
    # The requests served while the version landed all ran to their length (none
    # aborted); at least the one the driver's first poll served.
    assert control.served and set(control.served) == {"length 4"}
    assert llm.get_weight_version() == str(stats.version)
    swapped = (llm.collective_rpc(served_digest), greedy(llm))
    assert swapped != before
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "trainer")})
    assert (llm.collective_rpc(served_digest), greedy(llm)) == swapped  # verified
