"""Delta refit through a real daemon: after any number of deltas an engine rank holds
exactly what a full refit of the same version gives it."""

from __future__ import annotations

import pytest
import torch
from support.daemons import served
from support.deltas import Change, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep

pytestmark = [pytest.mark.timeout(120)]


async def test_a_sequence_of_deltas_leaves_each_rank_equal_to_a_full_refit() -> None:
    cfg = dense_toy_config(torch.bfloat16)
    async with served(deltas=True) as s:
        trainer = DoubleBuffered(s.client, "m", lambda st: megatron_tp_ep(cfg, 2, 1, st))
        state = full_state(cfg, seed=1)
        pub = await trainer.publish(1, state)
        ranks = []
        for rank in (0, 3):
            par = EngineParallel(4, rank, 1)
            eng = zeroed_engine(cfg, par)
            r = DeltaReceiver(
                local=s.client,
                source=s.client,
                model="m",
                engine=eng,
                twin=lambda par=par: ToyEngine(cfg, par),
                capture=capture_for(pub),
                max_segments_per_copy=2,
            )
            await r.refit(1)
            assert r.last is not None and r.last.kind == "full"
            ranks.append((r, eng, par))
        for v, change in enumerate(
            [Change("some", 0.01, 1), Change("none"), Change("all"), Change("tensor", 0, 3)],
            start=2,
        ):
            state = changed(state, change)
            await trainer.publish(v, state)
            for r, eng, par in ranks:
                await r.refit(v)
                assert r.last is not None
                assert r.last.kind == "delta", r.last.reason
                assert mismatched(eng, cfg, par, state) == []
        for r, _, _ in ranks:
            await r.close()
