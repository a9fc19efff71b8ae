"""The plans a source keeps for its delta readers (:mod:`refitd.daemon.delta.plans`):
a warm delta refit names the plan it sent before instead of sending it again; a plan
is found only under the principal that sent it, and one not kept is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from aiohttp import web
from support.daemons import served
from support.deltas import Change, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.daemon.delta.plans import Plans, plan_digest
from refitd.daemon.delta.routes import DELTAS
from refitd.errors import NotFoundError, ProtocolError
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep
from refitd.wire import DeltaStreamRequest, DescriptorTable, PackSpec

ROWS = np.array([[1, 0, 9, 0, 4096], [1, 4096, 9, 8192, 4096]], dtype=np.int64)
SPECS = [PackSpec(1, 0, (4, 2), (8, 1), 4, 9, 0)]


def sent(rows: np.ndarray = ROWS, specs: list[PackSpec] = SPECS) -> DeltaStreamRequest:
    return DeltaStreamRequest("m", 2, "l1", 1, "d" * 32, DescriptorTable.pack(rows), specs)


def named(name: str) -> DeltaStreamRequest:
    return DeltaStreamRequest("m", 3, "l2", 2, "e" * 32, DescriptorTable(b""), [], plan=name)


async def test_a_plan_sent_once_is_found_by_its_name_with_every_descriptor() -> None:
    plans = Plans()
    req, name = await plans.resolve(sent(), "a")
    assert req == sent() and name == plan_digest(req.descriptors, SPECS)
    got, same = await plans.resolve(named(name), "a")
    assert same == name
    assert np.array_equal(got.descriptors.rows(), ROWS) and got.pack_specs == SPECS
    assert (got.version, got.lease_id, got.base_version) == (3, "l2", 2)  # the new request's


async def test_a_plan_is_found_only_under_the_principal_that_sent_it() -> None:
    plans = Plans()
    _, name = await plans.resolve(sent(), "a")
    with pytest.raises(NotFoundError, match="not kept on this daemon"):
        await plans.resolve(named(name), "b")


@pytest.mark.parametrize(
    "plans", [Plans(keep=2), Plans(keep_bytes=2 * (ROWS.nbytes + 128))], ids=["plans", "bytes"]
)
async def test_only_the_newest_plans_of_a_principal_are_kept(plans: Plans) -> None:
    names = []
    for k in range(3):
        rows = ROWS.copy()
        rows[:, 1] += 4096 * k * 2
        names.append((await plans.resolve(sent(rows), "a"))[1])
    with pytest.raises(NotFoundError, match="send the plan itself"):
        await plans.resolve(named(names[0]), "a")
    for name in names[1:]:
        await plans.resolve(named(name), "a")


async def test_a_request_that_names_a_plan_and_sends_one_too_is_refused() -> None:
    plans = Plans()
    _, name = await plans.resolve(sent(), "a")
    both = DeltaStreamRequest("m", 3, "l2", 2, "e" * 32, DescriptorTable.pack(ROWS), [], plan=name)
    with pytest.raises(ProtocolError, match="send one or the other"):
        await plans.resolve(both, "a")


async def test_a_plan_larger_than_a_principals_budget_is_not_kept_nor_named() -> None:
    plans = Plans(keep_bytes=ROWS.nbytes)
    req, name = await plans.resolve(sent(), "a")
    assert name == "" and req == sent()


async def test_a_rank_whose_named_plan_was_pushed_out_sends_it_and_still_gets_its_delta() -> None:
    # Two ranks of one principal at a source that keeps one plan: each pushes the
    # other's out, so every named request is refused (404) and sent again in full.
    cfg = dense_toy_config(torch.bfloat16)

    def keep_one(app: web.Application) -> None:
        app[DELTAS].plans = Plans(keep=1)

    async with served(deltas=True, setup=[keep_one]) as s:
        trainer = DoubleBuffered(s.client, "m", lambda st: megatron_tp_ep(cfg, 2, 1, st))
        states = {1: full_state(cfg, seed=1)}
        pub = await trainer.publish(1, states[1])
        ranks = []
        for rank in (0, 1):
            par = EngineParallel(2, rank, 1)
            eng = zeroed_engine(cfg, par)
            r = DeltaReceiver(
                local=s.client,
                source=s.client,
                model="m",
                engine=eng,
                twin=lambda par=par: ToyEngine(cfg, par),
                capture=capture_for(pub),
            )
            await r.refit(1)
            ranks.append((r, eng, par))
        try:
            for v in (2, 3, 4):
                states[v] = changed(states[v - 1], Change("some", 0.05, v))
                await trainer.publish(v, states[v])
                for r, eng, par in ranks:
                    await r.refit(v)
                    assert r.last is not None and r.last.kind == "delta", r.last.reason
                    assert mismatched(eng, cfg, par, states[v]) == []
        finally:
            for r, _, _ in ranks:
                await r.close()
