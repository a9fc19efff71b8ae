"""Across hosts with the etcd registry: a trainer split over two hosts (FSDP, 4 ranks,
2 per host), an engine (TP 2) on a third, etcd on a fourth. The engine's daemon finds
the version's holders in etcd and pulls from both, over the path ``auto`` picks
(refitd's ``tcp`` lanes) and over forced ``ucx`` (UCX over tcp)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest
from support.etcd import needs_etcd
from support.hosts import cluster_of, needs_hosts, sent_over, tx_bytes

from refitd.cluster.etcdserver import run_etcd

pytestmark = [
    needs_hosts,
    needs_etcd,
    pytest.mark.skipif(shutil.which("tc") is None, reason="no `tc` (iproute2) to slow a link"),
    pytest.mark.timeout(300),
]

GIB = 0.01
TTL = 2.0
COMMON = {"model": "m", "gib": GIB, "layout": "fsdp", "world": 4}


def registry(endpoint: str) -> list[str]:
    return [
        "--set",
        "registry.kind=etcd",
        "--set",
        f"registry.endpoints={endpoint}",
        "--set",
        f"registry.lease_ttl_s={TTL}",
    ]


async def count(worker: object, url: str, state: str) -> int:
    """Pulls of the engine's daemon in ``state`` (asked through the engine's worker)."""
    pulls = (await worker.call("pulls", local=url))["pulls"]  # type: ignore[attr-defined]
    return sum(1 for p in pulls if p["state"] == state)


async def sh(host: object, *argv: str) -> None:
    proc = await host.exec(*argv)  # type: ignore[attr-defined]
    assert await proc.wait() == 0, argv


@pytest.mark.parametrize(("mode", "path"), [("auto", "tcp"), ("ucx", "ucx")])
async def test_a_trainer_over_two_hosts_refits_an_engine_on_a_third_and_survives_a_dead_host(
    tmp_path: Path, mode: str, path: str
) -> None:
    async with cluster_of(tmp_path, "etcd", "t1", "t2", "eng") as (cluster, (eh, h1, h2, hg)):
        etcd = await cluster.stack.enter_async_context(
            run_etcd(tmp_path / "etcd", host=eh.address, port=2379, prefix=eh.wrap([]))
        )
        reg = registry(etcd.endpoint)
        d1 = await cluster.daemon(h1, "trainer-1", *reg, transport=mode)
        d2cm = cluster.daemon_cm(h2, "trainer-2", *reg, transport=mode)
        d2 = await d2cm.__aenter__()
        dg = await cluster.daemon(hg, "engine", *reg, transport=mode)
        w1, w2, engine, watcher = [await cluster.worker(h) for h in (h1, h2, hg, hg)]

        async def publish(version: int, w2_: object, d2_: object) -> None:
            outs = await asyncio.gather(
                w1.call("publish", url=d1.url, ranks=[0, 1], version=version, **COMMON),
                w2_.call("publish", url=d2_.url, ranks=[2, 3], version=version, **COMMON),  # type: ignore[attr-defined]
            )
            assert all(o["ok"] for o in outs), outs

        async def refit(version: int, **kw: object) -> dict[str, object]:
            return await engine.call("refit", local=dg.url, tp=2, version=version, **COMMON, **kw)

        try:
            # Versions 1 and 2: bit-exact from both hosts over the path; 2 replays the plan.
            for version in (1, 2):
                await publish(version, w2, d2)
                sent = await tx_bytes(h2)
                got = await refit(version)
                assert got["ok"], got
                assert got["paths"] == [path] and got["verified"] is True
                assert got["replayed"] is (version == 2)
                # trainer-2's half of the bytes crossed its link (not a shared kernel path).
                assert await tx_bytes(h2) - sent >= 0.4 * got["bytes"]  # type: ignore[operator]

            # Version 3: trainer-2's daemon is killed mid-refit.
            await publish(3, w2, d2)
            # trainer-2's link is slowed (about 10 s for its share), so its reads are
            # still running when its daemon is killed.
            await sh(h2, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                     "rate", "4mbit", "burst", "16kb", "latency", "1s")  # fmt: skip
            sent = await tx_bytes(h2)
            assert (await engine.call("refit_start", local=dg.url, tp=2, version=3,
                                      previous=2, **COMMON))["ok"]  # fmt: skip
            # The engine worker answers the refit when it ends; meanwhile a second
            # worker on the engine's host asks its daemon for the pulls.
            outcome = asyncio.ensure_future(engine.call("refit_wait"))
            # Mid-transfer: trainer-2 has sent over 1 MiB of its ~5 MiB share (control
            # messages are a few KiB), so its reads are under way. A refit that ended
            # before that (failed early, or pulled nothing over trainer-2's link) fails
            # here with its outcome, not as a timeout.
            try:
                async with asyncio.timeout(120):
                    crossed = await sent_over(h2, sent, 1 << 20, outcome)
            except TimeoutError:
                crossed = False
            pulls_seen = (await watcher.call("pulls", local=dg.url))["pulls"]
            assert crossed, (
                f"1 MiB never left trainer-2 ({await tx_bytes(h2) - sent} B did); the v3 "
                f"refit: {outcome.result() if outcome.done() else 'still running'}; "
                f"the engine's pulls: {pulls_seen}"
            )
            os.kill(d2.pid, signal.SIGKILL)
            failed = await outcome
            assert failed["ok"] is False, (failed, pulls_seen)
            assert "'trainer-2'" in str(failed["detail"]), failed
            assert failed["unchanged"] is True  # nothing of v3 was installed
            # The engine's daemon keeps serving.
            assert (await engine.call("pulls", local=dg.url))["ok"]
            await sh(h2, "tc", "qdisc", "del", "dev", "eth0", "root")
        finally:
            await d2cm.__aexit__(None, None, None)

        # trainer-2's host comes back: a new daemon, its ranks published again.
        d2 = await cluster.daemon(h2, "trainer-2", *reg, transport=mode)
        w2b = await cluster.worker(h2)
        out = await w2b.call("publish", url=d2.url, ranks=[2, 3], version=3, **COMMON)
        assert out["ok"], out
        got = await refit(3)
        assert got["ok"], got
        assert got["verified"] is True and got["paths"] == [path]
