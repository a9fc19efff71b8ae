"""Swap mode attacked (issue 36's standard: fail closed): a refit interrupted between
its pull and its rebind, and another tenant's hands on the engine's second segment.

Swap mode pulls into the engine's second segment (the shadow) and rebinds the
parameters to it only once the pull is DONE (:mod:`refitd.client.swap`). That is
exact only while nothing else writes the shadow: a pull of an interrupted refit
that runs on at the daemon would land the version it was reading in memory the
next refit has since made live.

The toy engine with two daemons in this process; the pull of the refit the test
interrupts is held mid-copy by a copy engine that holds only the first copy after
it is armed (the one fake: a real copy cannot be made to pause at a chosen point).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from support.daemons import daemon_config
from support.engines import SwapEngine, serving_swap_engine, swap_engine
from support.tenants import pull_request, two_tenants

from refitd.daemon.app.node import Daemon
from refitd.errors import AccessDenied, ConflictError
from refitd.wire import PullState
from transports.local import copy_addresses

pytestmark = pytest.mark.timeout(300)

SECRET = b"s" * 32
SAFETY_S = 120.0
"""Safety net for what the test waits on (a held copy, a pull's end)."""
TERMINAL = {PullState.DONE, PullState.FAILED, PullState.CANCELLED}


class HeldOnce:
    """The daemon's same-host copy engine, copying for real; once ``armed``, the next
    copy waits for ``gate`` first (``entered`` is set then); every other copy runs
    at once."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            await self.gate.wait()
        await copy_addresses(dst, src, nbytes, threads=1, pool=None)


@contextlib.asynccontextmanager
async def swap_engine_holding_a_copy() -> AsyncIterator[tuple[HeldOnce, SwapEngine]]:
    """Two daemons in this process, the engine's (b) copying through a
    :class:`HeldOnce`, and a swap engine on b refitted to version 1 published at a:
    yields the copier and the engine. The held copy is let go when the
    block ends, however it ends, so no pull is left waiting at the gate."""
    held = HeldOnce()
    a = Daemon(daemon_config(node_id="a"), secret=SECRET)
    b = Daemon(daemon_config(node_id="b"), secret=SECRET, copier=held)
    async with serving_swap_engine(b, a) as toy:
        await toy.publish(1)
        try:
            await toy.receiver.refit(1)
            yield held, toy
        finally:
            held.gate.set()


async def test_a_refit_interrupted_mid_pull_leaves_no_pull_to_write_the_engine_after_the_next_refit() -> (
    None
):
    """refit(2) is cancelled while its pull is held mid-copy; refit(3) then swaps
    version 3 in. The interrupted refit's pull must not run on: released, it would
    write version 2's bytes into the segment the parameters now read. The engine
    holds version 3 bit for bit after every pull has ended."""
    async with swap_engine_holding_a_copy() as (held, toy):
        assert toy.mismatched(1) == []
        await toy.publish(2)
        held.armed = True
        interrupted = asyncio.create_task(toy.receiver.refit(2))
        async with asyncio.timeout(SAFETY_S):
            await held.entered.wait()  # its pull is mid-copy, into the shadow
        interrupted.cancel()
        await asyncio.gather(interrupted, return_exceptions=True)
        assert toy.mismatched(1) == []  # nothing swapped in

        await toy.publish(3)
        await toy.receiver.refit(3)
        assert toy.mismatched(3) == []
        held.gate.set()  # what was left of the interrupted refit goes on, if anything
        async with asyncio.timeout(SAFETY_S):
            while any(p.state not in TERMINAL for p in await toy.local.pulls()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert toy.mismatched(3) == []  # v3, bit for bit


async def test_another_tenant_cannot_write_or_attach_an_engines_swap_segment(
    tmp_path: Path,
) -> None:
    """An engine in swap mode (tenant a) holds two segments. Tenant b, with a lease on
    the same version, names a's shadow region as a pull destination (refused, 403)
    and attaches a's shadow segment by name (refused, 409: the memory is held): no
    byte of either segment changes, and a's next refit is exact."""
    async with (
        two_tenants(tmp_path, node_id="swap-tenants", transport="shm") as t,
        swap_engine(t.a, t.a) as toy,
    ):
        ca, cb = t.a, t.b
        await toy.publish(1)
        await toy.receiver.refit(1)
        regions = {x.label: x for x in await ca.regions()}
        shadow, served_seg = regions["shadow"], regions["engine"]
        before = [p.detach().clone() for p in toy.engine.parameters()]

        theirs = await cb.create_region(shadow.nbytes, label="b-src")
        lease = await cb.acquire_lease("m", 1)
        src = next(x for x in regions.values() if x.label not in ("shadow", "engine"))
        for dst in (shadow, served_seg):
            rows = [(src.region_id, 0, dst.region_id, 0, 64)]
            with pytest.raises(AccessDenied):
                await cb.submit_pull(pull_request(lease, rows))
        for seg in (shadow, served_seg):
            with pytest.raises(ConflictError, match="already holds"):
                await cb.attach_region(seg.handle, seg.nbytes, label="theirs")
        assert all(torch.equal(x, p) for x, p in zip(before, toy.engine.parameters(), strict=True))
        await cb.delete_region(theirs.region_id)

        await toy.publish(2)
        await toy.receiver.refit(2)
        assert toy.mismatched(2) == []


async def test_two_refits_at_once_on_one_swap_receiver_leave_the_engine_on_one_whole_version() -> (
    None
):
    """refit(2) is held mid-copy while refit(3) is asked of the same receiver. Before
    the fix both reported success and the engine was left on neither version whole
    (both landed in the one shadow). Now refit(3) is refused (409, naming the refit
    that runs) before it does anything; refit(2) ends exact, and refit(3) asked
    again afterwards succeeds."""
    async with swap_engine_holding_a_copy() as (held, toy):
        await toy.publish(2)
        held.armed = True
        first = asyncio.create_task(toy.receiver.refit(2))
        async with asyncio.timeout(SAFETY_S):
            await held.entered.wait()
        await toy.publish(3)
        with pytest.raises(ConflictError, match="a refit to version 2 still runs"):
            await toy.receiver.refit(3)
        held.gate.set()
        async with asyncio.timeout(SAFETY_S):
            assert (await first).version == 2
        assert toy.mismatched(2) == []
        assert (await toy.receiver.refit(3)).version == 3
        assert toy.mismatched(3) == []
