"""A hung source daemon fails only the pulls that read from it.

Real daemons in this process (real HTTP on 127.0.0.1, real shared memory, real UCX
data-plane processes). UCX runs over tcp only (``UCX_TLS=tcp``, set before any
data-plane process starts), where a GET needs the source's data-plane process to
answer: stopping that process (SIGSTOP) makes the source hang the way a wedged or
unreachable host does, while its HTTP API still answers. The engine daemon reads
every peer over UCX (``transport="ucx"``) with a short ``pull_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
from support.daemons import daemon_config, served

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import RefitError
from refitd.wire import DescriptorTable, ManifestIn, PullRequest, PullState, ShardEntry, TensorEntry
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"i" * 32
NBYTES = 4 << 20
DEADLINE_S = 3.0
SAFETY_S = 120.0  # a safety net on waits for a restarted data plane, never reached


@dataclass
class Node:
    daemon: Daemon
    client: RefitClient
    url: str


@contextlib.asynccontextmanager
async def node(name: str, **options: object) -> AsyncIterator[Node]:
    options.setdefault("allow", ("http://127.0.0.1:*",))  # the other test daemons
    d = Daemon(daemon_config(node_id=name, **options), secret=SECRET)
    async with served(d) as s:
        yield Node(d, s.client, s.url)


async def publish(src: Node, model: str, seed: int) -> tuple[int, np.ndarray]:
    """``model`` v1: one uint8 tensor of NBYTES random bytes; returns region and bytes."""
    info = await src.client.create_region(NBYTES, label="w")
    data = np.random.default_rng(seed).integers(0, 256, NBYTES, dtype=np.uint8)
    with SharedSegment.attach(info.handle, info.nbytes) as seg:
        seg.numpy()[:] = data
    shard = ShardEntry((0,), (NBYTES,), info.region_id, 0)
    await src.client.publish(
        ManifestIn(model, 1, 0, 1, [TensorEntry("w", (NBYTES,), "uint8", [shard])])
    )
    return info.region_id, data


@dataclass
class Source:
    node: Node
    model: str
    region: int
    data: np.ndarray
    lease: str = ""


async def request(src: Source, dst_region: int) -> PullRequest:
    if not src.lease:
        src.lease = (await src.node.client.acquire_lease(src.model, 1, ttl_s=120)).lease_id
    rows = np.array([[src.region, 0, dst_region, 0, NBYTES]], dtype=np.int64)
    return PullRequest(src.model, 1, src.lease, DescriptorTable.pack(rows), [], src.node.url)


async def _pull_once_serving(
    engine: Node, src: Node, source: Source, region: int, stopped: int
) -> object:
    """Pull ``source`` into ``region``, again if ``src``'s data-plane process
    ``stopped`` (SIGSTOPped, then resumed) was replaced meanwhile.

    A UCX data-plane process runs with UCX's error handling off (the one mode in
    which same-host GETs take cma: ``transports/ucx/worker.py``), so the endpoint
    errors a stop left behind can abort it once it runs again; its supervisor
    restarts it under a new address. A pull that meets that window fails closed
    (refused while it restarts, or its read of the old address unreachable), naming
    the source; once the new process serves, the source is read as before. Any
    other failure, or one while the stopped process still serves, fails the test."""
    async with asyncio.timeout(SAFETY_S):
        while True:
            try:
                return await engine.client.pull(await request(source, region))
            except RefitError:
                if src.daemon.plane.primary.pid == stopped:  # type: ignore[union-attr]
                    raise
                await src.daemon.plane.primary.wait_ready()  # type: ignore[union-attr]
                await asyncio.sleep(0.05)


async def test_a_pull_from_a_hung_source_fails_naming_it_while_a_pull_from_a_healthy_source_finishes_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    async with (
        node("src-a", transport="ucx") as a,
        node("src-b", transport="ucx") as b,
        node("engine", transport="ucx", pull_timeout_s=DEADLINE_S) as engine,
    ):
        sources = [
            Source(a, "ma", *await publish(a, "ma", 1)),
            Source(b, "mb", *await publish(b, "mb", 2)),
        ]
        sa, sb = sources
        with (
            SharedSegment.create(NBYTES, "dst-a") as dst_a,
            SharedSegment.create(NBYTES, "dst-b") as dst_b,
        ):
            ra = (await engine.client.attach_region(dst_a.name, NBYTES)).region_id
            rb = (await engine.client.attach_region(dst_b.name, NBYTES)).region_id
            # Both sources read once while healthy: the engine is connected to each.
            for src, region, seg in ((sa, ra, dst_a), (sb, rb, dst_b)):
                done = await engine.client.pull(await request(src, region))
                assert done.state is PullState.DONE and np.array_equal(seg.numpy(), src.data)
            dst_a.numpy()[:] = 0
            dst_b.numpy()[:] = 0

            serving = a.daemon.plane.primary.pid  # type: ignore[union-attr]
            assert serving is not None
            os.kill(serving, signal.SIGSTOP)  # A's API answers; its data plane hangs
            try:
                t0 = time.monotonic()
                hung = await engine.client.submit_pull(await request(sa, ra))
                healthy = await engine.client.submit_pull(await request(sb, rb))
                async with asyncio.timeout(DEADLINE_S * 10):
                    done = await engine.client.wait_pull(healthy.pull_id, interval_s=0.05)
                    b_took = time.monotonic() - t0
                    with pytest.raises(RefitError) as failure:
                        await engine.client.wait_pull(hung.pull_id, interval_s=0.05)
                    a_took = time.monotonic() - t0
            finally:
                os.kill(serving, signal.SIGCONT)

            assert done.state is PullState.DONE and done.bytes_done == NBYTES
            assert np.array_equal(dst_b.numpy(), sb.data), "the healthy source's bytes are exact"
            assert b_took < DEADLINE_S, f"the healthy pull took {b_took:.2f} s beside a hung one"
            message = str(failure.value)
            assert "'src-a'" in message and f"timed out after {DEADLINE_S} s" in message, message
            assert "'src-b'" not in message
            assert a_took >= DEADLINE_S, f"the hung pull failed after {a_took:.2f} s"
            failed = await engine.client.pull_status(hung.pull_id)
            assert failed.state is PullState.FAILED
            assert [tuple(s) for s in failed.suspect] == [(ra, 0, NBYTES)], failed.suspect

            # The engine daemon serves on; A, answering again, is read exactly.
            assert (await engine.client.health())["status"] == "ok"
            done = await _pull_once_serving(engine, a, sa, ra, serving)
            assert done.state is PullState.DONE and np.array_equal(dst_a.numpy(), sa.data)
