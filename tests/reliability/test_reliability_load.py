"""Load: 16 receivers refit 10 times each against one source daemon, all at once;
then they keep going until the engines' daemon has run 1,000 pulls.

Pass: no refit fails, every receiver completes its refits, and the daemons' resident
memory and open file descriptors after 1,000 pulls are within 10% of what they were
after 100 (nothing grows per pull). p50/p99 of the refit time are printed.

Two real daemons (``refitd serve``): the source (the trainer's, one published
version) and the engines' (every receiver's local daemon, which runs the pulls).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.client.spawn import spawn_daemon
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import fsdp_dim0, full_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RECEIVERS = 16
REFITS = 10
EARLY, LATE = 100, 1000
GROWTH = 0.10


@dataclass(frozen=True)
class Usage:
    rss_kib: int
    fds: int

    @staticmethod
    def of(pid: int) -> Usage:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        rss = next(int(ln.split()[1]) for ln in status if ln.startswith("VmRSS:"))
        return Usage(rss, len(os.listdir(f"/proc/{pid}/fd")))


def within(early: Usage, late: Usage) -> bool:
    return late.rss_kib <= early.rss_kib * (1 + GROWTH) and late.fds <= early.fds * (1 + GROWTH)


async def test_sixteen_receivers_refit_without_error_and_the_daemons_do_not_grow_per_pull(
    secret_file: str,
) -> None:
    cfg = dense_toy_config()
    state = full_state(cfg)
    par = EngineParallel()
    seconds: list[float] = []
    done = [0] * RECEIVERS
    errors: list[str] = []
    usage: dict[int, dict[str, Usage]] = {}
    async with (
        spawn_daemon(secret_file=secret_file, node_id="source") as a,
        spawn_daemon(secret_file=secret_file, node_id="engines", peers=[a.url]) as b,
        RefitClient(a.url) as source,
        RefitClient(b.url) as local,
    ):
        pub = fsdp_dim0(cfg, 2, state)
        pubs = await publish_layout(source, "load", pub, 1)
        engines = [zeroed_engine(cfg, par) for _ in range(RECEIVERS)]
        receivers = [
            DaemonReceiver(
                local=local,
                source=source,
                model="load",
                engine=engine,
                twin=lambda: ToyEngine(cfg, par),
                capture=capture_for(pub),
            )
            for engine in engines
        ]

        def count() -> None:
            n = sum(done)
            if n in (EARLY, LATE):
                usage[n] = {"source": Usage.of(a.pid), "engines": Usage.of(b.pid)}

        async def refits(i: int, n: int) -> None:
            for _ in range(n):
                try:
                    stats = await receivers[i].refit()
                except Exception as exc:
                    errors.append(f"receiver {i}: {type(exc).__name__}: {exc}")
                    continue
                seconds.append(stats.total_s)
                done[i] += 1
                count()

        t0 = time.perf_counter()
        await asyncio.gather(*(refits(i, REFITS) for i in range(RECEIVERS)))
        wall = time.perf_counter() - t0
        first = list(seconds)
        assert errors == [], errors[:5]
        assert done == [REFITS] * RECEIVERS
        assert all(mismatched(e, cfg, par, state) == [] for e in engines)
        # Keep going to 1,000 pulls for the growth check.
        more = -(-(LATE - sum(done)) // RECEIVERS)
        await asyncio.gather(*(refits(i, more) for i in range(RECEIVERS)))
        assert errors == [], errors[:5]
        for r in receivers:
            await r.close()
        for p in pubs:
            await p.close()

    q = statistics.quantiles(first, n=100, method="inclusive")
    print(
        f"\nload: {RECEIVERS} receivers x {REFITS} refits in {wall:.2f} s, 0 errors; refit time "
        f"p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"
    )
    for who in ("source", "engines"):
        e, late = usage[EARLY][who], usage[LATE][who]
        print(
            f"{who} daemon after {EARLY} / {LATE} pulls: RSS {e.rss_kib} / {late.rss_kib} KiB "
            f"({(late.rss_kib / e.rss_kib - 1) * 100:+.1f}%), open fds {e.fds} / {late.fds} "
            f"({(late.fds / e.fds - 1) * 100:+.1f}%)"
        )
    for who in ("source", "engines"):
        assert within(usage[EARLY][who], usage[LATE][who]), (who, usage)
