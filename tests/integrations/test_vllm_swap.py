"""Swap mode (the vLLM worker's default): each refit's pull lands once, in a second
copy of the parameters' memory, and the parameters move to it only once every byte
arrived; a pull that fails after its bytes landed installs nothing.

First on the toy engine (two daemons in this process, a gated copy and a fake clock
hold the pull and end its lease while it is held), then on a real vLLM engine whose
daemon, in a thread of this process, ends the lease of the pull the test arms right
after its bytes are copied: the engine serves the previous version exactly (tokens,
top logprobs, every parameter), and the next refits are exact both ways round.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from support.daemons import FakeClock, GatedCopier, daemon_config, served_in_a_thread
from support.engines import serving_swap_engine
from support.vllm_world import fresh_serving, refit_engine, vllm_environment

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import ConflictError
from refitd.wire import PullState
from transports.local import copy_addresses

pytestmark = pytest.mark.timeout(600)

SECRET = b"s" * 32


async def test_on_the_toy_engine_a_pull_failing_after_its_bytes_landed_installs_nothing() -> None:
    clock, gated = FakeClock(50.0), GatedCopier()
    a = Daemon(daemon_config(node_id="a"), secret=SECRET, clock=clock)
    b = Daemon(daemon_config(node_id="b"), secret=SECRET, copier=gated)
    async with serving_swap_engine(b, a) as toy:
        await toy.publish(1)
        gated.gate.set()
        await toy.receiver.refit(1)
        assert toy.mismatched(1) == []
        await toy.publish(2)
        gated.gate.clear()
        gated.entered.clear()
        refit = asyncio.create_task(toy.receiver.refit(2))
        await gated.entered.wait()
        clock.now += 31.0  # v2's bytes are copied, then its lease is found ended
        gated.gate.set()
        with pytest.raises(ConflictError, match="expired"):
            await refit
        *_, failed = await toy.local.pulls()
        assert failed.state is PullState.FAILED and failed.bytes_done > 0 and failed.suspect
        assert toy.mismatched(1) == []  # v1, bit for bit
        # The next refits swap whole versions in, into each segment in turn.
        assert (await toy.receiver.refit(2)).replayed
        assert toy.mismatched(2) == []
        await toy.publish(3, like=1)
        await toy.receiver.refit(3)  # new source regions: the plan is rebound, not replayed
        assert toy.mismatched(3) == []


async def test_on_the_toy_engine_a_prefetched_version_waits_whole_until_swapped_in() -> None:
    a = Daemon(daemon_config(node_id="a"), secret=SECRET)
    b = Daemon(daemon_config(node_id="b"), secret=SECRET)
    async with serving_swap_engine(b, a) as toy:
        await toy.publish(1)
        await toy.receiver.refit(1)
        await toy.publish(2)
        await toy.receiver.prefetch(2)
        assert toy.mismatched(1) == []  # prefetched, not served
        with pytest.raises(ConflictError, match="holds v2"):
            toy.receiver.swap_prefetched(3)
        toy.receiver.swap_prefetched(2)
        assert toy.mismatched(2) == []
        with pytest.raises(ConflictError, match="nothing prefetched"):
            toy.receiver.swap_prefetched(2)
        # A refit after a prefetch replaces what waited: nothing stale is swapped in later.
        await toy.publish(3, like=1)
        await toy.receiver.prefetch(3)
        await toy.receiver.refit(3)
        assert toy.mismatched(3) == [] and toy.receiver.prefetched is None
        with pytest.raises(ConflictError, match="nothing prefetched"):
            toy.receiver.swap_prefetched(3)
        assert toy.mismatched(3) == []


class LeaseEndingCopier:
    """The daemon's same-host copy engine, copying for real; once the test arms it,
    the next copy moves the daemon's clock past every lease after its bytes landed,
    so that pull fails on its lease check with the new version's bytes in place. The
    one fake: a real lease cannot be made to end between a copy and its check."""

    def __init__(self, clock: FakeClock, past_s: float) -> None:
        self.clock = clock
        self.past_s = past_s
        self.armed = threading.Event()
        self.fired = threading.Event()

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        await copy_addresses(dst, src, nbytes, threads=1, pool=None)
        if self.armed.is_set():
            self.armed.clear()
            self.clock.now += self.past_s
            self.fired.set()


LEASE_TTL_S = 60.0


@dataclass
class SwapWorld:
    url: str
    llm: Any
    copier: LeaseEndingCopier
    truth: dict[int, tuple[Any, dict[str, torch.Tensor]]]
    """Per seed: what a fresh ``LLM`` of those weights served (tokens and top
    logprobs, every parameter)."""
    weights: dict[int, dict[str, torch.Tensor]]


SEEDS = (2, 3)


@pytest.fixture(scope="module")
def swap_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwapWorld]:
    from vllm_models import LLAMA, write_model

    root = tmp_path_factory.mktemp("swap")
    clock = FakeClock(1000.0)
    copier = LeaseEndingCopier(clock, LEASE_TTL_S + 1.0)

    def daemon() -> Daemon:
        return Daemon(daemon_config(node_id="swap"), clock=clock, copier=copier)

    with (
        served_in_a_thread(daemon) as in_a_thread,
        vllm_environment(tmp_path_factory, in_a_thread.url),
    ):
        url = in_a_thread.url
        truth: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}
        weights: dict[int, dict[str, torch.Tensor]] = {}
        for seed in SEEDS:  # one in-process engine at a time: the fresh loads first
            weights[seed] = write_model(root / f"truth{seed}", LLAMA, seed=seed)
            truth[seed] = fresh_serving(root / f"truth{seed}", served)
        write_model(root / "engine", LLAMA, seed=1)
        with refit_engine(root / "engine") as llm:
            yield SwapWorld(url, llm, copier, truth, weights)


def served(llm: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    from vllm_models import greedy_logprobs, live_params

    return greedy_logprobs(llm), llm.collective_rpc(live_params)[0]


def daemon_pulls(url: str) -> list[Any]:
    async def pulls() -> list[Any]:
        async with RefitClient(url) as c:
            return list(await c.pulls())

    return asyncio.run(pulls())


def differing(got: tuple[Any, dict[str, torch.Tensor]], want: tuple[Any, Any]) -> list[str]:
    out = [] if got[0] == want[0] else ["tokens or logprobs"]
    return out + [n for n, t in want[1].items() if not torch.equal(got[1][n], t)]


def test_a_vllm_engine_whose_pull_fails_after_its_bytes_landed_serves_the_previous_version(
    swap_world: SwapWorld,
) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    w = swap_world
    first, second = SEEDS
    state = {n: t.clone() for n, t in w.weights[first].items()}
    info = RefitdTrainerInitInfo(
        rank=0, model="llama", url=w.url, worker={"mode": "swap", "lease_ttl_s": LEASE_TTL_S}
    )
    trainer = RefitdTrainerEngine.trainer_init(
        info, client=LLMSyncClient(w.llm), source=TensorSource(state)
    )

    def update_to(seed: int) -> None:
        for n, t in w.weights[seed].items():
            state[n].copy_(t)
        trainer.send_weights()

    try:
        update_to(first)
        assert differing(served(w.llm), w.truth[first]) == []

        w.copier.armed.set()
        with pytest.raises(Exception, match="expired"):
            update_to(second)
        assert w.copier.fired.is_set()  # the second version's bytes were copied
        [failed] = [p for p in daemon_pulls(w.url) if p.state is PullState.FAILED]
        assert failed.bytes_done > 0 and failed.suspect
        assert differing(served(w.llm), w.truth[first]) == []

        # Not wedged, and exact both ways round: the plan replays into each segment.
        update_to(second)
        assert differing(served(w.llm), w.truth[second]) == []
        update_to(first)
        [stats] = w.llm.collective_rpc(refit_stats)
        assert stats["replayed"] and stats["plans"] == 1
        assert differing(served(w.llm), w.truth[first]) == []
    finally:
        trainer.shutdown()
