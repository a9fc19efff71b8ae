"""A host mirror follows the source's rules: a pull served from it ends as a direct
pull of the same lease would, the mirror's objects have an owner and a bound, and its
routes answer what they must, in the error shape.

Two real daemons in this process on 127.0.0.1:0: a source (the trainer's) and a
mirror host (``mirrors.policy = always``) that reads it over ``tcp``, as another host
would. Where a test must hold the mirrored pull mid-copy, the mirror host's same-host
copier is gated (`support.daemons.GatedCopier`); everything else is real.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
from support.daemons import GatedCopier, serving_daemons

from refitd.client.http import RefitClient
from refitd.daemon.node import Daemon, DaemonOptions
from refitd.errors import RefitError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PullRequest,
    PullState,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"mirror-trust-secret-0123456789abc"
MODEL = "m"
NBYTES = 6 << 20
WAIT_S = 60.0
"""Safety net of a wait on a daemon (never what a test measures)."""


def pattern(version: int) -> np.ndarray:
    words = np.arange(NBYTES // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words + np.uint64(version)).view(np.uint8)


@dataclass
class Hosts:
    source: Daemon
    mirror: Daemon
    sc: RefitClient  # a client of the source daemon
    mc: RefitClient  # a client of the mirror host's daemon
    copier: GatedCopier | None


@contextlib.asynccontextmanager
async def hosts(*, gated: bool = False, **mirror_options: object) -> AsyncIterator[Hosts]:
    copier = GatedCopier() if gated else None
    if copier is not None:
        copier.gate.set()  # open until a test closes it
    src = Daemon(DaemonOptions(port=0, node_id="trainer", transport="tcp", secret=SECRET))
    mirror = Daemon(
        DaemonOptions(
            port=0,
            node_id="host-a",
            transport="tcp",
            secret=SECRET,
            mirrors="always",
            **mirror_options,  # type: ignore[arg-type]
        ),
        copier=copier,
    )
    async with serving_daemons(src, mirror) as (sc, mc):
        yield Hosts(src, mirror, sc, mc, copier)


async def publish(c: RefitClient, version: int = 1) -> int:
    """Version ``version`` of one tensor in a new region; returns the region id."""
    info = await c.create_region(NBYTES, label=f"src-{version}")
    with SharedSegment.attach(info.handle, NBYTES) as seg:
        seg.numpy()[:] = pattern(version)
    t = TensorEntry("w", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), info.region_id, 0)])
    await c.publish(ManifestIn(MODEL, version, 0, 1, [t]))
    return info.region_id


async def pull_request(
    h: Hosts, src_region: int, lease_id: str, version: int = 1
) -> tuple[PullRequest, RegionInfo]:
    """A pull of the whole tensor into a new region of the mirror host."""
    dst = await h.mc.create_region(NBYTES, label="engine")
    rows = np.array([[src_region, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
    url = h.sc.base_url
    return PullRequest(MODEL, version, lease_id, DescriptorTable.pack(rows), [], url), dst


# ---------------------------------------------------------------- (5) leases


async def test_a_pull_served_from_a_mirror_fails_when_its_lease_is_released_at_the_source_mid_pull() -> (
    None
):
    async with hosts(gated=True) as h:
        assert h.copier is not None
        region = await publish(h.sc)
        # a first engine makes the mirror complete
        first = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, first.lease_id)
        assert (await h.mc.pull(req)).path == "shm"
        await h.sc.release_lease(first.lease_id)
        # a second engine's pull is held mid-copy, from the complete mirror
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id)
        h.copier.gate.clear()
        h.copier.entered.clear()
        started = await h.mc.submit_pull(req)
        async with asyncio.timeout(WAIT_S):
            await h.copier.entered.wait()
        await h.sc.release_lease(lease.lease_id)  # the engine's lease ends at the source
        h.copier.gate.set()
        with pytest.raises(RefitError) as err:
            await h.mc.wait_pull(started.pull_id)
        assert lease.lease_id in str(err.value)
        ended = await h.mc.pull_status(started.pull_id)
        assert ended.state is PullState.FAILED and ended.suspect


async def test_a_pull_whose_lease_ended_while_the_mirror_filled_is_refused_before_a_byte_moves() -> (
    None
):
    async with hosts() as h:
        region = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, dst = await pull_request(h, region, lease.lease_id)
        # the mirror completes for another engine; then this engine's lease ends
        other = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req2, _ = await pull_request(h, region, other.lease_id)
        await h.mc.pull(req2)
        await h.sc.release_lease(lease.lease_id)
        with pytest.raises(RefitError, match="lease"):
            await h.mc.pull(req)
        with SharedSegment.attach(dst.handle, NBYTES) as seg:
            assert not seg.numpy().any(), "a byte moved under an ended lease"
