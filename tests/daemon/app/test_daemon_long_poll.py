"""Long polls instead of polling loops: a client waits for a version to become READY,
or for a pull to end, in one request the daemon answers the moment it happens.

Real daemon on 127.0.0.1:0, real shared memory; a middleware counts the requests the
client makes, so a poll loop in disguise would show."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web
from support.daemons import GatedCopier, daemon_config, served
from support.tenants import pull_request

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import NotFoundError
from refitd.wire import ManifestIn, PullState, ShardEntry, TensorEntry, VersionState
from refitd.wire import routes as api
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)


class Counted:
    def __init__(
        self,
        client: RefitClient,
        seen: collections.Counter[str],
        copier: GatedCopier | None,
    ) -> None:
        self.client, self.seen, self.copier = client, seen, copier


def count_requests(seen: collections.Counter[str]):  # type: ignore[no-untyped-def]
    @web.middleware
    async def count(request: web.Request, handler):  # type: ignore[no-untyped-def]
        info = request.match_info.route.resource
        seen[f"{request.method} {info.canonical if info else request.path}"] += 1
        return await handler(request)

    return lambda app: app.middlewares.append(count)


@pytest.fixture
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Counted]:
    copier = GatedCopier() if getattr(request, "param", False) else None
    daemon = Daemon(daemon_config(node_id="t", transport="shm"), copier=copier)
    seen: collections.Counter[str] = collections.Counter()
    async with served(daemon, setup=[count_requests(seen)]) as s:
        yield Counted(s.client, seen, copier)


async def publish_part(c: RefitClient, part: int, parts: int = 2) -> int:
    info = await c.create_region(64, label=f"part{part}")
    SharedSegment.attach(info.handle, 64).numpy(np.uint8)[:] = part + 1
    shard = ShardEntry((part * 64,), (64,), info.region_id, 0)
    m = ManifestIn("m", 1, part, parts, [TensorEntry(f"w{part}", (parts * 64,), "uint8", [shard])])
    await c.publish(m)
    return info.region_id


async def test_a_version_waiter_is_answered_when_the_last_part_lands_in_one_request(
    env: Counted,
) -> None:
    c = env.client
    await publish_part(c, 0)
    waiting = asyncio.create_task(c.wait_ready("m", 1, timeout_s=30))
    await asyncio.sleep(0.3)
    assert not waiting.done(), "answered while a part was still missing"
    t0 = time.monotonic()
    await publish_part(c, 1)
    info = await asyncio.wait_for(waiting, 5)
    assert info.state is VersionState.READY and time.monotonic() - t0 < 2
    assert env.seen[f"GET {api.WAIT_READY.path}"] == 1


async def test_a_version_waiter_that_times_out_gets_the_pending_state(env: Counted) -> None:
    await publish_part(env.client, 0)
    t0 = time.monotonic()
    info = await env.client.wait_ready("m", 1, timeout_s=0.3)
    assert info.state is VersionState.PENDING and 0.25 < time.monotonic() - t0 < 5


async def test_a_version_nobody_published_is_not_found_after_the_wait(env: Counted) -> None:
    with pytest.raises(NotFoundError):
        await env.client.wait_ready("m", 7, timeout_s=0.1)


@pytest.mark.parametrize("env", [True], indirect=True)
async def test_waiting_for_a_pull_is_one_request_answered_when_it_ends(env: Counted) -> None:
    c = env.client
    src = await publish_part(c, 0, parts=1)
    dst_seg = SharedSegment.create(64, "dst")
    try:
        dst = (await c.attach_region(dst_seg.name, 64, label="dst")).region_id
        lease = await c.acquire_lease("m", 1)
        started = await c.submit_pull(pull_request(lease, [(src, 0, dst, 0, 64)]))
        waiting = asyncio.create_task(c.wait_pull(started.pull_id))
        assert env.copier is not None
        await env.copier.entered.wait()  # the pull is mid-copy, held at the gate
        await asyncio.sleep(0.6)  # more than two of the old 0.25 s polls
        assert not waiting.done()
        env.copier.gate.set()
        done = await asyncio.wait_for(waiting, 10)
        assert done.state is PullState.DONE
        assert bytes(dst_seg.numpy(np.uint8)) == bytes([1] * 64)
        assert env.seen[f"GET {api.WAIT_PULL.path}"] == 1
    finally:
        dst_seg.close()
        dst_seg.unlink()
