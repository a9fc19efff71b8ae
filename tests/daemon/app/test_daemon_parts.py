"""The daemon's rules live in the parts that own them, not in its HTTP handlers: the
region store and the staging pool admit memory against a principal's caps, and
``Daemon.publish`` runs every step of a publish. Called here directly, with no HTTP
in between, on a real daemon with real shared memory."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from support.daemons import daemon_config

from refitd.config import Config, LimitsConfig
from refitd.daemon.access.auth import Principal
from refitd.daemon.app.handlers import create_app
from refitd.daemon.app.node import Daemon
from refitd.errors import AccessDenied, ConflictError, QuotaExceeded
from refitd.wire import (
    ManifestIn,
    PackSpec,
    RegionCreate,
    ShardEntry,
    TensorEntry,
    VersionState,
)
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(60)

SAFETY_S = 30.0
"""Safety net for what a test waits on (a region being made)."""

ALICE = Principal("alice", "token")
BOB = Principal("bob", "token")


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    limits = LimitsConfig(max_regions_per_principal=2, max_region_bytes_per_principal=1 << 20)
    d = Daemon(daemon_config(node_id="parts", transport="shm", limits=limits))
    await d.start()
    try:
        yield d
    finally:
        await d.close()


def manifest(region_id: int, version: int = 1) -> ManifestIn:
    shard = ShardEntry((0,), (64,), region_id, 0)
    return ManifestIn("m", version, 0, 1, [TensorEntry("w", (64,), "uint8", [shard])])


def reader(m: ManifestIn) -> Callable[[int], Awaitable[ManifestIn]]:
    """What the publish handler hands the daemon: a decoder of its request's body."""

    async def read(max_shards: int) -> ManifestIn:
        assert max_shards == 1 << 20  # the daemon's limit, handed to the decoder
        return m

    return read


async def test_the_region_store_refuses_a_region_past_the_principals_cap(daemon: Daemon) -> None:
    for _ in range(2):
        await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    with pytest.raises(QuotaExceeded, match="max_regions_per_principal = 2"):
        await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    # Another principal, and the daemon's own regions, are not counted against alice.
    await daemon.create_region(RegionCreate(4096, owner="bob"), BOB)
    await daemon.store.create_region(RegionCreate(4096))
    assert len(daemon.store.regions) == 4


async def test_the_region_store_refuses_bytes_past_the_principals_cap_and_frees_them_on_delete(
    daemon: Daemon,
) -> None:
    big = await daemon.create_region(RegionCreate(768 << 10, owner="alice"), ALICE)
    with pytest.raises(QuotaExceeded, match="max_region_bytes_per_principal"):
        await daemon.create_region(RegionCreate(512 << 10, owner="alice"), ALICE)
    await daemon.delete_region(big.region_id, ALICE)
    await daemon.create_region(RegionCreate(512 << 10, owner="alice"), ALICE)


async def test_a_staging_pack_counts_against_the_leases_principal(daemon: Daemon) -> None:
    src = await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    daemon.store.view(src.region_id)[:64] = np.arange(64, dtype=np.uint8).tobytes()
    await daemon.publish(reader(manifest(src.region_id)), ALICE)
    grant = daemon.leases.acquire("m", 1, 30.0, "", "alice")
    lease = daemon.registry.check(grant.lease_id, "m", 1)
    spec = PackSpec(src.region_id, 0, (64,), (1,), 1, 0, 0)
    # Alice holds one region; the pack makes her second, whoever asks for it.
    staged = await daemon.leases.pack([spec], lease, "bob")
    assert bytes(daemon.store.view(staged.region.region_id)[:64]) == bytes(range(64))
    with pytest.raises(QuotaExceeded, match="principal 'alice'"):
        await daemon.leases.pack([spec], lease, "bob")


async def test_a_staging_region_back_in_its_pool_counts_against_nobody_until_packed_again(
    daemon: Daemon,
) -> None:
    src = await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    await daemon.publish(reader(manifest(src.region_id)), ALICE)
    grant = daemon.leases.acquire("m", 1, 30.0, "", "alice")
    lease = daemon.registry.check(grant.lease_id, "m", 1)
    spec = PackSpec(src.region_id, 0, (64,), (1,), 1, 0, 0)
    staged = await daemon.leases.pack([spec], lease, "alice")
    rid = staged.region.region_id
    assert daemon.store.holds_memory(rid)
    with pytest.raises(QuotaExceeded, match="max_regions_per_principal = 2"):
        await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    await daemon.leases.release_staging(rid, grant.lease_id)  # back in the pool: nobody's
    assert not daemon.store.holds_memory(rid)
    third = await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    await daemon.delete_region(third.region_id, ALICE)
    again = await daemon.leases.pack([spec], lease, "alice")
    assert again.region.region_id == rid  # the pool's region, held for the lease again
    assert daemon.store.holds_memory(rid)


async def test_publish_refuses_a_region_of_another_principal_and_publishes_ones_own(
    daemon: Daemon,
) -> None:
    bobs = await daemon.create_region(RegionCreate(4096, owner="bob"), BOB)
    with pytest.raises(AccessDenied, match="alice may not publish from region"):
        await daemon.publish(reader(manifest(bobs.region_id)), ALICE)
    assert daemon.registry.versions() == []
    info = await daemon.publish(reader(manifest(bobs.region_id)), BOB)
    assert info.state is VersionState.READY
    # The first publisher owns the model now: another principal may not publish into it.
    alices = await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    with pytest.raises(AccessDenied):
        await daemon.publish(reader(manifest(alices.region_id, version=2)), ALICE)


async def test_publish_refuses_a_staging_region(daemon: Daemon) -> None:
    src = await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    await daemon.publish(reader(manifest(src.region_id)), ALICE)
    grant = daemon.leases.acquire("m", 1, 30.0, "", "alice")
    lease = daemon.registry.check(grant.lease_id, "m", 1)
    staged = await daemon.leases.pack([PackSpec(src.region_id, 0, (64,), (1,), 1, 0, 0)], lease)
    with pytest.raises(ConflictError, match="staging region"):
        await daemon.publish(reader(manifest(staged.region.region_id, version=2)), ALICE)


async def test_the_lease_cap_is_the_daemons_acquire() -> None:
    d = Daemon(
        daemon_config(
            node_id="one-lease", transport="shm", limits=LimitsConfig(max_leases_per_principal=1)
        )
    )
    await d.start()
    try:
        region = await d.create_region(RegionCreate(4096, owner="alice"), ALICE)
        await d.publish(reader(manifest(region.region_id)), ALICE)
        first = d.leases.acquire("m", 1, 30.0, "", "alice")
        with pytest.raises(QuotaExceeded, match="max_leases_per_principal"):
            d.leases.acquire("m", 1, 30.0, "", "alice")
        d.registry.release(first.lease_id)
        d.leases.acquire("m", 1, 30.0, "", "alice")
    finally:
        await d.close()


async def test_a_daemon_built_without_a_config_runs_as_the_default_config() -> None:
    """One place says each default: a daemon built without a config runs as the
    default config says, the app's request body limit included
    (``server.max_request_bytes``, 64 MiB), and the test helper's config differs from
    it only where asked (and in the port: 0, any free one)."""
    bare = Daemon()
    assert bare.config == Config()
    assert bare.mode == "auto" and bare.limits == LimitsConfig() and bare.peers.trusted() == []
    assert create_app(bare)._client_max_size == 64 << 20
    helper = daemon_config(deltas=True)
    assert helper.server.port == 0 and helper.pulls.deltas
    asked = msgspec.structs.replace(helper.pulls, deltas=False)
    server = msgspec.structs.replace(helper.server, port=Config().server.port)
    assert msgspec.structs.replace(helper, pulls=asked, server=server) == Config()


class SlowKernel:
    """``SharedSegment.create`` as the kernel makes it, except that a segment labelled
    ``held`` waits for ``go`` first (``entered`` is set then): backing a large region
    takes seconds, and the one fake here holds it at a chosen point instead."""

    def __init__(self, real: Callable[..., SharedSegment]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self, size: int, label: str = "", **kw: Any) -> SharedSegment:
        if label == "held":
            self.entered.set()
            self.go.wait(SAFETY_S)
        return self.real(size, label, **kw)


@pytest.fixture
def slow_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowKernel]:
    kernel = SlowKernel(SharedSegment.create)
    monkeypatch.setattr(SharedSegment, "create", kernel)
    try:
        yield kernel
    finally:
        kernel.go.set()


async def test_a_region_being_made_holds_its_place_under_the_caps_and_the_loop_serves_on(
    daemon: Daemon, slow_kernel: SlowKernel
) -> None:
    """While alice's first region is made (off the event loop), other work is done:
    bob's region is made and alice's second; alice's third is refused (429), because
    the region still being made counts. Before, two requests made at once both passed
    a cap that had room for one."""
    first = asyncio.create_task(
        daemon.create_region(RegionCreate(4096, owner="alice", label="held"), ALICE)
    )
    assert await asyncio.to_thread(slow_kernel.entered.wait, SAFETY_S)
    await daemon.create_region(RegionCreate(4096, owner="bob"), BOB)
    await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    with pytest.raises(QuotaExceeded, match="max_regions_per_principal = 2"):
        await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
    assert not first.done()
    slow_kernel.go.set()
    async with asyncio.timeout(SAFETY_S):
        made = await first
    owners = sorted(r.owner for r in daemon.store.regions)
    assert made.label == "held" and owners == ["alice", "alice", "bob"]


async def test_a_region_whose_request_is_cancelled_while_it_is_made_leaves_no_memory(
    daemon: Daemon, slow_kernel: SlowKernel
) -> None:
    """The request is cancelled while the segment is made; once made, it is unlinked,
    no region records it, and its place under alice's caps is free again."""
    before = {p.name for p in SHM_DIR.iterdir()}
    task = asyncio.create_task(
        daemon.create_region(RegionCreate(4096, owner="alice", label="held"), ALICE)
    )
    assert await asyncio.to_thread(slow_kernel.entered.wait, SAFETY_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    slow_kernel.go.set()
    async with asyncio.timeout(SAFETY_S):
        while {p.name for p in SHM_DIR.iterdir()} - before:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert list(daemon.store.regions) == []
    for _ in range(2):
        await daemon.create_region(RegionCreate(4096, owner="alice"), ALICE)
