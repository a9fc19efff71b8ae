"""Refits through daemons running in this process: a lease expiring or renewed while a
pull is held, and one daemon serving both the trainer and the engine.

Two daemons with real HTTP between them and real shared memory, in this process so
the test can hold the pull mid-flight (a gated copier, the one fake: a real copy
cannot be paused at a chosen byte) and move the source daemon's clock past the
lease's end while it is held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from support.daemons import FakeClock, GatedCopier, daemon_config, serving_daemons
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.daemon.app.node import Daemon
from refitd.errors import ConflictError
from refitd.reshard.types import IncompleteRefit
from refitd.testing.engines import EngineParallel, ModelConfig, ToyEngine, dense_toy_config
from refitd.testing.layouts import Published, fsdp_dim0, full_state
from refitd.wire import PullState

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32


@dataclass(frozen=True)
class Toy:
    """Version 1 of the dense toy model as a trainer published it."""

    cfg: ModelConfig
    state: dict[str, torch.Tensor]  # the full checkpoint
    published: Published
    pubs: list[Any]  # its publishers: close them when done


async def publish_dense(client: RefitClient, model: str, fsdp_ranks: int) -> Toy:
    """Publish the dense toy model as version 1 of ``model`` from ``fsdp_ranks`` ranks."""
    cfg = dense_toy_config()
    state = full_state(cfg)
    published = fsdp_dim0(cfg, fsdp_ranks, state)
    return Toy(cfg, state, published, await publish_layout(client, model, published, 1))


def receiver(
    local: RefitClient,
    source: RefitClient,
    model: str,
    toy: Toy,
    par: EngineParallel,
    engine: ToyEngine,
    **kw: Any,
) -> DaemonReceiver:
    return DaemonReceiver(
        local=local,
        source=source,
        model=model,
        engine=engine,
        twin=lambda: ToyEngine(toy.cfg, par),
        capture=capture_for(toy.published),
        **kw,
    )


async def close(r: DaemonReceiver, toy: Toy) -> None:
    await r.close()
    for p in toy.pubs:
        await p.close()


@dataclass(frozen=True)
class HeldRefit:
    """A refit whose lease at the trainer's daemon ended while its copy was held."""

    refit: asyncio.Task[Any]  # the refit, let go after the lease ended: await it
    receiver: DaemonReceiver
    toy: Toy
    engine: ToyEngine
    engine_client: RefitClient  # a client of the engine's daemon


@contextlib.asynccontextmanager
async def lease_ended_mid_copy(
    par: EngineParallel, mode: str, make_engine: Callable[[ModelConfig, EngineParallel], ToyEngine]
) -> AsyncIterator[HeldRefit]:
    """Two daemons; the dense toy published at the first; a refit of it into the
    engine (``make_engine``) through the second, under a 30 s lease, held mid-copy
    while the first daemon's clock passes the lease's end, then let go."""
    clock, gated = FakeClock(50.0), GatedCopier()
    a = Daemon(daemon_config(node_id="a"), secret=SECRET, clock=clock)
    b = Daemon(daemon_config(node_id="b"), secret=SECRET, copier=gated)
    async with serving_daemons(a, b) as (ca, cb):
        toy = await publish_dense(ca, "m", 2)
        engine = make_engine(toy.cfg, par)
        r = receiver(cb, ca, "m", toy, par, engine, lease_ttl_s=30.0, mode=mode)
        refit = asyncio.create_task(r.refit())
        await gated.entered.wait()
        clock.now += 31.0  # the lease ends while the copy is held
        gated.gate.set()
        yield HeldRefit(refit, r, toy, engine, cb)
        await close(r, toy)


async def test_a_lease_expiring_mid_pull_fails_the_refit_and_installs_nothing() -> None:
    par = EngineParallel(2, 0)
    async with lease_ended_mid_copy(par, "staging", zeroed_engine) as h:
        with pytest.raises(ConflictError, match="expired"):
            await h.refit
        assert all(not p.any() for p in h.engine.parameters())
        [pull] = await h.engine_client.pulls()
        assert pull.state is PullState.FAILED and pull.suspect
        # The same receiver succeeds once the trainer serves a live lease again.
        stats = await h.receiver.refit()
        assert stats.replayed
        assert mismatched(h.engine, h.toy.cfg, par, h.toy.state) == []


async def test_in_direct_mode_a_failed_pull_names_the_suspect_parameters() -> None:
    async with lease_ended_mid_copy(EngineParallel(2, 1), "direct", ToyEngine) as h:
        with pytest.raises(
            ConflictError, match=r"parameters now suspect.*model\.embed_tokens\.weight"
        ):
            await h.refit


async def test_one_daemon_can_serve_both_the_trainer_and_the_engine() -> None:
    d = Daemon(daemon_config(node_id="solo"), secret=SECRET)
    async with serving_daemons(d) as (c,):
        toy = await publish_dense(c, "solo", 4)
        par = EngineParallel(2, 1)
        engine = ToyEngine(toy.cfg, par)
        r = receiver(c, c, "solo", toy, par, engine, max_reads_per_copy=2)
        stats = await r.refit()
        assert stats.full_reads + stats.pack_specs > 0
        assert mismatched(engine, toy.cfg, par, toy.state) == []
        await close(r, toy)


async def test_a_refit_held_past_its_lease_ttl_renews_the_lease_and_succeeds() -> None:
    gated = GatedCopier()
    a = Daemon(daemon_config(node_id="a", transport="shm"), secret=SECRET)
    b = Daemon(daemon_config(node_id="b", transport="shm"), secret=SECRET, copier=gated)
    async with serving_daemons(a, b) as (ca, cb):
        toy = await publish_dense(ca, "m", 2)
        par = EngineParallel(2, 0)
        engine = ToyEngine(toy.cfg, par)
        ttl = 1.5  # real seconds: the daemons run on the real clock here
        r = receiver(cb, ca, "m", toy, par, engine, lease_ttl_s=ttl)
        refit = asyncio.create_task(r.refit())
        await gated.entered.wait()
        keeper = r.lease_keeper
        assert keeper is not None
        # Four renewals, a third of the TTL apart: the pull is held past the TTL.
        await keeper.wait(4)
        assert keeper.renewals >= 4 and keeper.every_s * 4 > ttl and not keeper.stopped
        gated.gate.set()
        stats = await refit
        assert stats.pull.state is PullState.DONE
        assert mismatched(engine, toy.cfg, par, toy.state) == []
        assert r.lease_keeper is None and (await ca.version("m", 1)).leases == 0
        await close(r, toy)


async def test_a_refit_that_would_leave_parameters_unwritten_is_refused_naming_each() -> None:
    d = Daemon(daemon_config(node_id="solo"), secret=SECRET)
    async with serving_daemons(d) as (c,):
        cfg = dense_toy_config()
        state = full_state(cfg)
        published = fsdp_dim0(cfg, 2, state)
        dropped = ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight")
        for name in dropped:  # the trainer forgot to publish them
            del published.sources[name]
        published.manifest = [e for e in published.manifest if e[0] not in dropped]
        toy = Toy(cfg, state, published, await publish_layout(c, "gap", published, 1))
        par = EngineParallel(1, 0)
        engine = zeroed_engine(cfg, par)
        r = receiver(c, c, "gap", toy, par, engine)
        with pytest.raises(IncompleteRefit) as info:
            await r.refit()
        assert set(info.value.missing) == {
            "model.layers.0.self_attn.qkv_proj.weight",  # partly: v rows only
            "model.layers.1.mlp.down_proj.weight",  # wholly
        }
        left, total = info.value.missing["model.layers.0.self_attn.qkv_proj.weight"]
        assert 0 < left < total
        assert "model.layers.1.mlp.down_proj.weight (all" in str(info.value)
        assert await c.pulls() == [] and all(not p.any() for p in engine.parameters())
        # Named as meant to stay untouched, they are; every other parameter refits.
        await r.close()
        r = receiver(c, c, "gap", toy, par, engine, allow_unwritten=info.value.missing)
        await r.refit()
        wrong = set(mismatched(engine, cfg, par, state))
        assert wrong == set(info.value.missing)
        assert not dict(engine.named_parameters())["model.layers.1.mlp.down_proj.weight"].any()
        await close(r, toy)
