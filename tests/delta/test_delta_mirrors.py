"""Deltas through a host mirror (`[mirrors] policy = "always"` on the engine's host).

A full refit's pull goes through the mirror; a delta's changed units come from the
source daemon itself, streamed in the answer to the engine's request (no pull of the
engine's daemon reads them), so the mirror is no obstacle: the engine refits by
delta and holds exactly the version.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from support.deltas import Change, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.client.http import RefitClient
from refitd.client.spawn import SpawnedDaemon, spawn_daemon
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import fsdp_dim0, full_state

pytestmark = pytest.mark.timeout(180)

CFG = dense_toy_config(torch.bfloat16)
PAR = EngineParallel(1, 0, 1)


def layout(state: dict[str, torch.Tensor]) -> Any:
    return fsdp_dim0(CFG, 1, state)  # whole tensors, read by rows


@contextlib.asynccontextmanager
async def daemon(secret_file: str, name: str, *extra: str) -> AsyncIterator[SpawnedDaemon]:
    async with spawn_daemon(
        secret_file=secret_file,
        transport="tcp",
        node_id=name,
        extra_args=["--set", "peers.allow=http://127.0.0.1:*", *extra],
    ) as d:
        yield d


async def test_an_engine_behind_a_host_mirror_refits_by_delta_exactly(secret_file: str) -> None:
    async with (
        daemon(secret_file, "trainer", "--set", "pulls.deltas=true") as t,
        daemon(secret_file, "engine-host", "--set", "mirrors.policy=always") as h,
        RefitClient(t.url) as tc,
        RefitClient(h.url) as hc,
    ):
        trainer = DoubleBuffered(tc, "m", layout)
        state = full_state(CFG, seed=4)
        await trainer.publish(1, state)
        r = DeltaReceiver(
            local=hc,
            source=tc,
            model="m",
            engine=zeroed_engine(CFG, PAR),
            twin=lambda: ToyEngine(CFG, PAR),
            capture=capture_for(layout(state)),
            max_reads_per_copy=2,
        )
        await r.refit(1)
        for v in (2, 3):
            state = changed(state, Change("some", 0.05, v))
            await trainer.publish(v, state)
            await r.refit(v)
            assert r.last is not None and r.last.kind == "delta", r.last
            assert mismatched(r.engine, CFG, PAR, state) == []
        await r.close()
