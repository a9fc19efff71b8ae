"""Graceful shutdown of ``serve``: stop accepting, drain in-flight pulls up to the
grace period, cancel the rest. A pull is held at a gate so that "slower than the
grace period" is deterministic: the gate is a Copier (the daemon's own interface)
wrapping the real memory copy, the one fake here, for a delay real memory copies
cannot be made to take on demand."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from support.daemons import GatedCopier, daemon_config
from support.toy import publish_tensor, pull_rows

from refitd.client.http import RefitClient
from refitd.daemon.app.handlers import PULLS
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.process import serve
from refitd.wire import (
    PullState,
)


async def start_held_pull(grace_s: float) -> tuple[Any, ...]:
    """serve() with one pull of 4096 bytes held at the gate; returns what tests need."""
    options = daemon_config(shutdown_grace_s=grace_s)
    copier = GatedCopier()
    stop = asyncio.Event()
    ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    stopping = asyncio.Event()
    apps: list[web.Application] = []
    task = asyncio.create_task(
        serve(
            Daemon(options, copier=copier),
            stop=stop,
            on_ready=ready.set_result,
            on_stopping=stopping.set,
            app_kwargs={"setup": [apps.append]},
        )
    )
    record = await asyncio.wait_for(ready, 60)
    async with RefitClient(record["url"]) as c:
        src = await c.create_region(4096)
        dst = await c.create_region(4096)
        await publish_tensor(c, "m", 1, src.region_id, 4096, "float32")
        lease = await c.acquire_lease("m", 1)
        row = (src.region_id, 0, dst.region_id, 0, 4096)
        started = await c.submit_pull(pull_rows("m", 1, lease.lease_id, row))
    await asyncio.wait_for(copier.entered.wait(), 60)
    return task, stop, stopping, copier, apps[0], started.pull_id


async def test_a_pull_in_flight_at_shutdown_finishes_within_the_grace_period() -> None:
    task, stop, stopping, copier, app, pull_id = await start_held_pull(grace_s=60)
    stop.set()
    await asyncio.wait_for(stopping.wait(), 60)
    assert not task.done()  # draining: serve waits for the pull
    copier.gate.set()
    await asyncio.wait_for(task, 60)
    job = app[PULLS].jobs[pull_id]
    assert job.state is PullState.DONE
    assert job.bytes_done == 4096


async def test_a_pull_still_running_after_the_grace_period_is_cancelled_with_a_reason() -> None:
    task, stop, _stopping, _copier, app, pull_id = await start_held_pull(grace_s=0.2)
    stop.set()
    await asyncio.wait_for(task, 60)  # returns after the grace period, gate still shut
    job = app[PULLS].jobs[pull_id]
    assert job.state is PullState.CANCELLED
    assert job.bytes_done == 0
    assert job.error is not None and "cancelled" in job.error.detail
