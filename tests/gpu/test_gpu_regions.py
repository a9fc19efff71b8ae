"""GPU memory end to end through a real daemon (a child process: CUDA IPC handles open
only in another process than the one that made them).

Every test but the first needs a CUDA device and skips, naming why, without one.
NOTE: written without a GPU; their first run is tests/gpu/run-on-device.sh.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from refitd.bench.gpu import missing_gpu
from refitd.client.http import RefitClient
from refitd.client.spawn import SpawnedDaemon, spawn_daemon
from refitd.errors import ConflictError, ProtocolError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    MemoryKind,
    PullRequest,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)

pytestmark = pytest.mark.timeout(300)

NBYTES = 8 << 20


def test_bench_gpu_exits_2_naming_why_where_there_is_no_cuda() -> None:
    why = missing_gpu()
    if why is None:
        pytest.skip("this machine has a CUDA device: the benchmark runs instead")
    done = subprocess.run(
        [sys.executable, "-m", "refitd.cli", "bench", "gpu"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "cannot run" in done.stderr and why.split(" (")[0] in done.stderr


def test_the_driver_binding_exports_a_tensors_whole_allocation(gpu: None) -> None:
    # First, without a daemon: a failure here is the ctypes binding, not the daemon.
    import torch

    from transports.cuda import DeviceAllocation, export_allocation, parse_handle
    from transports.cudadriver import device_count, driver

    assert device_count() >= 1
    t = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    ex = export_allocation(t.data_ptr() + 4096)
    assert ex.base <= t.data_ptr() and t.data_ptr() + NBYTES <= ex.base + ex.size
    uuid, raw = parse_handle(ex.handle)
    assert uuid == driver().uuid(ex.ordinal) and len(raw) == 64
    a = DeviceAllocation(0, NBYTES)
    flat = torch.as_tensor(a, device="cuda:0")
    assert flat.data_ptr() == a.pointer and flat.numel() == NBYTES  # no copy
    assert export_allocation(a.pointer).base == a.pointer  # an allocation of its own


@pytest.fixture
async def node(gpu: None, secret_file: str) -> AsyncIterator[tuple[SpawnedDaemon, RefitClient]]:
    async with (
        spawn_daemon(secret_file=secret_file, transport="shm", node_id="gpu") as d,
        RefitClient(d.url) as c,
    ):
        yield d, c


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def _publish(c: RefitClient, model: str, region: RegionInfo, nbytes: int) -> str:
    shard = ShardEntry((0,), (nbytes,), region.region_id, 0)
    await c.publish(ManifestIn(model, 1, 0, 1, [TensorEntry("b", (nbytes,), "uint8", [shard])]))
    return (await c.acquire_lease(model, 1, 600.0)).lease_id


async def _pull(c: RefitClient, model: str, lease: str, rows: np.ndarray) -> None:
    await c.pull(PullRequest(model, 1, lease, DescriptorTable.pack(rows.astype(np.int64)), [], ""))


async def test_the_daemon_opens_cuda_only_once_a_gpu_region_exists(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import torch

    from refitd.client.gpu import device_buffer

    d, c = node
    await c.create_region(4096)  # host regions make no CUDA context
    assert "libcuda" not in _maps(d.pid)
    _, region = await device_buffer(c, NBYTES, torch.device("cuda", 0), label="g")
    assert region.kind is MemoryKind.CUDA and region.nbytes >= NBYTES
    assert "libcuda" in _maps(d.pid)
    assert ":" not in region.handle.removeprefix("cuda:").split(":", 1)[1]  # a digest only


async def test_an_allocation_is_registered_once_and_a_second_id_for_it_is_refused(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import torch

    from refitd.client.gpu import attach_tensor

    _, c = node
    t = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    region, offset = await attach_tensor(c, t[4096:], label="caching-allocator")
    assert offset >= 4096 and region.nbytes >= NBYTES
    with pytest.raises(ConflictError, match="already holds"):
        await attach_tensor(c, t, label="again")


async def test_a_registered_allocation_outlives_its_tensor_and_empty_cache(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import torch

    from refitd.client.gpu import attach_tensor, held_allocations

    _, c = node
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    t = torch.full((NBYTES,), 5, dtype=torch.uint8, device="cuda")
    region, at = await attach_tensor(c, t, label="held")
    held = held_allocations()
    del t
    torch.cuda.empty_cache()  # would give the segment back were no block of it live
    assert torch.cuda.memory_reserved() >= before + NBYTES, "the registered segment was freed"
    assert held_allocations() == held >= 1
    lease = await _publish(c, "held", region, NBYTES)
    dst = await c.create_region(NBYTES, label="dst")
    await _pull(c, "held", lease, np.array([(region.region_id, at, dst.region_id, 0, NBYTES)]))
    from transports.segments import SharedSegment

    with SharedSegment.attach(dst.handle, NBYTES) as seg:
        assert (seg.numpy() == 5).all(), "the allocation's bytes changed after empty_cache"


def test_memory_mapped_with_cumemcreate_is_refused_naming_why(gpu: None) -> None:
    # The allocator's setting is read once per process: a child of its own runs it.
    child = (
        "import torch\n"
        "from transports.cuda import CudaError, export_allocation\n"
        "t = torch.zeros(1 << 20, dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    export_allocation(t.data_ptr(), 0)\n"
        "except CudaError as e:\n"
        "    assert 'expandable segments' in str(e), e\n"
        "    print('refused')\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"


async def test_a_gpu_handle_is_refused_past_its_allocation_and_taken_within_it(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import torch

    from transports.cuda import export_allocation

    _, c = node
    t = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    ex = export_allocation(t.data_ptr(), t.device.index)
    with pytest.raises(ProtocolError, match="fewer than"):
        await c.attach_region(ex.handle, ex.size + 1, kind=MemoryKind.CUDA)
    # The importer may see the allocation rounded up: a region of the bytes stated.
    region = await c.attach_region(ex.handle, ex.size - 512, kind=MemoryKind.CUDA)
    assert region.nbytes == ex.size - 512


@pytest.mark.parametrize("src_kind", ["gpu", "host"])
@pytest.mark.parametrize("dst_kind", ["gpu", "host"])
async def test_pulls_between_gpu_and_host_regions_land_byte_exact(
    node: tuple[SpawnedDaemon, RefitClient], src_kind: str, dst_kind: str
) -> None:
    import torch

    from refitd.client.gpu import device_buffer
    from transports.segments import SharedSegment

    _, c = node
    dev = torch.device("cuda", 0)
    data = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)

    async def region(kind: str, label: str) -> tuple[RegionInfo, object]:
        if kind == "gpu":
            flat, info = await device_buffer(c, NBYTES, dev, label=label)
            return info, flat
        info = await c.create_region(NBYTES, label=label)
        return info, SharedSegment.attach(info.handle, info.nbytes)

    src, src_mem = await region(src_kind, "src")
    dst, dst_mem = await region(dst_kind, "dst")
    if isinstance(src_mem, torch.Tensor):
        src_mem[:NBYTES].copy_(data.to(dev))
        torch.cuda.synchronize()
    else:
        assert isinstance(src_mem, SharedSegment)
        src_mem.numpy()[:] = data.numpy()
    model = f"m-{src_kind}-{dst_kind}"
    lease = await _publish(c, model, src, NBYTES)
    n = NBYTES // 4096
    perm = np.random.default_rng(1).permutation(n)
    rows = np.stack(
        [
            np.full(n, src.region_id),
            perm * 4096,
            np.full(n, dst.region_id),
            np.arange(n) * 4096,
            np.full(n, 4096),
        ],
        axis=1,
    )
    await _pull(c, model, lease, rows)
    got = (
        dst_mem[:NBYTES].cpu()
        if isinstance(dst_mem, torch.Tensor)
        else torch.from_numpy(dst_mem.numpy().copy())  # type: ignore[attr-defined]
    )
    want = data.view(n, 4096)[torch.from_numpy(perm)].reshape(-1)
    assert torch.equal(got, want), f"{src_kind} -> {dst_kind} 4 KiB pieces landed wrong bytes"


async def test_a_placed_tensor_is_published_only_once_the_writes_queued_into_it_ran(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import torch

    from refitd.client.publisher import Publisher
    from transports.segments import SharedSegment

    _, c = node
    t = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    pub = Publisher(c, "fenced")
    await pub.place("w", t)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued first
    t.fill_(7)  # the optimizer's write, still queued when publish is called
    await pub.publish(1)
    (shard,) = pub.manifest(1).tensors[0].shards
    lease = (await c.acquire_lease("fenced", 1, 600.0)).lease_id
    dst = await c.create_region(NBYTES, label="dst")
    await _pull(
        c, "fenced", lease, np.array([(shard.region, shard.byte_offset, dst.region_id, 0, NBYTES)])
    )
    with SharedSegment.attach(dst.handle, NBYTES) as seg:
        assert (seg.numpy() == 7).all(), "the daemon read the tensor before its write ran"


async def test_the_gpu_regions_of_a_process_that_dies_are_released(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    d, c = node
    child = (
        "import asyncio, os, torch\n"
        "from refitd.client.http import RefitClient\n"
        "from refitd.client.gpu import device_buffer\n"
        "async def main():\n"
        f"    async with RefitClient({d.url!r}) as c:\n"
        f"        await device_buffer(c, {NBYTES}, torch.device('cuda', 0), label='dies')\n"
        "        print('registered', flush=True)\n"
        "        os._exit(0)\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", child, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"registered"
    await proc.wait()
    for _ in range(300):  # the daemon reaps in a task once the child's pidfd fires
        if not any(r.label == "dies" for r in await c.regions()):
            break
        await asyncio.sleep(0.05)
    assert not any(r.label == "dies" for r in await c.regions()), "a dead client's GPU region"


@pytest.mark.parametrize("mode", ["staging", "direct"])
async def test_a_gpu_engine_is_refitted_with_every_parameter_kept_on_its_gpu(
    node: tuple[SpawnedDaemon, RefitClient], mode: str
) -> None:
    import torch

    from refitd.bench.gpu import _verify
    from refitd.bench.refit import capture_for, publish_layout
    from refitd.bench.synthetic import SyntheticState, synthetic_config
    from refitd.client.receiver import DaemonReceiver
    from refitd.testing.engines import EngineParallel, ToyEngine
    from refitd.testing.layouts import megatron_tp_ep

    _, c = node
    cfg = synthetic_config(0.01)
    dev = torch.device("cuda", 0)
    ranks = []
    for rank in range(2):
        par = EngineParallel(2, rank)
        engine = ToyEngine(cfg, par).to(dev)
        receiver = DaemonReceiver(
            local=c,
            source=c,
            model=f"toy-{mode}",
            engine=engine,
            twin=functools.partial(ToyEngine, cfg, par),
            capture=capture_for(megatron_tp_ep(cfg, 4, 1, None)),
            mode=mode,  # type: ignore[arg-type]
        )
        ranks.append((par, engine, receiver))
    pubs = await publish_layout(
        c, f"toy-{mode}", megatron_tp_ep(cfg, 4, 1, SyntheticState(cfg, 1)), 1
    )
    try:
        for _, _, r in ranks:
            await r.refit(1)
        assert all(p.device == dev for _, e, _ in ranks for p in e.parameters())
        assert _verify(cfg, 1, ranks)
    finally:
        for _, _, r in ranks:
            await r.close()
        for p in pubs:
            await p.close()


async def test_a_trainer_publishes_gpu_tensors_in_place_and_a_gpu_engine_refits_from_them(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import math

    import torch

    from refitd.bench.gpu import _verify
    from refitd.bench.refit import capture_for
    from refitd.bench.synthetic import SyntheticState, synthetic_config
    from refitd.client.publisher import Publisher
    from refitd.client.receiver import DaemonReceiver
    from refitd.testing.engines import EngineParallel, ToyEngine
    from refitd.testing.layouts import megatron_tp_ep

    _, c = node
    cfg = synthetic_config(0.01)
    dev = torch.device("cuda", 0)
    published = megatron_tp_ep(cfg, 1, 1, SyntheticState(cfg, 1))  # one trainer rank
    (session,) = published.buffers
    trainer = published.buffers[session].to(dev)  # the trainer's weights, on its GPU
    base = published.buffers[session].data_ptr()
    pub = Publisher(c, "in-place")
    for name, info in published.sources.items():
        for sh in info.shards:
            n = math.prod(sh.shape) * info.elsize
            block = trainer[sh.addr - base : sh.addr - base + n].view(info.dtype).view(sh.shape)
            await pub.place(name, block, tuple(info.global_shape), tuple(sh.shard_offset))
    await pub.publish(1)
    assert len([r for r in await c.regions() if r.kind is MemoryKind.CUDA]) == 1
    ranks = []
    for rank in range(2):
        par = EngineParallel(2, rank)
        engine = ToyEngine(cfg, par).to(dev)
        r = DaemonReceiver(
            local=c,
            source=c,
            model="in-place",
            engine=engine,
            twin=functools.partial(ToyEngine, cfg, par),
            capture=capture_for(megatron_tp_ep(cfg, 1, 1, None)),
        )
        ranks.append((par, engine, r))
    try:
        for _, _, r in ranks:
            stats = await r.refit(1)
            assert stats.pull.path == "shm+cuda"
        assert _verify(cfg, 1, ranks)
    finally:
        for _, _, r in ranks:
            await r.close()


async def test_a_gpu_source_with_adopt_is_published_in_place_one_region_per_allocation(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    import torch

    from refitd.client.gpu import device_buffer
    from refitd.integrations.sources import MegatronSource, ShardPublisher

    _, c = node
    dev = torch.device("cuda", 0)
    t = torch.arange(64 * 64, dtype=torch.float32, device=dev).reshape(64, 64)
    source = MegatronSource([("w", t[:32], (0, 0), (64, 64)), ("w", t[32:], (32, 0), (64, 64))])
    sp = ShardPublisher(c, "mg", adopt=True)
    await sp.publish(source, 1)
    assert sp.copied_bytes == 0, "a GPU block was copied instead of published in place"
    assert [r.kind for r in await c.regions()] == [MemoryKind.CUDA]  # one allocation
    m = await c.manifest("mg", 1)
    lease = (await c.acquire_lease("mg", 1, 600.0)).lease_id
    flat, dst = await device_buffer(c, t.numel() * 4, dev, label="dst")
    rows = np.array(
        [
            (s.region, s.byte_offset, dst.region_id, s.offset[0] * 64 * 4, 32 * 64 * 4)
            for s in m.tensors[0].shards
        ]
    )
    await _pull(c, "mg", lease, rows)
    assert torch.equal(flat[: t.numel() * 4].view(torch.float32).view(64, 64), t)


async def test_hugging_face_models_on_the_gpu_refitted_from_tp2_serve_what_fresh_ones_do(
    node: tuple[SpawnedDaemon, RefitClient],
) -> None:
    pytest.importorskip("transformers")
    import torch

    from refitd.bench.hfexact import engine_exact

    _, c = node
    lines: list[str] = []
    assert await engine_exact(c, torch.device("cuda", 0), lines.append), lines


async def test_gpu_memory_moves_between_two_daemons_through_staging_over_tcp(
    gpu: None, secret_file: str
) -> None:
    import torch

    from refitd.client.gpu import device_buffer

    dev = torch.device("cuda", 0)
    async with (
        spawn_daemon(secret_file=secret_file, transport="tcp", node_id="a") as a,
        spawn_daemon(secret_file=secret_file, transport="tcp", node_id="b", peers=[a.url]) as b,
        RefitClient(a.url) as ca,
        RefitClient(b.url) as cb,
    ):
        src_flat, src = await device_buffer(ca, NBYTES, dev, label="trainer")
        src_flat.copy_(torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device=dev))
        lease = await _publish(ca, "x", src, NBYTES)
        dst_flat, dst = await device_buffer(cb, NBYTES, dev, label="engine")
        rows = np.array([(src.region_id, 0, dst.region_id, 0, NBYTES)])
        req = PullRequest("x", 1, lease, DescriptorTable.pack(rows.astype(np.int64)), [], a.url)
        done = await cb.pull(req)
        assert done.path == "tcp+cuda"
        torch.cuda.synchronize()
        assert torch.equal(dst_flat[:NBYTES], src_flat[:NBYTES])
