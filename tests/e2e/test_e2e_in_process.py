"""Refits through daemons running in this process: lease expiry mid-pull, one daemon.

Two daemons with real HTTP between them and real shared memory, in this process so
the test can hold the pull mid-flight (a gated copier, the one fake: a real copy
cannot be paused at a chosen byte) and move the source daemon's clock past the
lease's end while it is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from refitd.bench.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.bench.layouts import fsdp_dim0, full_state
from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.daemon.copier import Progress, ThreadCopier
from refitd.daemon.node import Daemon, DaemonOptions
from refitd.daemon.schemas import PullState
from refitd.daemon.serve import listening
from refitd.errors import ConflictError

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class GatedCopier:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def copy(
        self,
        srcs: Sequence[memoryview],
        dsts: Sequence[memoryview],
        rows: np.ndarray,
        progress: Progress,
    ) -> None:
        self.entered.set()
        await self.gate.wait()
        await ThreadCopier().copy(srcs, dsts, rows, progress)


async def test_a_lease_expiring_mid_pull_fails_the_refit_and_installs_nothing() -> None:
    clock, gated = Clock(), GatedCopier()
    a = Daemon(DaemonOptions(port=0, node_id="a", secret=SECRET), clock=clock)
    b = Daemon(DaemonOptions(port=0, node_id="b", secret=SECRET), copier=gated)
    async with (
        listening(a.options, daemon=a) as (_, url_a),
        listening(b.options, daemon=b) as (_, url_b),
        RefitClient(url_a) as ca,
        RefitClient(url_b) as cb,
    ):
        cfg = dense_toy_config()
        state = full_state(cfg)
        published = fsdp_dim0(cfg, 2, state)
        pubs = await publish_layout(ca, "m", published, 1)
        par = EngineParallel(2, 0)
        engine = ToyEngine(cfg, par)
        with torch.no_grad():
            for p in engine.parameters():
                p.zero_()
        r = DaemonReceiver(
            local=cb,
            source=ca,
            model="m",
            engine=engine,
            twin=lambda: ToyEngine(cfg, par),
            capture=capture_for(published),
            lease_ttl_s=30.0,
            mode="staging",
        )
        refit = asyncio.create_task(r.refit())
        await gated.entered.wait()
        clock.now += 31.0  # the lease ends while the copy is held
        gated.gate.set()
        with pytest.raises(ConflictError, match="expired"):
            await refit
        assert all(not p.any() for p in engine.parameters())
        [pull] = await cb.pulls()
        assert pull.state is PullState.FAILED and pull.suspect
        # The same receiver succeeds once the trainer serves a live lease again.
        stats = await r.refit()
        assert stats.replayed
        truth = ToyEngine(cfg, par)
        truth.load_weights(state.items())
        want = dict(truth.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in engine.named_parameters())
        await r.close()
        for p in pubs:
            await p.close()


async def test_in_direct_mode_a_failed_pull_names_the_suspect_parameters() -> None:
    clock, gated = Clock(), GatedCopier()
    a = Daemon(DaemonOptions(port=0, node_id="a", secret=SECRET), clock=clock)
    b = Daemon(DaemonOptions(port=0, node_id="b", secret=SECRET), copier=gated)
    async with (
        listening(a.options, daemon=a) as (_, url_a),
        listening(b.options, daemon=b) as (_, url_b),
        RefitClient(url_a) as ca,
        RefitClient(url_b) as cb,
    ):
        cfg = dense_toy_config()
        published = fsdp_dim0(cfg, 2, full_state(cfg))
        pubs = await publish_layout(ca, "m", published, 1)
        par = EngineParallel(2, 1)
        engine = ToyEngine(cfg, par)
        r = DaemonReceiver(
            local=cb,
            source=ca,
            model="m",
            engine=engine,
            twin=lambda: ToyEngine(cfg, par),
            capture=capture_for(published),
            lease_ttl_s=30.0,
            mode="direct",
        )
        refit = asyncio.create_task(r.refit())
        await gated.entered.wait()
        clock.now += 31.0
        gated.gate.set()
        with pytest.raises(
            ConflictError, match=r"parameters now suspect.*model\.embed_tokens\.weight"
        ):
            await refit
        await r.close()
        for p in pubs:
            await p.close()


async def test_one_daemon_can_serve_both_the_trainer_and_the_engine() -> None:
    d = Daemon(DaemonOptions(port=0, node_id="solo", secret=SECRET))
    async with listening(d.options, daemon=d) as (_, url), RefitClient(url) as c:
        cfg = dense_toy_config()
        state = full_state(cfg)
        published = fsdp_dim0(cfg, 4, state)
        pubs = await publish_layout(c, "solo", published, 1)
        par = EngineParallel(2, 1)
        engine = ToyEngine(cfg, par)
        r = DaemonReceiver(
            local=c,
            source=c,
            model="solo",
            engine=engine,
            twin=lambda: ToyEngine(cfg, par),
            capture=capture_for(published),
            max_segments_per_copy=2,
        )
        stats = await r.refit()
        assert stats.full_pulls + stats.pack_specs > 0
        truth = ToyEngine(cfg, par)
        truth.load_weights(state.items())
        want = dict(truth.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in engine.named_parameters())
        await r.close()
        for p in pubs:
            await p.close()


async def test_a_refit_held_past_its_lease_ttl_renews_the_lease_and_succeeds() -> None:
    gated = GatedCopier()
    a = Daemon(DaemonOptions(port=0, node_id="a", secret=SECRET, transport="shm"))
    b = Daemon(DaemonOptions(port=0, node_id="b", secret=SECRET, transport="shm"), copier=gated)
    async with (
        listening(a.options, daemon=a) as (_, url_a),
        listening(b.options, daemon=b) as (_, url_b),
        RefitClient(url_a) as ca,
        RefitClient(url_b) as cb,
    ):
        cfg = dense_toy_config()
        state = full_state(cfg)
        published = fsdp_dim0(cfg, 2, state)
        pubs = await publish_layout(ca, "m", published, 1)
        par = EngineParallel(2, 0)
        engine = ToyEngine(cfg, par)
        ttl = 1.5  # real seconds: the daemons run on the real clock here
        r = DaemonReceiver(
            local=cb,
            source=ca,
            model="m",
            engine=engine,
            twin=lambda: ToyEngine(cfg, par),
            capture=capture_for(published),
            lease_ttl_s=ttl,
        )
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
        truth = ToyEngine(cfg, par)
        truth.load_weights(state.items())
        want = dict(truth.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in engine.named_parameters())
        assert r.lease_keeper is None and (await ca.version("m", 1)).leases == 0
        await r.close()
        for p in pubs:
            await p.close()
