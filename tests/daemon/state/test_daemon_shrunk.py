"""A segment shrunk under the daemon fails only the pulls that touch it.

A client owns the files of the segments it attaches (and, being of the daemon's
uid or group, can open the daemon's own): it may ``ftruncate`` one at any moment,
also while a pull copies through its mapping. The copy then meets a bus error,
which by default kills the daemon and every tenant's versions, leases and pulls with
it. Here the pull is held mid-flight (the gated copier, the daemon's own copy engine
behind a gate), the segment shrunk, and the gate opened: that pull fails with its
destination ranges suspect, and the other tenant's pull, before and after, lands
byte-exact.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import numpy as np
import pytest
from support.daemons import GatedCopier, daemon_config, serving_daemons
from support.toy import publish_tensor, pull_rows

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import RefitError, TransportError
from refitd.wire import (
    PackSpec,
    PullRequest,
    PullState,
)
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(120)

NBYTES = 1 << 20
"""Bytes of each tenant's tensor: one page past the first is what a shrink cuts."""


class Tenant:
    """One tenant's source segment (its own file), published as ``model`` version 1,
    leased, and a destination segment (its own file) attached."""

    def __init__(self, c: RefitClient, model: str, fill: int) -> None:
        self.c, self.model, self.fill = c, model, fill
        self.src = SharedSegment.create(NBYTES, f"{model}-src")
        self.dst = SharedSegment.create(NBYTES, f"{model}-dst")
        self.src.numpy()[:] = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8) ^ fill

    async def setup(self) -> Tenant:
        self.src_id = (await self.c.attach_region(self.src.name, NBYTES)).region_id
        self.dst_id = (await self.c.attach_region(self.dst.name, NBYTES)).region_id
        await publish_tensor(self.c, self.model, 1, self.src_id, NBYTES)
        self.lease = (await self.c.acquire_lease(self.model, 1, ttl_s=600)).lease_id
        return self

    def request(self) -> PullRequest:
        return pull_rows(self.model, 1, self.lease, (self.src_id, 0, self.dst_id, 0, NBYTES))

    async def pull_is_byte_exact(self) -> None:
        self.dst.numpy()[:] = 0
        res = await self.c.pull(self.request())
        assert res.bytes_done == NBYTES
        assert np.array_equal(self.dst.numpy(), self.src.numpy())

    def close(self) -> None:
        self.src.close()
        self.dst.close()


def _shrink(seg: SharedSegment, nbytes: int) -> None:
    """What a client may do to a file it owns: cut it under every mapping of it."""
    fd = os.open(SHM_DIR / seg.name, os.O_RDWR)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def _tenants() -> AsyncIterator[tuple[Daemon, GatedCopier, Tenant, Tenant]]:
    gate = GatedCopier()
    gate.gate.set()
    d = Daemon(daemon_config(node_id="shrunk", transport="shm", shutdown_grace_s=0.5), copier=gate)
    async with serving_daemons(d) as (c,):
        a = await Tenant(c, "a", 0x11).setup()
        b = await Tenant(c, "b", 0x5A).setup()
        try:
            yield d, gate, a, b
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("side", ["source", "destination"])
async def test_a_segment_shrunk_mid_pull_fails_only_that_pull_and_the_daemon_serves_on(
    side: str,
) -> None:
    async with _tenants() as (_d, gate, a, b):
        await b.pull_is_byte_exact()
        # Hold a's pull at the copy, shrink a's segment to one page, let it go.
        gate.gate.clear()
        gate.entered.clear()
        pull = await a.c.submit_pull(a.request())
        await gate.entered.wait()
        _shrink(a.src if side == "source" else a.dst, 4096)
        gate.gate.set()
        with pytest.raises(RefitError, match=rf"{side} region \d+ faulted") as err:
            await a.c.wait_pull(pull.pull_id)
        status = await a.c.pull_status(pull.pull_id)
        assert status.state is PullState.FAILED
        # Every byte the pull was to write is reported suspect.
        assert [tuple(s) for s in status.suspect] == [(a.dst_id, 0, NBYTES)], err.value
        # The daemon lives, and the other tenant's pull lands byte-exact.
        assert (await b.c.health())["status"] == "ok"
        await b.pull_is_byte_exact()


async def test_a_source_shrunk_under_a_pack_fails_that_pack_and_the_daemon_serves_on() -> None:
    async with _tenants() as (_d, _gate, a, b):
        _shrink(a.src, 4096)
        # Every 1024th byte of a's tensor, gathered by the daemon into staging.
        spec = PackSpec(a.src_id, 0, (NBYTES // 1024,), (1024,), 1, a.dst_id, 0)
        with pytest.raises(TransportError, match=rf"source region {a.src_id} faulted"):
            await a.c.peer_pack(a.model, 1, a.lease, [spec])
        assert (await b.c.health())["status"] == "ok"
        await b.pull_is_byte_exact()


@pytest.mark.parametrize("which", ["host_region", "slot_region"])
async def test_a_pool_region_shrunk_by_a_client_fails_that_ensure_and_the_daemon_serves_on(
    which: str,
) -> None:
    async with _tenants() as (_d, _gate, a, b):
        pool = await a.c.create_pool("moe", layers=2, experts=4, slots=4, row_bytes=[8192])
        region = next(r for r in await a.c.regions() if r.region_id == getattr(pool, which))
        os.truncate(SHM_DIR / region.handle, 0)  # a daemon-made file, same uid: openable
        with pytest.raises(TransportError, match=r"pool 'moe' .* faulted"):
            await a.c.ensure("moe", 1, [3, 2])
        assert (await b.c.health())["status"] == "ok"
        await b.pull_is_byte_exact()


async def test_a_staging_region_shrunk_by_its_reader_fails_that_pack_and_is_never_reused() -> None:
    async with _tenants() as (_d, _gate, a, b):
        spec = PackSpec(a.src_id, 0, (NBYTES // 1024,), (1024,), 1, a.dst_id, 0)
        first = await a.c.peer_pack(a.model, 1, a.lease, [spec])
        # The lease's principal sees its staging region's name, and may open it.
        handle = next(
            r.handle for r in await a.c.regions() if r.region_id == first.region.region_id
        )
        os.truncate(SHM_DIR / handle, 0)
        await a.c.peer_drop(first.region.region_id, a.lease)  # back to the daemon's pool
        # A smaller pack reuses it, zeroing the tail this pack does not write.
        half = PackSpec(a.src_id, 0, (NBYTES // 2048,), (2048,), 1, a.dst_id, 0)
        with pytest.raises(TransportError, match=r"staging region \d+ faulted"):
            await a.c.peer_pack(a.model, 1, a.lease, [half])
        again = await a.c.peer_pack(a.model, 1, a.lease, [half])
        assert again.region.region_id != first.region.region_id
        assert (await b.c.health())["status"] == "ok"
        await b.pull_is_byte_exact()
