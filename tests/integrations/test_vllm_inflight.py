"""In-flight refit on a real vLLM ``AsyncLLM``: the engine streams while the next version
is pulled and prepared, and pauses (keep mode) only to swap it in.

One engine for the module (its core and worker in processes of their own, as
``AsyncLLM`` runs), on an event loop in a thread of its own so every test can drive
it; a real ``refitd serve`` and a trainer publishing versions. What a fresh engine of
each checkpoint serves is read first, one in-process engine at a time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import torch
from support.vllm_world import fresh_serving, vllm_daemon
from vllm_models import LLAMA, live_params, write_model

from refitd.integrations.vllm.inflight import (
    AsyncLLMControl,
    InflightStats,
    PrefetchRefused,
    inflight_update,
)

pytestmark = pytest.mark.timeout(600)

T = TypeVar("T")
SEEDS = (2, 3, 4)
PROMPTS = ([5, 17, 33, 99, 200], [7, 300, 42])


class LoopThread:
    """An event loop in a thread of its own for the module: ``AsyncLLM`` lives on the
    loop it started on, and each test submits to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@dataclass
class Recorded:
    """:class:`~refitd.integrations.vllm.inflight.EngineControl` over ``AsyncLLM`` that
    also records when the driver paused and resumed the engine."""

    inner: AsyncLLMControl
    pauses: list[float] = field(default_factory=list)
    resumes: list[float] = field(default_factory=list)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self.inner.init_weight_transfer_engine(init_info)

    async def start_weight_update(self) -> None:
        await self.inner.start_weight_update()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self.inner.update_weights(update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.inner.finish_weight_update(weight_version)

    async def pause(self) -> None:
        self.pauses.append(time.perf_counter())
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()
        self.resumes.append(time.perf_counter())

    async def set_weight_version(self, version: str) -> None:
        await self.inner.set_weight_version(version)

    async def states(self) -> list[dict[str, Any]]:
        return await self.inner.states()


@dataclass
class World:
    loop: LoopThread
    llm: Any
    control: Recorded
    trainer: Any
    state: dict[str, torch.Tensor]
    weights: dict[int, dict[str, torch.Tensor]]
    truth: dict[int, tuple[Any, dict[str, torch.Tensor]]]
    url: str

    def publish(self, seed: int) -> int:
        """Publish ``seed``'s checkpoint as the next version (READY on return)."""
        for n, t in self.weights[seed].items():
            self.state[n].copy_(t)
        version: int = self.trainer.publish_ready()
        return version

    def update(self, seed: int) -> InflightStats:
        return self.loop.run(inflight_update(self.control, self.publish(seed)))

    def served(self) -> tuple[Any, dict[str, torch.Tensor]]:
        return self.loop.run(_greedy_logprobs(self.llm)), self.loop.run(
            self.llm.collective_rpc(live_params)
        )[0]

    def differing(self, seed: int) -> list[str]:
        """What the engine serves that a fresh load of ``seed`` does not (empty: none)."""
        got, want = self.served(), self.truth[seed]
        out = [] if got[0] == want[0] else [f"tokens or logprobs: {got[0]} != {want[0]}"]
        return out + [n for n, t in want[1].items() if not torch.equal(got[1][n], t)]


async def _greedy_logprobs(llm: Any) -> list[Any]:
    """As ``vllm_models.greedy_logprobs``, through ``AsyncLLM``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    out = []
    for i, ids in enumerate(PROMPTS):
        last: Any = None
        async for o in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"g{i}{ids}"):
            last = o
        c = last.outputs[0]
        steps = [
            sorted((int(t), float(lp.logprob)) for t, lp in step.items()) for step in c.logprobs
        ]
        out.append((list(c.token_ids), steps))
    return out


def _served(llm: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """What a fresh in-process ``LLM`` serves, each prompt alone (as the streams'
    engine is asked: a batch of another size may round otherwise)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    out = []
    for ids in PROMPTS:
        [o] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        c = o.outputs[0]
        steps = [
            sorted((int(t), float(lp.logprob)) for t, lp in step.items()) for step in c.logprobs
        ]
        out.append((list(c.token_ids), steps))
    return out, llm.collective_rpc(live_params)[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from refitd.bench.vllm import LLM_CPU_KWARGS
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    root = tmp_path_factory.mktemp("inflight")
    mp = pytest.MonkeyPatch()
    # Deltas on: the delta test's trainer double-buffers; the others publish one buffer.
    with vllm_daemon(tmp_path_factory, "inflight-daemon", "pulls.deltas=true", mp=mp) as url:
        weights = {s: write_model(root / f"truth{s}", LLAMA, seed=s) for s in SEEDS}
        truth = {s: fresh_serving(root / f"truth{s}", _served) for s in SEEDS}
        write_model(root / "engine", LLAMA, seed=1)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # AsyncLLM runs its core apart
        loop = LoopThread()

        async def start() -> Any:
            args = AsyncEngineArgs(
                model=str(root / "engine"),
                weight_transfer_config={"backend": "refitd"},
                **LLM_CPU_KWARGS,
            )
            return AsyncLLM.from_engine_args(args)

        llm = loop.run(start())
        state = {n: t.clone() for n, t in weights[SEEDS[0]].items()}
        trainer = RefitdTrainerEngine(
            RefitdTrainerInitInfo(rank=0, model="inflight", url=url),
            client=None,
            source=TensorSource(state),
            is_sender=True,
        )
        control = Recorded(AsyncLLMControl(llm))
        try:
            # The prefetch's processing on one OpenMP thread, resting half the time:
            # every in-flight test below runs the paced path, and is exact through it.
            init = {"model": "inflight", "mode": "swap", "prefetch_threads": 1}
            loop.run(control.init_weight_transfer_engine({**init, "prefetch_duty": 0.5}))
            yield World(loop, llm, control, trainer, state, weights, truth, url)
        finally:
            trainer.shutdown()
            llm.shutdown()
            loop.close()
            mp.undo()


async def _steady_streams(
    llm: Any, n: int, stop: asyncio.Event, log: list[tuple[float, float, str, int]]
) -> None:
    """``n`` concurrent streaming requests at all times until ``stop``; each one's
    (first token, last token, finish reason, tokens) goes to ``log``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, detokenize=False)

    async def one(lane: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            first = last = 0.0
            out: Any = None
            async for o in llm.generate(
                TokensPrompt(prompt_token_ids=[5, 17 + lane, 33 + k % 50]), params, f"s{lane}-{k}"
            ):
                out, last = o, time.perf_counter()
                first = first or last
            c = out.outputs[0]
            log.append((first, last, str(c.finish_reason), len(c.token_ids)))

    await asyncio.gather(*(one(lane) for lane in range(n)))


def test_streams_survive_three_in_flight_updates_and_the_engine_then_equals_a_fresh_load(
    world: World,
) -> None:
    async def scenario() -> tuple[list[InflightStats], list[Any]]:
        stop, log = asyncio.Event(), []
        streams = asyncio.create_task(_steady_streams(world.llm, 4, stop, log))
        await asyncio.sleep(0.5)  # streams under way before the first prefetch
        stats = []
        for seed in SEEDS:
            version = await asyncio.to_thread(world.publish, seed)
            stats.append(await inflight_update(world.control, version))
        stop.set()
        await streams
        return stats, log

    stats, log = world.loop.run(scenario())
    # No request aborted or errored: every one ran to its length.
    assert log and all(reason == "length" and n == 100 for _, _, reason, n in log)
    for s in stats:  # each pause froze streams that were in flight, and they went on
        paused, resumed = s.marks["paused"], s.marks["resumed"]
        assert any(first < paused and last > resumed for first, last, _, _ in log)
    assert world.differing(SEEDS[-1]) == []
    assert world.loop.run(world.llm.get_weight_version()) == str(stats[-1].version)


def test_a_prefetch_that_fails_leaves_the_engine_on_its_version_with_no_pause(
    world: World,
) -> None:
    world.update(SEEDS[0])
    pauses = len(world.control.pauses)
    version = world.trainer.version
    with pytest.raises(PrefetchRefused, match=r"before any pause.*rank 0: failed") as refused:
        world.loop.run(inflight_update(world.control, version + 50))  # never published
    assert "NotFound" in refused.value.states[0]["error"]
    assert len(world.control.pauses) == pauses
    assert world.differing(SEEDS[0]) == []
    world.update(SEEDS[1])  # not wedged
    assert world.differing(SEEDS[1]) == []


class RefusingProcessing:
    """vLLM's quant-method interface around a module's own method, whose post-load
    processing raises: the one fault a real method does not make on demand."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.apply(*args, **kwargs)

    def process_weights_after_loading(self, layer: Any) -> None:
        raise RuntimeError("processing refused (test)")


MODULE = "model.layers.1.mlp.down_proj"


def _refuse_processing(worker: Any) -> None:
    module = worker.model_runner.get_model().get_submodule(MODULE)
    module.quant_method = RefusingProcessing(module.quant_method)


def _restore_processing(worker: Any) -> None:
    module = worker.model_runner.get_model().get_submodule(MODULE)
    module.quant_method = module.quant_method.inner


def test_a_swap_whose_preparation_fails_is_refused_before_the_pause(world: World) -> None:
    world.update(SEEDS[1])
    pauses = len(world.control.pauses)
    world.loop.run(world.llm.collective_rpc(_refuse_processing))
    try:
        with pytest.raises(PrefetchRefused, match="processing refused"):
            world.update(SEEDS[2])
    finally:
        world.loop.run(world.llm.collective_rpc(_restore_processing))
    assert len(world.control.pauses) == pauses
    assert world.differing(SEEDS[1]) == []

    async def swap() -> None:  # asked anyway, without the driver's check
        await world.control.start_weight_update()
        await world.control.update_weights({"phase": "swap", "version": 1})  # vLLM ends it

    with pytest.raises(Exception, match="refused on every rank"):
        world.loop.run(swap())
    assert world.differing(SEEDS[1]) == []
    world.update(SEEDS[2])
    assert world.differing(SEEDS[2]) == []


def stepped(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` with 2 % of every tensor's values moved by one ulp: a delta's worth."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        bits = t.view(torch.int16).reshape(-1)
        bits[torch.rand(bits.numel(), generator=g) < 0.02] += 1
        out[name] = t
    return out


def test_with_delta_refit_an_in_flight_swap_is_exact_and_the_next_refit_is_full_then_deltas(
    world: World,
) -> None:
    """A worker started with ``delta=True``: a full refit, then a delta (to a checkpoint
    the module knows), then an in-flight update, which pulls in full into the inactive
    copy; the refit after it finds no base (the swap made the other copy live) and runs
    full, and the one after is a delta again. Each equals a fresh load bit for bit."""
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.inflight import _session
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo
    from refitd.integrations.vllm.worker import refit_stats

    s2, s3, s4 = SEEDS
    state = {n: t.clone() for n, t in world.weights[s2].items()}
    trainer = RefitdTrainerEngine(
        RefitdTrainerInitInfo(rank=0, model="inflight-delta", url=world.url, buffers=2),
        client=None,
        source=TensorSource(state),
        is_sender=True,
    )
    control = world.control

    def publish(weights: dict[str, torch.Tensor]) -> int:
        for n, t in weights.items():
            state[n].copy_(t)
        version: int = trainer.publish_ready()
        return version

    def refit(weights: dict[str, torch.Tensor]) -> tuple[str, str]:
        """A synchronous refit (vLLM's step loop held for it): its kind and reason."""
        world.loop.run(_session(control, {"version": publish(weights)}, None))
        [stats] = world.loop.run(world.llm.collective_rpc(refit_stats))
        return stats["kind"], stats["reason"]

    init = {"model": "inflight-delta", "mode": "swap", "delta": True}
    try:
        world.loop.run(control.init_weight_transfer_engine(init))
        assert refit(stepped(world.weights[s2], 7))[0] == "full"  # no base yet
        assert refit(world.weights[s2]) == ("delta", "")
        assert world.differing(s2) == []
        stats = world.loop.run(inflight_update(control, publish(world.weights[s3])))
        [after] = world.loop.run(world.llm.collective_rpc(refit_stats))
        assert after["kind"] == "inflight" and after["version"] == stats.version
        assert world.differing(s3) == []
        kind, reason = refit(world.weights[s4])
        assert kind == "full" and reason.startswith("no base"), (kind, reason)
        assert world.differing(s4) == []
        assert refit(stepped(world.weights[s4], 8))[0] == "delta"
        assert refit(world.weights[s4]) == ("delta", "")
        assert world.differing(s4) == []
    finally:
        trainer.shutdown()
        # The module's other tests refit without delta, from the module's trainer.
        world.loop.run(control.init_weight_transfer_engine({"model": "inflight", "mode": "swap"}))


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("prefetch_duty", 0.0, r"prefetch_duty 0.0: expected a share in \(0, 1\]"),
        ("prefetch_duty", 1.5, r"prefetch_duty 1.5: expected a share in \(0, 1\]"),
        ("prefetch_threads", -1, r"prefetch_threads -1: expected 0 or more"),
    ],
)
def test_a_prefetch_pacing_out_of_range_is_refused_naming_it(
    key: str, value: float, why: str
) -> None:
    from refitd.integrations.vllm.worker import RefitdInitInfo

    with pytest.raises(ValueError, match=why):
        RefitdInitInfo(**{key: value})


def test_a_paced_prefetch_rests_its_duty_share_after_each_module_and_an_unpaced_one_never() -> None:
    from refitd.integrations.vllm.prefetching import _pacer

    assert _pacer(1.0) is None
    pace = _pacer(0.25)
    assert pace is not None
    began = time.perf_counter()
    pace(0.02)  # a module that took 20 ms: rest 60 ms, so the work is a quarter
    assert time.perf_counter() - began >= 0.06
