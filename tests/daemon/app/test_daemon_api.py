"""HTTP API v1 against a real daemon app on 127.0.0.1:0, with real shared memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import numpy as np
import pytest
from support.daemons import FakeClock, GatedCopier, daemon_config, served

from refitd.client.http import RefitClient
from refitd.client.leases import LeaseKeeper
from refitd.daemon.app.handlers import PULLS
from refitd.daemon.app.node import Daemon
from refitd.errors import ConflictError, NotFoundError, PlanError, ProtocolError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    MemoryKind,
    PackSpec,
    PullRequest,
    PullState,
    ShardEntry,
    TensorEntry,
    VersionState,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)


@dataclass
class Env:
    client: RefitClient
    url: str
    daemon: Daemon
    clock: FakeClock
    copier: GatedCopier | None


async def _env(gated: bool) -> AsyncIterator[Env]:
    clock = FakeClock()
    copier = GatedCopier() if gated else None
    # The API alone needs no UCX: the shared-memory mode keeps these daemons light.
    opts = daemon_config(node_id="t", transport="shm")
    daemon = Daemon(opts, clock=clock, copier=copier)
    async with served(daemon) as s:
        yield Env(s.client, s.url, daemon, clock, copier)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async for e in _env(gated=False):
        yield e


@pytest.fixture
async def gated() -> AsyncIterator[Env]:
    async for e in _env(gated=True):
        yield e


async def publish_toy(
    c: RefitClient, version: int = 1, fill: float = 1.0, cols: int = 8
) -> tuple[int, SharedSegment]:
    """A 4 x ``cols`` float32 tensor 'w' in one daemon-owned region, values fill + arange."""
    info = await c.create_region(4 * cols * 4, label="w")
    seg = SharedSegment.attach(info.handle, info.nbytes)
    seg.numpy(np.float32)[:] = fill + np.arange(4 * cols, dtype=np.float32)
    m = ManifestIn(
        "toy",
        version,
        0,
        1,
        [
            TensorEntry(
                "w", (4, cols), "float32", [ShardEntry((0, 0), (4, cols), info.region_id, 0)]
            )
        ],
    )
    await c.publish(m)
    return info.region_id, seg


_OWNED: list[SharedSegment] = []


@pytest.fixture(autouse=True)
def _unlink_destinations() -> Iterator[None]:
    """Destination segments are the test's own: unlink them when it ends."""
    yield
    while _OWNED:
        _OWNED.pop().close()


async def dest_region(c: RefitClient, nbytes: int) -> tuple[int, SharedSegment]:
    seg = SharedSegment.create(nbytes, "dst")
    _OWNED.append(seg)
    info = await c.attach_region(seg.name, nbytes, label="dst")
    return info.region_id, seg


def table(rows: list[list[int]]) -> DescriptorTable:
    return DescriptorTable.pack(np.array(rows, dtype=np.int64).reshape(-1, 5))


async def test_health_ready_and_node_identity_answer(env: Env) -> None:
    assert (await env.client.health())["status"] == "ok"
    assert (await env.client.ready())["transport"] == "shm"
    node = await env.client.node()
    assert node.node_id == "t" and node.incarnation == env.daemon.incarnation


async def test_a_region_is_created_listed_and_deleted(env: Env) -> None:
    info = await env.client.create_region(1000, label="x")
    assert info.nbytes == 1000 and info.daemon_owned
    assert [r.region_id for r in await env.client.regions()] == [info.region_id]
    await env.client.delete_region(info.region_id)
    assert await env.client.regions() == []
    with pytest.raises(NotFoundError, match=str(info.region_id)):
        await env.client.delete_region(info.region_id)


async def test_a_cuda_region_is_refused_on_a_host_without_a_gpu(env: Env) -> None:
    with pytest.raises(PlanError, match="no CUDA device"):
        await env.client.create_region(64, kind=MemoryKind.CUDA)


async def test_attaching_a_segment_of_the_wrong_size_is_refused(env: Env) -> None:
    with SharedSegment.create(100, "odd") as seg, pytest.raises(ProtocolError, match="expected 64"):
        await env.client.attach_region(seg.name, 64)


async def test_a_manifest_whose_shard_overruns_its_region_is_refused(env: Env) -> None:
    info = await env.client.create_region(64)
    bad = ManifestIn(
        "toy",
        1,
        0,
        1,
        [TensorEntry("w", (4, 8), "float32", [ShardEntry((0, 0), (4, 8), info.region_id, 0)])],
    )
    with pytest.raises(ProtocolError, match="overrun region"):
        await env.client.publish(bad)
    assert await env.client.versions("toy") == []


async def test_refusals_come_back_as_json_error_and_detail(env: Env) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{env.url}/v1/sources/none/versions/3") as r:
            assert r.status == 404
            body = await r.json()
        async with s.post(
            f"{env.url}/v1/leases", data=b"{not json", headers={"Content-Type": "application/json"}
        ) as r2:
            assert r2.status == 400
            body2 = await r2.json()
    assert body["error"] == "NotFoundError" and "version 3" in body["detail"]
    assert body2["error"] == "ProtocolError" and "body refused" in body2["detail"]


async def test_the_merged_manifest_is_served_only_for_a_ready_version(env: Env) -> None:
    info = await env.client.create_region(128)
    for part in (0, 1):
        m = ManifestIn(
            "two",
            1,
            part,
            2,
            [
                TensorEntry(
                    "w",
                    (4, 8),
                    "float32",
                    [ShardEntry((part * 2, 0), (2, 8), info.region_id, part * 64)],
                )
            ],
        )
        if part == 1:
            with pytest.raises(ConflictError, match=r"published parts \[0\] of 2"):
                await env.client.manifest("two", 1)
        assert (await env.client.publish(m)).state is (
            VersionState.READY if part else VersionState.PENDING
        )
    merged = await env.client.manifest("two", 1)
    assert merged.node_id == "t" and [s.offset for s in merged.tensors[0].shards] == [
        (0, 0),
        (2, 0),
    ]


async def test_a_local_pull_copies_exactly_the_described_bytes(env: Env) -> None:
    src, _ = await publish_toy(env.client)
    dst, dseg = await dest_region(env.client, 64)
    lease = await env.client.acquire_lease("toy", 1)
    res = await env.client.pull(
        PullRequest(
            "toy", 1, lease.lease_id, table([[src, 32, dst, 0, 32], [src, 96, dst, 32, 32]])
        )
    )
    assert res.state is PullState.DONE and res.bytes_done == 64 and res.descriptors_done == 2
    got = dseg.numpy(np.float32)
    assert got.tolist() == [1.0 + i for i in [*range(8, 16), *range(24, 32)]]


async def test_an_out_of_bounds_descriptor_is_refused_by_index_and_nothing_is_written(
    env: Env,
) -> None:
    src, _ = await publish_toy(env.client)
    dst, dseg = await dest_region(env.client, 64)
    lease = await env.client.acquire_lease("toy", 1)
    rows = [[src, 0, dst, 0, 32], [src, 120, dst, 32, 16]]
    with pytest.raises(ProtocolError, match=r"descriptor 1 refused.*source range ends past"):
        await env.client.submit_pull(PullRequest("toy", 1, lease.lease_id, table(rows)))
    assert not dseg.numpy().any()
    assert await env.client.pulls() == []


async def test_a_pull_without_a_live_lease_is_refused_with_conflict(env: Env) -> None:
    src, _ = await publish_toy(env.client)
    dst, dseg = await dest_region(env.client, 64)
    with pytest.raises(ConflictError, match="unknown or was released"):
        await env.client.submit_pull(PullRequest("toy", 1, "l-nope", table([[src, 0, dst, 0, 8]])))
    lease = await env.client.acquire_lease("toy", 1, ttl_s=5)
    env.clock.now += 6
    with pytest.raises(ConflictError, match="expired"):
        await env.client.submit_pull(
            PullRequest("toy", 1, lease.lease_id, table([[src, 0, dst, 0, 8]]))
        )
    assert not dseg.numpy().any()


async def test_a_lease_on_a_retired_version_cannot_be_taken(env: Env) -> None:
    await publish_toy(env.client, 1)
    await publish_toy(env.client, 2)
    with pytest.raises(ConflictError, match="retired"):
        await env.client.acquire_lease("toy", 1)


async def test_publishing_into_a_ready_version_is_refused_and_drain_returns_on_release(
    env: Env,
) -> None:
    await publish_toy(env.client)
    lease = await env.client.acquire_lease("toy", 1, ttl_s=60)
    with pytest.raises(ConflictError, match="never changes once ready"):
        await publish_toy(env.client)
    drain = asyncio.create_task(env.client.wait_drain("toy", 1, timeout_s=30))
    assert not drain.done()
    await env.client.release_lease(lease.lease_id)
    info = await drain
    assert info.leases == 0
    with pytest.raises(ConflictError, match="never changes once ready"):
        await publish_toy(env.client)  # drained or not, a READY version stays as it is
    await publish_toy(env.client, version=2)


async def test_a_pack_spec_gathers_a_strided_column_block_into_one_read(env: Env) -> None:
    src, _ = await publish_toy(env.client)
    dst, dseg = await dest_region(env.client, 64)
    lease = await env.client.acquire_lease("toy", 1)
    # Columns 2..3 of all four rows of the 4x8 tensor, packed contiguous.
    spec = PackSpec(src, 2 * 4, (4, 2), (8, 1), 4, dst, 16)
    res = await env.client.pull(PullRequest("toy", 1, lease.lease_id, table([]), [spec]))
    assert res.state is PullState.DONE and res.bytes_done == 32
    got = dseg.numpy(np.float32)[4:12].tolist()
    assert got == [1.0 + r * 8 + c for r in range(4) for c in (2, 3)]
    # A second pack pull reuses the pooled staging region instead of making another.
    await env.client.pull(PullRequest("toy", 1, lease.lease_id, table([]), [spec]))
    assert [r.label for r in await env.client.regions()].count("staging") == 1


async def test_a_pack_spec_over_shm_is_read_directly_without_a_staging_copy(env: Env) -> None:
    """Over shared memory the reader maps the source: a block whose rows are long runs
    is gathered straight into its destination, and the source packs nothing."""
    src, _ = await publish_toy(env.client, cols=256)
    dst, dseg = await dest_region(env.client, 4 * 128 * 4)
    lease = await env.client.acquire_lease("toy", 1)
    # Columns 64..191 of all four rows (512-byte runs), packed contiguous.
    spec = PackSpec(src, 64 * 4, (4, 128), (256, 1), 4, dst, 0)
    res = await env.client.pull(PullRequest("toy", 1, lease.lease_id, table([]), [spec]))
    assert res.state is PullState.DONE and res.bytes_done == 4 * 128 * 4
    assert res.descriptors_done == res.descriptors_total == 1
    got = dseg.numpy(np.float32).reshape(4, 128)
    want = 1.0 + np.arange(4 * 256, dtype=np.float32).reshape(4, 256)[:, 64:192]
    assert np.array_equal(got, want)
    assert "staging" not in [r.label for r in await env.client.regions()]


async def test_a_pack_spec_reaching_outside_its_source_is_refused(env: Env) -> None:
    src, _ = await publish_toy(env.client)
    dst, dseg = await dest_region(env.client, 64)
    lease = await env.client.acquire_lease("toy", 1)
    spec = PackSpec(src, 2 * 4, (5, 2), (8, 1), 4, dst, 0)
    with pytest.raises(ProtocolError, match=r"pack spec 0 .*outside"):
        await env.client.submit_pull(PullRequest("toy", 1, lease.lease_id, table([]), [spec]))
    assert not dseg.numpy().any()


async def test_a_lease_expiring_mid_pull_fails_it_and_names_the_suspect_ranges(gated: Env) -> None:
    c = gated.client
    src, _ = await publish_toy(c)
    dst, _ = await dest_region(c, 64)
    lease = await c.acquire_lease("toy", 1, ttl_s=10)
    started = await c.submit_pull(
        PullRequest("toy", 1, lease.lease_id, table([[src, 0, dst, 0, 64]]))
    )
    assert gated.copier is not None
    await gated.copier.entered.wait()
    gated.clock.now += 11
    gated.copier.gate.set()
    with pytest.raises(ConflictError, match="expired") as info:
        await c.wait_pull(started.pull_id)
    result = info.value.progress  # type: ignore[attr-defined]
    assert result.state is PullState.FAILED
    assert result.suspect == [(dst, 0, 64)]


async def test_a_cancelled_pull_reports_cancelled(gated: Env) -> None:
    c = gated.client
    src, _ = await publish_toy(c)
    dst, dseg = await dest_region(c, 64)
    lease = await c.acquire_lease("toy", 1)
    started = await c.submit_pull(
        PullRequest("toy", 1, lease.lease_id, table([[src, 0, dst, 0, 64]]))
    )
    assert gated.copier is not None
    await gated.copier.entered.wait()
    res = await c.cancel_pull(started.pull_id)
    assert res.state is PullState.CANCELLED
    assert res.error is not None and res.error.detail.endswith("cancelled by request")
    assert not dseg.numpy().any()


async def test_a_pull_cut_off_by_shutdown_says_the_daemon_is_shutting_down() -> None:
    copier = GatedCopier()
    d = Daemon(daemon_config(transport="shm", shutdown_grace_s=0), copier=copier)
    async with served(d) as s:
        app, c = s.app, s.client
        src, _ = await publish_toy(c)
        dst, dseg = await dest_region(c, 64)
        lease = await c.acquire_lease("toy", 1)
        rows = table([[src, 0, dst, 0, 64]])
        started = await c.submit_pull(PullRequest("toy", 1, lease.lease_id, rows))
        await copier.entered.wait()
        pulls = app[PULLS]
    # The daemon stopped with the copy still held: the grace (0 s) ran out.
    res = pulls.get(started.pull_id).snapshot()
    assert res.state is PullState.CANCELLED
    assert res.error is not None and "daemon shutting down" in res.error.detail
    assert not dseg.numpy().any()


async def test_an_unknown_route_is_answered_in_the_error_shape(env: Env) -> None:
    async with aiohttp.ClientSession() as s, s.get(f"{env.url}/v1/nope") as r:
        assert r.status == 404
        body = await r.json()
    assert body["error"] == "NotFoundError" and "/v1/nope" in body["detail"]


async def test_a_publisher_drain_retires_the_version_so_no_reader_can_lease_it_meanwhile(
    env: Env,
) -> None:
    await publish_toy(env.client)
    held = await env.client.acquire_lease("toy", 1, ttl_s=60)
    with pytest.raises(ConflictError, match="still holds 1 lease"):
        await env.client.wait_drain("toy", 1, timeout_s=0, retire=True)
    with pytest.raises(ConflictError, match="retired"):
        await env.client.acquire_lease("toy", 1)
    assert (await env.client.check_lease(held.lease_id, "toy", 1)).lease_id == held.lease_id
    await env.client.release_lease(held.lease_id)
    assert (await env.client.wait_drain("toy", 1, timeout_s=0)).leases == 0


async def test_a_kept_lease_that_lapses_anyway_is_not_revived_and_the_pull_fails_closed(
    gated: Env,
) -> None:
    c = gated.client
    src, _ = await publish_toy(c)
    dst, _ = await dest_region(c, 64)
    lease = await c.acquire_lease("toy", 1, ttl_s=10)
    async with LeaseKeeper(c, lease, every_s=0.01) as keeper:
        started = await c.submit_pull(
            PullRequest("toy", 1, lease.lease_id, table([[src, 0, dst, 0, 64]]))
        )
        assert gated.copier is not None
        await gated.copier.entered.wait()
        await keeper.wait(1)
        assert keeper.renewals >= 1 and not keeper.stopped
        gated.clock.now += 11  # past the last renewal's end, before the next tick
        await keeper.wait(10**9)  # returns once renewing stopped
        assert isinstance(keeper.error, ConflictError) and "expired" in str(keeper.error)
        gated.copier.gate.set()
        with pytest.raises(ConflictError, match="expired") as info:
            await c.wait_pull(started.pull_id)
    assert info.value.progress.suspect == [(dst, 0, 64)]  # type: ignore[attr-defined]


async def test_a_lease_keeper_that_could_not_keep_its_lease_alive_is_refused(env: Env) -> None:
    await publish_toy(env.client)
    lease = await env.client.acquire_lease("toy", 1, ttl_s=5)
    with pytest.raises(ProtocolError, match=r"every 5\.0s would not keep a 5\.0s lease"):
        LeaseKeeper(env.client, lease, every_s=5.0)
