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
from refitd.daemon.delta.source import MAX_CHAIN
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
                max_reads_per_copy=2,
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


async def test_an_engine_that_skipped_versions_gets_one_delta_composed_from_the_records_between() -> (
    None
):
    """v1 -> v3 (the changes of v2 and v3 composed, units changed back by v3 dropped)
    and v3 -> v5 land exactly what a full refit of v3 and v5 gives; an engine that
    skipped more versions than the source still holds changes for refits in full,
    saying why."""
    cfg = dense_toy_config(torch.bfloat16)
    async with served(deltas=True) as s:
        trainer = DoubleBuffered(s.client, "m", lambda st: megatron_tp_ep(cfg, 2, 1, st))
        states = {1: full_state(cfg, seed=1)}
        pub = await trainer.publish(1, states[1])
        par = EngineParallel(4, 1, 1)
        eng = zeroed_engine(cfg, par)
        r = DeltaReceiver(
            local=s.client,
            source=s.client,
            model="m",
            engine=eng,
            twin=lambda: ToyEngine(cfg, par),
            capture=capture_for(pub),
            max_reads_per_copy=2,
        )
        await r.refit(1)
        changes = {2: Change("some", 0.05, 2), 3: Change("some", 0.05, 3), 4: Change("all")}
        for v in (2, 3):
            states[v] = changed(states[v - 1], changes[v])
            if v == 3:  # v2's changes here undone: units v1 -> v3 did not change at all
                name = sorted(states[1])[0]
                states[3][name].view(-1)[:64] = states[1][name].view(-1)[:64]
            await trainer.publish(v, states[v])
        await r.refit(3)
        assert r.last is not None and r.last.kind == "delta", r.last.reason
        assert mismatched(eng, cfg, par, states[3]) == []
        for v in (4, 5):
            states[v] = changed(states[v - 1], changes.get(v, Change("some", 0.02, v)))
            await trainer.publish(v, states[v])
        await r.refit(5)
        assert r.last is not None and r.last.kind == "delta", r.last.reason
        assert mismatched(eng, cfg, par, states[5]) == []
        for v in range(6, 6 + MAX_CHAIN + 1):
            states[v] = changed(states[v - 1], Change("some", 0.02, v))
            await trainer.publish(v, states[v])
        last = 5 + MAX_CHAIN + 1
        await r.refit(last)  # v5 -> v10: v5..v7 were retired, their changes dropped
        assert r.last is not None and r.last.kind == "full"
        assert "the source refused the delta" in r.last.reason and "v5" in r.last.reason
        assert mismatched(eng, cfg, par, states[last]) == []
        await r.close()
