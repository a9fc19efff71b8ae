"""Waiting for a version's delta comparison to end, on a busy machine.

The daemon cuts one wait to :data:`~refitd.wire.args.MAX_WAIT_S`; a comparison of a
large manifest on a loaded host (or under allocation tracing) may run longer. The
wait is asked again until the record leaves ``computing``: the test waits on the
event that says done, with :data:`DELTA_SAFETY_S` as its safety net, not on a
guess of how long the comparison takes.
"""

from __future__ import annotations

import asyncio

from refitd.client.http import RefitClient
from refitd.wire import DeltaInfo
from refitd.wire.args import MAX_WAIT_S

__all__ = ["DELTA_SAFETY_S", "settled_delta"]

DELTA_SAFETY_S = 240.0
"""The longest a test waits for a comparison to end, s: a safety net for a daemon
that never ends it, far past what a loaded 2-core host needs, under the tests'
own timeouts."""


async def settled_delta(
    c: RefitClient, model: str, version: int, safety_s: float = DELTA_SAFETY_S
) -> DeltaInfo:
    """``version``'s delta record once its comparison ended (any state but
    ``computing``); fail, naming the wait, after ``safety_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + safety_s
    while True:
        left = deadline - loop.time()
        rec = await c.delta_info(model, version, wait_s=max(0.0, min(MAX_WAIT_S, left)))
        if rec.state != "computing":
            return rec
        if loop.time() >= deadline:
            raise AssertionError(
                f"{model!r} v{version}'s delta stayed computing past its {safety_s:.0f} s "
                f"safety net: {rec}"
            )
