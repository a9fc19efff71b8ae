"""A real daemon's pulls into and out of device memory, on a host without a GPU.

The daemon (in this process, real HTTP on 127.0.0.1:0, real shared segments) holds
``hostdev`` regions (tests/support/devices.py: a device kind over host memory with a
copy engine of its own, registered the way a GPU allocation is once opened), so the
whole pull path a GPU region takes runs here: validation, pins, routing to the
engine, the reported path, and a device error failing one pull with its suspect bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from support.costs import LoopStall
from support.daemons import Served, daemon_config, serving_daemons
from support.daemons import served as serve
from support.devices import DRIVER, HostDeviceEngine, HostDeviceMemory

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import ConflictError, RefitError, TransportError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    MemoryKind,
    PackSpec,
    PullRequest,
    RegionAttach,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)

N = 1 << 20
MAX_STALL_S = 0.100
"""The longest a daemon's loop may serve nothing else, s (the cost harness's)."""
PIECE = 4096


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[Daemon, RefitClient]]:
    d = Daemon(daemon_config(node_id="devices", transport="shm"))
    async with serve(d) as s:
        yield d, s.client


@contextlib.asynccontextmanager
async def two_hosts() -> AsyncIterator[tuple[Served, Served]]:
    """A daemon as if on another host (``far``: another boot id) and the engine's
    (``near``), trusting each other over ``tcp``."""
    opts: dict[str, object] = dict(transport="tcp", allow=("http://127.0.0.1:*",))
    secret = b"one-deployment-secret-0123456789"
    far = Daemon(daemon_config(node_id="far", **opts), secret=secret, boot_id="another-host")
    near = Daemon(daemon_config(node_id="engine", **opts), secret=secret)
    async with serve(far) as f, serve(near) as n:
        yield f, n


async def device_region(
    d: Daemon, engine: HostDeviceEngine, label: str
) -> tuple[RegionInfo, HostDeviceMemory]:
    """A device region of ``N`` bytes, recorded as an opened GPU allocation is."""
    memory = HostDeviceMemory(N, engine)
    req = RegionAttach(memory.name, N, MemoryKind.CUDA, label=label)
    return await d.store.record_attached(memory, req), memory


async def host_source(c: RefitClient, model: str) -> tuple[RegionInfo, np.ndarray, str]:
    """A host region of random bytes published as ``model`` v1; its lease."""
    info = await c.create_region(N, label=model)
    data = np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8)
    with SharedSegment.attach(info.handle, info.nbytes) as seg:
        seg.numpy()[:] = data
    await publish(c, model, info.region_id)
    return info, data, (await c.acquire_lease(model, 1, 600.0)).lease_id


async def publish(c: RefitClient, model: str, region: int) -> None:
    shard = ShardEntry((0,), (N,), region, 0)
    await c.publish(ManifestIn(model, 1, 0, 1, [TensorEntry("b", (N,), "uint8", [shard])]))


def shuffled(src: int, dst: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    n = N // PIECE
    perm = np.random.default_rng(seed).permutation(n)
    rows = np.stack(
        [np.full(n, src), perm * PIECE, np.full(n, dst), np.arange(n) * PIECE, np.full(n, PIECE)],
        axis=1,
    ).astype(np.int64)
    return rows, perm


def request(
    model: str, lease: str, rows: np.ndarray, packs: list[PackSpec] | None = None
) -> PullRequest:
    return PullRequest(model, 1, lease, DescriptorTable.pack(rows), packs or [], "")


async def test_a_pull_lands_in_device_memory_through_its_engine_and_names_that_path() -> None:
    engine = HostDeviceEngine()
    async with served() as (d, c):
        src, data, lease = await host_source(c, "m")
        dst, memory = await device_region(d, engine, "engine")
        rows, perm = shuffled(src.region_id, dst.region_id)
        done = await c.pull(request("m", lease, rows))
        assert done.path == "shm+hostdev"
        got = np.frombuffer(memory.read(0, N), np.uint8).reshape(-1, PIECE)
        assert np.array_equal(got, data.reshape(-1, PIECE)[perm])
        assert engine.batches >= 1 and engine.pinned, "the host source was not registered once"


async def test_a_device_error_fails_only_the_pull_that_met_it_naming_its_suspect_bytes() -> None:
    engine = HostDeviceEngine()
    async with served() as (d, c):
        src, data, lease = await host_source(c, "m")
        dst, memory = await device_region(d, engine, "engine")
        host_dst = await c.create_region(N, label="host-dst")
        rows, perm = shuffled(src.region_id, dst.region_id)
        engine.fail_next(at_read=5)
        with pytest.raises(RefitError, match="HOSTDEV_ERROR") as failed:
            await c.pull(request("m", lease, rows))
        suspect = failed.value.progress.suspect  # type: ignore[attr-defined]
        assert suspect and {r for r, _, _ in suspect} == {dst.region_id}
        # The daemon, the region and host pulls go on; the same pull then lands.
        host_rows, _ = shuffled(src.region_id, host_dst.region_id)
        assert (await c.pull(request("m", lease, host_rows))).path == "shm"
        await c.pull(request("m", lease, rows))
        got = np.frombuffer(memory.read(0, N), np.uint8).reshape(-1, PIECE)
        assert np.array_equal(got, data.reshape(-1, PIECE)[perm])


async def test_device_memory_is_one_region_and_its_deletion_lets_go_of_it() -> None:
    engine = HostDeviceEngine()
    async with served() as (d, c):
        dst, memory = await device_region(d, engine, "engine")
        again = memory.opened_again()
        with pytest.raises(ConflictError, match=f"already holds as region {dst.region_id}"):
            await d.store.record_attached(
                again, RegionAttach(memory.name, N, MemoryKind.CUDA, label="again")
            )
        assert again.closed, "the refused second opening was not let go"
        assert not memory.closed, "refusing a second id closed the first region's memory"
        await c.delete_region(dst.region_id)
        assert memory.closed


async def test_a_strided_pack_from_device_memory_is_gathered_by_its_engine() -> None:
    engine = HostDeviceEngine()
    async with served() as (d, c):
        src, memory = await device_region(d, engine, "weights")
        data = np.random.default_rng(5).integers(0, 256, N, dtype=np.uint8)
        memory.write(0, data.tobytes())
        await publish(c, "dev", src.region_id)
        lease = (await c.acquire_lease("dev", 1, 600.0)).lease_id
        dst = await c.create_region(N, label="dst")
        # 2-byte runs, 16 bytes apart: too short to read directly, so the source packs
        # them, and its CPU cannot address the memory: the engine gathers them.
        spec = PackSpec(src.region_id, 0, (64, 1), (8, 1), 2, dst.region_id, 0)
        empty = np.zeros((0, 5), dtype=np.int64)
        await c.pull(request("dev", lease, empty, [spec]))
        with SharedSegment.attach(dst.handle, N) as seg:
            got = seg.numpy()[:128].reshape(64, 2)
        assert np.array_equal(got, data.reshape(-1, 16)[:64, :2])
        assert engine.batches >= 1


async def test_a_peer_daemons_gpu_region_is_refused_on_the_shm_only_path() -> None:
    engine = HostDeviceEngine()
    secret = b"one-deployment-secret-0123456789"
    a = Daemon(daemon_config(node_id="holder", transport="shm"), secret=secret)
    b = Daemon(daemon_config(node_id="reader", transport="shm"), secret=secret)
    async with serving_daemons(a, b) as (ca, cb):
        src, _ = await device_region(a, engine, "weights")
        await publish(ca, "dev", src.region_id)
        lease = (await ca.acquire_lease("dev", 1, 600.0)).lease_id
        dst = await cb.create_region(N, label="dst")
        rows = np.array([(src.region_id, 0, dst.region_id, 0, PIECE)], dtype=np.int64)
        req = PullRequest("dev", 1, lease, DescriptorTable.pack(rows), [], ca.base_url)
        with pytest.raises(TransportError, match="GPU memory, which only the daemon holding"):
            await cb.pull(req)
        assert engine.batches == 0


async def test_a_peer_daemons_gpu_region_is_read_through_its_staging_over_tcp() -> None:
    far_engine, near_engine = HostDeviceEngine(), HostDeviceEngine()
    async with two_hosts() as (f, n):
        far, near = f.daemon, n.daemon
        src, src_memory = await device_region(far, far_engine, "weights")
        data = np.random.default_rng(11).integers(0, 256, N, dtype=np.uint8)
        src_memory.write(0, data.tobytes())
        await publish(f.client, "gpu", src.region_id)
        lease = (await f.client.acquire_lease("gpu", 1, 600.0)).lease_id
        dst, dst_memory = await device_region(near, near_engine, "engine")
        host_dst = await n.client.create_region(N, label="host-dst")
        rows, perm = shuffled(src.region_id, dst.region_id)
        rows[::2, 2] = host_dst.region_id  # GPU to host and GPU to GPU, across hosts
        req = PullRequest("gpu", 1, lease, DescriptorTable.pack(rows), [], f.url)
        done = await n.client.pull(req)
        assert done.path == "tcp+hostdev"
        want = data.reshape(-1, PIECE)[perm]
        got = np.frombuffer(dst_memory.read(0, N), np.uint8).reshape(-1, PIECE)
        assert np.array_equal(got[1::2], want[1::2])
        with SharedSegment.attach(host_dst.handle, N) as seg:
            assert np.array_equal(seg.numpy().reshape(-1, PIECE)[::2], want[::2])
        assert far_engine.batches >= 1, "the source's GPU bytes did not go through its engine"
        assert near_engine.batches >= 1


async def test_status_counts_the_gpu_regions_apart_from_host_ones() -> None:
    import asyncio
    import json
    import sys

    engine = HostDeviceEngine()
    async with served() as (d, c):
        await c.create_region(4096, label="host")
        await device_region(d, engine, "engine")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "refitd.cli", "status", "--url", c.base_url, "--json",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        got = json.loads(out)
        assert (got["regions"], got["gpu_regions"], got["gpu_region_bytes"]) == (2, 1, N)


async def test_over_tcp_device_bound_reads_are_staged_through_one_kept_host_region_and_land() -> (
    None
):
    engine = HostDeviceEngine()
    async with two_hosts() as (f, n):
        src, data, lease = await host_source(f.client, "m")
        dst, memory = await device_region(n.daemon, engine, "engine")
        host_dst = await n.client.create_region(N, label="host-dst")
        rows, perm = shuffled(src.region_id, dst.region_id)
        rows[::2, 2] = host_dst.region_id  # half the pieces to host memory, unstaged
        req = PullRequest("m", 1, lease, DescriptorTable.pack(rows), [], f.url)
        calls = len(DRIVER.calls)
        done = await n.client.pull(req)
        assert done.path == "tcp+hostdev"
        got = np.frombuffer(memory.read(0, N), np.uint8).reshape(-1, PIECE)
        want = data.reshape(-1, PIECE)[perm]
        assert np.array_equal(got[1::2], want[1::2]), "staged pieces landed wrong bytes"
        with SharedSegment.attach(host_dst.handle, N) as seg:
            assert np.array_equal(seg.numpy().reshape(-1, PIECE)[::2], want[::2])
        assert engine.batches >= 1, "the device-bound pieces did not go through the engine"
        (staging,) = [r for r in await n.client.regions() if r.label == "device-staging"]
        # Kept for the next pull, which takes it as it is: made, backed and registered
        # with the driver once, not once per pull.
        await n.client.pull(req)
        assert [r for r in await n.client.regions() if r.label == "device-staging"] == [staging]
        address = n.daemon.store.segments[staging.region_id].address
        assert [a for c, a, _ in DRIVER.calls[calls:] if c == "register"].count(address) == 1


async def test_a_device_error_in_a_staged_pull_fails_it_and_its_staging_serves_the_next() -> None:
    engine = HostDeviceEngine()
    async with two_hosts() as (f, n):
        src, _, lease = await host_source(f.client, "m")
        dst, _ = await device_region(n.daemon, engine, "engine")
        rows, _ = shuffled(src.region_id, dst.region_id)
        engine.fail_next(at_read=2)
        req = PullRequest("m", 1, lease, DescriptorTable.pack(rows), [], f.url)
        with pytest.raises(RefitError, match="HOSTDEV_ERROR") as failed:
            await n.client.pull(req)
        assert {r for r, _, _ in failed.value.progress.suspect} == {dst.region_id}  # type: ignore[attr-defined]
        # Its staging region is given back whole: the next pull takes it and lands.
        (staging,) = [r for r in await n.client.regions() if r.label == "device-staging"]
        await n.client.pull(req)
        assert [r for r in await n.client.regions() if r.label == "device-staging"] == [staging]


async def test_deleting_a_region_a_device_copied_unregisters_it_off_the_event_loop() -> None:
    import threading

    from transports.pins import PINS

    engine = HostDeviceEngine()
    async with served() as (d, c):
        src, memory = await device_region(d, engine, "weights")
        memory.write(0, bytes(range(256)) * (N // 256))
        await publish(c, "dev", src.region_id)
        lease = (await c.acquire_lease("dev", 1, 600.0)).lease_id
        dst = await c.create_region(N, label="dst")
        rows = np.array([(src.region_id, 0, dst.region_id, 0, N)], dtype=np.int64)
        await c.pull(request("dev", lease, rows))
        address = d.store.segments[dst.region_id].address
        assert address in PINS.pinned(), "the destination was not registered"
        calls = len(DRIVER.calls)
        await c.delete_region(dst.region_id)
        assert address not in PINS.pinned() and address not in DRIVER.registered
        gone = DRIVER.calls[calls:]
        (thread,) = [t for call, a, t in gone if call == "unregister" and a == address]
        assert thread != threading.get_ident(), "the driver's unregister ran on the event loop"


async def test_a_daemon_locks_no_host_memory_past_its_pinned_cap_and_still_lands_the_bytes() -> (
    None
):
    from transports.pins import PINS

    engine = HostDeviceEngine()
    d = Daemon(daemon_config(node_id="capped", transport="shm", max_pinned_bytes=0))
    try:
        async with serve(d) as s:
            c = s.client
            src, data, lease = await host_source(c, "m")
            dst, memory = await device_region(d, engine, "engine")
            rows, perm = shuffled(src.region_id, dst.region_id)
            await c.pull(request("m", lease, rows))
            got = np.frombuffer(memory.read(0, N), np.uint8).reshape(-1, PIECE)
            assert np.array_equal(got, data.reshape(-1, PIECE)[perm])
            assert engine.pinned == [] and engine.bounced_bytes == N
            assert d.store.segments[src.region_id].address not in PINS.pinned()
    finally:
        PINS.limit(None)  # the table is the process's: the next test's default


async def test_a_pull_of_many_reads_of_a_peers_gpu_region_is_planned_and_packed_off_the_loop() -> (
    None
):
    # One 8-byte read a row of a peer's GPU region: the source stages each as a pack
    # spec of its own, a Python step a row where the pull makes it, where the source
    # checks and packs it and where the pull reads it back. Both daemons share this
    # loop: the longest stall of either, from the loop thread's own CPU time.
    far_engine = HostDeviceEngine()
    async with two_hosts() as (f, n):
        src, src_memory = await device_region(f.daemon, far_engine, "weights")
        data = np.random.default_rng(13).integers(0, 256, N, dtype=np.uint8)
        src_memory.write(0, data.tobytes())
        await publish(f.client, "gpu", src.region_id)
        lease = (await f.client.acquire_lease("gpu", 1, 600.0)).lease_id
        dst = await n.client.create_region(N, label="host-dst")
        reads = N // 8
        perm = np.random.default_rng(5).permutation(reads)
        rows = np.stack(
            [np.full(reads, src.region_id), perm * 8, np.full(reads, dst.region_id),
             np.arange(reads) * 8, np.full(reads, 8)], axis=1,
        ).astype(np.int64)  # fmt: skip
        req = PullRequest("gpu", 1, lease, DescriptorTable.pack(rows), [], f.url)
        stall = LoopStall()
        stall.start()
        try:
            started = await n.client.submit_pull(req)
            done = await n.client.wait_pull(started.pull_id)
        finally:
            stall.stop()
        assert done.state == "done", done
        with SharedSegment.attach(dst.handle, N) as seg:
            assert np.array_equal(seg.numpy().reshape(-1, 8), data.reshape(-1, 8)[perm])
        assert stall.longest <= MAX_STALL_S, f"the loop served nothing else for {stall.longest} s"
