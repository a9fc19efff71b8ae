"""How many HTTP requests a warm cross-host refit costs, counted (issue 50).

Two real daemons in this process, each with its own boot id, so that each is
"another host" to the other and a pull between them goes over the ``tcp`` data
plane (no same-host shared-memory path); a trainer publishes the dense toy model
at one (the source), a toy engine refits from it through the other (its own).
An aiohttp middleware on each daemon's app counts every request it answers, by
method and route: the engine's own requests and the requests its daemon makes to
the source alike. The test counts the second refit (the first compiled the plan
and opened the data-plane connection: that one is cold).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch
from aiohttp import web
from support.daemons import daemon_config, served, trusting_each_other
from support.deltas import Change, DoubleBuffered, changed
from support.engines import SwapEngine, mismatched, swap_engine, zeroed_engine
from support.toy import publish_tensor, pull_rows

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep
from refitd.wire import DescriptorTable, PullState
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"c" * 32

WARM_FULL_REFIT_REQUESTS = 5
"""The most HTTP requests a warm cross-host full refit may make, all daemons together."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Requests:
    """Every request the daemons answered while :attr:`on`, as ``(daemon, method,
    route)``, in order."""

    on: bool = False
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    #: the body bytes of each request of :attr:`seen`
    sizes: list[int] = field(default_factory=list)

    def counting(self, name: str) -> Callable[[web.Application], None]:
        """A setup hook that counts the requests of the daemon ``name``."""

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            if self.on:
                info = request.match_info.route.resource
                route = info.canonical if info is not None else request.path
                self.seen.append((name, request.method, route))
                self.sizes.append(request.content_length or 0)
            return await handler(request)

        def setup(app: web.Application) -> None:
            app.middlewares.insert(0, count)

        return setup

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        self.seen.clear()
        self.sizes.clear()
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def table(self) -> str:
        """The requests, counted by daemon, method and route (for a failure's message)."""
        counts = collections.Counter(self.seen)
        return "\n".join(f"{n} x {d} {m} {r}" for (d, m, r), n in sorted(counts.items()))


@contextlib.asynccontextmanager
async def two_hosts(requests: Requests) -> AsyncIterator[SwapEngine]:
    """The source daemon (host "a") and the engine's daemon (host "b"), trusting each
    other, each counted; a swap-mode toy engine at "b" refitting from "a"."""
    a = Daemon(daemon_config(node_id="a"), secret=SECRET, boot_id="host-a")
    b = Daemon(daemon_config(node_id="b"), secret=SECRET, boot_id="host-b")
    async with (
        served(a, setup=[requests.counting("source")]) as sa,
        served(b, setup=[requests.counting("engine's")]) as sb,
    ):
        trusting_each_other(sa, sb)
        async with swap_engine(sb.client, sa.client) as toy:
            yield toy


async def refit_counted(toy: SwapEngine, requests: Requests, version: int) -> None:
    with requests.counted():
        stats = await toy.receiver.refit(version)
    assert stats.pull.state is PullState.DONE and stats.pull.path == "tcp"
    assert toy.mismatched(version) == []


async def test_a_warm_cross_host_full_refit_makes_at_most_five_http_requests() -> None:
    requests = Requests()
    async with two_hosts(requests) as toy:
        await toy.publish(1)
        await refit_counted(toy, requests, 1)  # cold: plans, opens the tcp lanes
        cold = len(requests.seen)
        await toy.publish(2)
        await refit_counted(toy, requests, 2)
        warm = len(requests.seen)
        print(f"cold full refit: {cold} requests; warm: {warm}\n{requests.table()}")
        assert warm <= WARM_FULL_REFIT_REQUESTS, (
            f"a warm cross-host full refit made {warm} HTTP requests, more than "
            f"{WARM_FULL_REFIT_REQUESTS}:\n{requests.table()}"
        )


async def test_the_counter_counts_every_request_of_either_daemon() -> None:
    requests = Requests()
    a = Daemon(daemon_config(node_id="a"), secret=SECRET)
    async with served(a, setup=[requests.counting("a")]) as sa:
        with requests.counted():
            await sa.client.health()
            await sa.client.regions()
        async with RefitClient(sa.url) as c:
            await c.health()  # not counted: outside the block
    assert requests.seen == [
        ("a", "GET", "/v1/health"),
        ("a", "GET", "/v1/regions"),
    ]


WARM_DELTA_REFIT_REQUESTS = 5
"""The most HTTP requests a warm cross-host delta refit may make, all daemons together."""


async def test_a_warm_cross_host_delta_refit_makes_at_most_five_http_requests() -> None:
    cfg = dense_toy_config(torch.bfloat16)
    requests = Requests()
    a = Daemon(daemon_config(node_id="a", deltas=True), secret=SECRET, boot_id="host-a")
    b = Daemon(daemon_config(node_id="b"), secret=SECRET, boot_id="host-b")
    async with (
        served(a, setup=[requests.counting("source")]) as sa,
        served(b, setup=[requests.counting("engine's")]) as sb,
    ):
        trusting_each_other(sa, sb)
        trainer = DoubleBuffered(sa.client, "m", lambda st: megatron_tp_ep(cfg, 2, 1, st))
        states = {1: full_state(cfg, seed=1)}
        pub = await trainer.publish(1, states[1])
        par = EngineParallel(4, 1, 1)
        eng = zeroed_engine(cfg, par)
        r = DeltaReceiver(
            local=sb.client,
            source=sa.client,
            model="m",
            engine=eng,
            twin=lambda: ToyEngine(cfg, par),
            capture=capture_for(pub),
            max_reads_per_copy=2,
        )
        try:
            await r.refit(1)
            kinds, counts = [], []
            # The trainer double-buffers: v4 lands where v2 did, so its plan is v2's.
            for v in (2, 3, 4):
                states[v] = changed(states[v - 1], Change("some", 0.05, v))
                await trainer.publish(v, states[v])
                with requests.counted():
                    await r.refit(v)
                assert r.last is not None
                kinds.append(r.last.kind)
                counts.append(len(requests.seen))
                assert mismatched(eng, cfg, par, states[v]) == []
            asked = [
                n for s, n in zip(requests.seen, requests.sizes, strict=True) if "delta" in s[2]
            ]
            plan = len(DescriptorTable.pack(r._compiled.rows).table) if r._compiled else 0
            print(
                f"delta refits {kinds}: {counts} requests; the delta request's body "
                f"{asked} bytes, the plan's {plan}\n{requests.table()}"
            )
            assert kinds == ["delta", "delta", "delta"]
            assert counts[-1] <= WARM_DELTA_REFIT_REQUESTS, requests.table()
            assert sum(asked) < plan, f"the warm delta refit uploaded its plan ({asked} bytes)"
        finally:
            await r.close()


MIRRORED_PULL_REQUESTS = 6
"""The most HTTP requests a pull served from a host mirror may make, all daemons together."""


async def test_a_pull_served_from_a_host_mirror_makes_at_most_six_http_requests() -> None:
    requests = Requests()
    a = Daemon(daemon_config(node_id="a"), secret=SECRET, boot_id="host-a")
    b = Daemon(daemon_config(node_id="b", policy="always"), secret=SECRET, boot_id="host-b")
    async with (
        served(a, setup=[requests.counting("source")]) as sa,
        served(b, setup=[requests.counting("engine's")]) as sb,
    ):
        trusting_each_other(sa, sb)
        nbytes = 4 << 20
        region = await sa.client.create_region(nbytes, label="w")
        with SharedSegment.attach(region.handle, nbytes) as seg:
            seg.numpy()[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
        await publish_tensor(sa.client, "m", 1, region.region_id, nbytes)
        counts = []
        for _ in range(2):  # the first pull makes the mirror, the second finds it
            dst = SharedSegment.create(nbytes, "dst")
            with dst:
                info = await sb.client.attach_region(dst.name, nbytes)
                with requests.counted():
                    lease = await sa.client.acquire_lease("m", 1)
                    req = pull_rows(
                        "m",
                        1,
                        lease.lease_id,
                        (region.region_id, 0, info.region_id, 0, nbytes),
                        source=sa.url,
                    )
                    req = msgspec.structs.replace(req, grant=lease.records)
                    res = await sb.client.pull(req)
                    await sa.client.release_lease(lease.lease_id)
                assert res.state is PullState.DONE and res.path.startswith("shm"), res
                assert (dst.numpy() == np.arange(nbytes, dtype=np.uint64).astype(np.uint8)).all()
                counts.append(len(requests.seen))
                print(f"mirrored pull: {counts[-1]} requests\n{requests.table()}")
                await sb.client.delete_region(info.region_id)
        assert counts[-1] <= MIRRORED_PULL_REQUESTS, requests.table()
