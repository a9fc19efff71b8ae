"""No torn reads: a trainer rewrites the same regions for 100 versions while four
receivers refit continuously, and every model a receiver installs is exactly one
version.

Every element of version ``v`` holds the value ``v`` (float32, exact), so a pull that
read part of one version and part of the next, or an install that mixed two, differs
from what the engine's own loader makes of that one version. The trainer follows the documented protocol:
before rewriting the memory of version ``v`` for ``v + 1`` it retires ``v`` and waits
for its leases to drain (``Publisher.wait_drain``). A receiver that lost the race
for a version (retired before its lease) is refused with ConflictError and simply
refits again; that is counted, not failed.

Two real daemons (``refitd serve``): the trainer's and the engines'.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter

import pytest
import torch
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.client.spawn import spawn_daemon
from refitd.errors import ConflictError, NotFoundError
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import fsdp_dim0, full_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VERSIONS = int(os.environ.get("REFITD_TEST_TORN_VERSIONS", "100"))
RECEIVERS = 4
MODEL = "torn"


def stamped(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, float(version)) for name, t in state.items()}


def installed_versions(engine: torch.nn.Module, names: list[str]) -> set[float]:
    params = dict(engine.named_parameters())
    return {float(v) for n in names for v in torch.unique(params[n].detach()).tolist()}


async def test_four_receivers_refitting_through_100_rewrites_never_install_a_torn_model(
    secret_file: str,
) -> None:
    cfg = dense_toy_config()  # float32: every version number is exact
    base = full_state(cfg)
    installs: Counter[int] = Counter()
    per_receiver: list[list[int]] = [[] for _ in range(RECEIVERS)]
    torn: list[str] = []
    refused = 0
    published = asyncio.Event()
    done = False
    async with (
        spawn_daemon(secret_file=secret_file, node_id="trainer") as a,
        spawn_daemon(secret_file=secret_file, node_id="engines", peers=[a.url]) as b,
        RefitClient(a.url) as trainer,
        RefitClient(b.url) as local,
    ):
        pub = fsdp_dim0(cfg, 2, stamped(base, 1))
        pubs = await publish_layout(trainer, MODEL, pub, 1)
        capture = capture_for(pub)

        async def receive(i: int) -> None:
            nonlocal refused
            par = EngineParallel(2, i % 2, 1)
            engine = zeroed_engine(cfg, par)
            r = DaemonReceiver(
                local=local,
                source=trainer,
                model=MODEL,
                engine=engine,
                twin=lambda: ToyEngine(cfg, par),
                capture=capture,
            )
            try:
                while not done:
                    try:
                        stats = await r.refit()
                    except (ConflictError, NotFoundError):
                        # Retired between "latest" and the lease, or none READY while
                        # the trainer rewrites: a clear refusal; try again.
                        refused += 1
                        await asyncio.sleep(0.01)
                        continue
                    # Bit for bit what the engine's own loader makes of version v alone
                    # (elements no checkpoint value reaches, e.g. padding, stay 0).
                    wrong = mismatched(engine, cfg, par, stamped(base, stats.version))
                    if wrong:
                        seen = sorted(installed_versions(engine, wrong))
                        torn.append(f"receiver {i}: v{stats.version}: {wrong[:3]} hold {seen}")
                    installs[stats.version] += 1
                    per_receiver[i].append(stats.version)
                    published.set()
            finally:
                await r.close()

        async def installed(v: int, within_s: float) -> None:
            """Until some receiver installed ``v`` (or ``within_s`` passed)."""
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within_s):
                    while installs[v] == 0:
                        published.clear()
                        await published.wait()

        async def train() -> None:
            nonlocal done
            start = time.monotonic()
            for v in range(2, VERSIONS + 1):
                # Let a receiver install v - 1 before it is retired, so the receivers
                # see most versions; the others are mid-refit while it drains.
                await installed(v - 1, 2.0)
                await pubs[0].wait_drain(v - 1)  # retired, no reader left: safe to rewrite
                await publish_layout(trainer, MODEL, fsdp_dim0(cfg, 2, stamped(base, v)), v, pubs)
                if v % 25 == 0:
                    print(f"v{v} published at {time.monotonic() - start:.1f} s", flush=True)
            await installed(VERSIONS, 10.0)
            done = True

        tasks = [asyncio.create_task(receive(i)) for i in range(RECEIVERS)]
        await train()
        await asyncio.gather(*tasks)
        for p in pubs:
            await p.close()

    checked = sum(installs.values())
    print(
        f"\ntorn reads: {len(torn)} in {checked} installed models; {len(installs)} of "
        f"{VERSIONS} versions checked; {refused} refits refused cleanly (retired before leased, or none READY mid-rewrite); "
        f"per receiver {[len(x) for x in per_receiver]}"
    )
    assert torn == []
    assert all(per_receiver), "a receiver never installed a model"
    assert all(x == sorted(x) for x in per_receiver)  # versions only move forward
    assert installs[VERSIONS] > 0
    assert len(installs) >= VERSIONS // 2
