"""The guards of a delta refit, each exercised with the fault it guards against: a
base the source does not hold, engine memory written outside a refit, a failure
after the delta's writes. Each test fails if its guard is taken away."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch
from support.daemons import daemon_config, served, serving_daemons
from support.deltas import Change, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.testing.engines import EngineParallel, ModelConfig, ToyEngine, dense_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep

pytestmark = [pytest.mark.timeout(120)]

CFG = dense_toy_config(torch.bfloat16)
PAR = EngineParallel(4, 2, 1)


def layout(state: dict[str, torch.Tensor]) -> Any:
    return megatron_tp_ep(CFG, 2, 1, state)


def receiver(
    local: RefitClient, source: RefitClient, engine: torch.nn.Module, **kw: Any
) -> DeltaReceiver:
    return DeltaReceiver(
        local=local,
        source=source,
        model="m",
        engine=engine,
        twin=lambda: ToyEngine(CFG, PAR),
        capture=capture_for(layout(full_state(CFG, seed=0))),
        max_reads_per_copy=2,
        **kw,
    )


@dataclass
class Setup:
    client: RefitClient
    trainer: DoubleBuffered
    state: dict[str, torch.Tensor]


@pytest_asyncio.fixture
async def one() -> AsyncIterator[Setup]:
    async with served(deltas=True) as s:
        trainer = DoubleBuffered(s.client, "m", layout)
        state = full_state(CFG, seed=3)
        await trainer.publish(1, state)
        yield Setup(s.client, trainer, state)


def same(engine: torch.nn.Module, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> bool:
    return mismatched(engine, cfg, PAR, state) == []


async def test_an_engine_whose_base_differs_from_the_sources_refits_in_full_and_says_so() -> None:
    # Two daemons hold "m" at the same version numbers with different contents (a
    # trainer restarted elsewhere): the engine's v1 is daemon A's; daemon B's v2 is
    # a delta against B's own v1. Only the digest tells the two v1 apart.
    secret = os.urandom(32)
    a = Daemon(daemon_config(deltas=True), secret=secret)
    b = Daemon(daemon_config(deltas=True), secret=secret)
    async with serving_daemons(a, b) as (ca, cb):
        s1 = full_state(CFG, seed=1)
        await DoubleBuffered(ca, "m", layout).publish(1, s1)
        other = DoubleBuffered(cb, "m", layout)
        s1b = changed(s1, Change("some", 0.2, 5))
        await other.publish(1, s1b)
        s2b = changed(s1b, Change("some", 0.05, 6))
        await other.publish(2, s2b)
        eng = zeroed_engine(CFG, PAR)
        r = receiver(ca, ca, eng)
        await r.refit(1)
        assert same(eng, CFG, s1)
        r.source = cb  # the engine now follows daemon B
        await r.refit(2)
        assert r.last is not None and r.last.kind == "full"
        assert "digest" in r.last.reason
        assert same(eng, CFG, s2b)
        await r.close()


async def test_an_engine_written_outside_a_refit_refits_in_full_and_says_so(one: Setup) -> None:
    eng = zeroed_engine(CFG, PAR)
    r = receiver(one.client, one.client, eng)
    await r.refit(1)
    with torch.no_grad():  # someone writes one element of the live engine
        p = next(iter(eng.parameters()))
        p.view(-1)[0] += 1
    s2 = changed(one.state, Change("some", 0.01, 2))
    await one.trainer.publish(2, s2)
    await r.refit(2)
    assert r.last is not None and r.last.kind == "full"
    assert "written outside a refit" in r.last.reason
    assert same(eng, CFG, s2)
    await r.close()


async def test_a_delta_failing_after_its_writes_is_rolled_back_to_the_base(one: Setup) -> None:
    eng = zeroed_engine(CFG, PAR)
    fail = [True]

    def post_load() -> None:  # the engine's post-load processing, failing once
        if fail[0]:
            fail[0] = False
            raise RuntimeError("post-load processing failed")

    r = receiver(one.client, one.client, eng, after_apply=post_load)
    await r.refit(1)
    before = {n: p.detach().clone() for n, p in eng.named_parameters()}
    s2 = changed(one.state, Change("some", 0.3, 4))
    await one.trainer.publish(2, s2)
    with pytest.raises(RuntimeError, match="post-load"):
        await r.refit(2)
    # Not a mix: every parameter holds its v1 bytes again.
    for n, p in eng.named_parameters():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
    assert r.base_version == 1
    await r.refit(2)  # the same delta again, now applied
    assert r.last is not None and r.last.kind == "delta"
    assert same(eng, CFG, s2)
    await r.close()


async def test_every_nth_refit_is_a_full_anchor(one: Setup) -> None:
    eng = zeroed_engine(CFG, PAR)
    r = receiver(one.client, one.client, eng, anchor_every=3)
    await r.refit(1)
    kinds = []
    state = one.state
    for v in range(2, 8):
        state = changed(state, Change("some", 0.02, v))
        await one.trainer.publish(v, state)
        await r.refit(v)
        assert r.last is not None
        kinds.append(r.last.kind)
        assert same(eng, CFG, state)
    assert kinds == ["delta", "delta", "full", "delta", "delta", "full"]
    await r.close()


async def test_a_daemon_with_deltas_off_serves_full_refits_and_says_why() -> None:
    async with served() as s:
        trainer = DoubleBuffered(s.client, "m", layout)
        state = full_state(CFG, seed=3)
        await trainer.publish(1, state)
        eng = zeroed_engine(CFG, PAR)
        r = receiver(s.client, s.client, eng)
        await r.refit(1)
        state = changed(state, Change("some", 0.01, 1))
        await trainer.publish(2, state)
        await r.refit(2)
        assert r.last is not None and r.last.kind == "full"
        assert r.last.reason.startswith("no base")
        info = await s.client.delta_info("m", 2)
        assert info.state == "none" and "off" in info.reason
        assert same(eng, CFG, state)
        await r.close()
