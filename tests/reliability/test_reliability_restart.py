"""Restart: the source daemon dies (SIGKILL) or stops (SIGTERM) and comes back on the
same address while receivers keep refitting through it.

Pass: while it is away every refit fails with a clear RefitError (no hang, no other
exception type); nothing recorded under the old incarnation is used again (its lease
is unknown to the new one, and a pull that names the old regions and lease is refused
with nothing moved); once the trainer publishes again each receiver's next refit is
bit for bit the new version.

Two real daemons (``refitd serve``): the source, restarted, and the engines'.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections import Counter

import pytest
import torch
from support.engines import mismatched, zeroed_engine
from support.toy import pull_rows

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.client.spawn import spawn_daemon
from refitd.errors import ConflictError, NotFoundError, RefitError
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import fsdp_dim0, full_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RECEIVERS = 4
MODEL = "restart"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stamped(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, float(version)) for name, t in state.items()}


@pytest.mark.parametrize(
    ("transport", "how"), [("auto", "kill"), ("ucx", "kill"), ("ucx", "term"), ("tcp", "kill")]
)
async def test_receivers_see_a_clear_error_while_the_source_restarts_then_refit_exactly(
    secret_file: str, transport: str, how: str
) -> None:
    cfg = dense_toy_config()
    base = full_state(cfg)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    opts = {"secret_file": secret_file, "transport": transport}
    source_args = ["--port", str(port)]
    par = [EngineParallel(2, i % 2, 1) for i in range(RECEIVERS)]
    engines = [zeroed_engine(cfg, p) for p in par]
    installed: list[int] = [0] * RECEIVERS
    failures: Counter[str] = Counter()
    unclear: list[str] = []
    stop = asyncio.Event()
    progressed = asyncio.Event()
    said: dict[str, str] = {}

    async def all_installed(version: int) -> None:
        async with asyncio.timeout(60):
            while installed != [version] * RECEIVERS:
                progressed.clear()
                await progressed.wait()

    async with (
        spawn_daemon(**opts, node_id="engines", peers=[url]) as b,
        RefitClient(url) as source,  # one client for both incarnations, as a trainer's
        RefitClient(b.url) as local,
    ):
        pub1 = fsdp_dim0(cfg, 2, stamped(base, 1))
        receivers = [
            DaemonReceiver(
                local=local,
                source=source,
                model=MODEL,
                engine=engines[i],
                twin=lambda p=par[i]: ToyEngine(cfg, p),  # type: ignore[misc]
                capture=capture_for(pub1),
                lease_ttl_s=10.0,
            )
            for i in range(RECEIVERS)
        ]

        async def keep_refitting(i: int) -> None:
            while not stop.is_set():
                try:
                    async with asyncio.timeout(30):  # a hang is a failure
                        stats = await receivers[i].refit()
                    installed[i] = stats.version
                    progressed.set()
                except RefitError as exc:
                    failures[type(exc).__name__] += 1
                    said.setdefault(type(exc).__name__, str(exc).splitlines()[0][:160])
                    if not str(exc):
                        unclear.append(f"{type(exc).__name__} with no message")
                    await asyncio.sleep(0.05)
                except Exception as exc:  # anything else is not a clear error
                    unclear.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.05)

        async with spawn_daemon(**opts, node_id="source", extra_args=source_args) as a1:
            pubs1 = await publish_layout(source, MODEL, pub1, 1)
            lease = await source.acquire_lease(MODEL, 1, 60.0, label="test")
            loops = [asyncio.create_task(keep_refitting(i)) for i in range(RECEIVERS)]
            await all_installed(1)
            for i in range(RECEIVERS):
                assert mismatched(engines[i], cfg, par[i], stamped(base, 1)) == []
            old = await source.manifest(MODEL, 1)
            old_regions = {sh.region for t in old.tensors for sh in t.shards}
            assert receivers[0].memory.engine is not None
            dst = receivers[0].memory.engine.region
            if how == "kill":
                os.kill(a1.pid, signal.SIGKILL)
            # (on "term", leaving the block stops it with SIGTERM)
        for p in pubs1:
            await p.close()
        await asyncio.sleep(1.0)  # receivers run into the gap
        during = sum(failures.values())

        async with spawn_daemon(**opts, node_id="source", extra_args=source_args) as a2:
            assert a2.pid != a1.pid
            pubs2 = await publish_layout(source, MODEL, fsdp_dim0(cfg, 2, stamped(base, 2)), 2)
            await all_installed(2)
            stop.set()
            await asyncio.gather(*loops)
            for i in range(RECEIVERS):
                assert mismatched(engines[i], cfg, par[i], stamped(base, 2)) == []

            # Nothing of the old incarnation is honoured by the new one ...
            with pytest.raises(ConflictError, match="unknown or was released"):
                await source.check_lease(lease.lease_id, MODEL, 1)
            # ... and a pull naming its regions and lease moves nothing.
            before = engines[0].state_dict()
            before = {k: v.clone() for k, v in before.items()}
            rid = min(old_regions)
            stale = pull_rows(MODEL, 1, lease.lease_id, (rid, 0, dst.region_id, 0, 64), source=url)
            with pytest.raises((ConflictError, NotFoundError)):
                await local.pull(stale)
            after = engines[0].state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)
            for r in receivers:
                await r.close()
            for p in pubs2:
                await p.close()

    print(
        f"\nrestart ({transport}, {how}): {during} refits refused while the source was away "
        f"{dict(failures)}; every receiver then refit version 2 exactly; {len(unclear)} unclear"
    )
    for name, text in sorted(said.items()):
        print(f"  e.g. {name}: {text}")
    assert during > 0  # the receivers did run into the restart
    assert unclear == []
