"""The memory-kind seam: device memory meets the transport contract through its own engine.

``hostdev`` (tests/support/devices.py) is a device kind over host memory with an
engine of its own, so every path a GPU region takes (routing by kind, batching per
engine, host registration, a device error failing one batch) runs here on CPU, with
real transports, real shared segments and the real contract checks.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from support.devices import HostDeviceEngine, HostDeviceMemory, OtherDeviceMemory

from transports import checks
from transports.batch import READ_DTYPE
from transports.checks import LOCAL, REMOTE, Memory, Pair, open_pair
from transports.interface import PullFailed, create_transport
from transports.memory import KindRefused
from transports.segments import SharedSegment
from transports.shm import ShmTransport

pytestmark = pytest.mark.timeout(120)

SECRET = b"kinds-secret-0123456789abcdef"


def _device(engine: HostDeviceEngine) -> Callable[[int, str], Memory]:
    return lambda n, _label: HostDeviceMemory(n, engine)


def _host(n: int, label: str) -> Memory:
    return SharedSegment.create(n, label)


# (scheme, destination kind, source kind): every in-process path a device region
# can take. ``shm`` maps a peer's segments by name, so its sources are host memory.
CASES = [
    ("local", "hostdev", "host"),
    ("local", "host", "hostdev"),
    ("local", "hostdev", "hostdev"),
    ("reference", "hostdev", "hostdev"),
    ("shm", "hostdev", "host"),
]
IDS = [f"{s}-{d}-from-{r}" for s, d, r in CASES]


@pytest.fixture(params=CASES, ids=IDS)
async def kinds(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Pair, HostDeviceEngine]]:
    scheme, dst, src = request.param
    engine = HostDeviceEngine()
    make = {"host": _host, "hostdev": _device(engine)}
    async with open_pair(
        scheme, 4 << 20, 4 << 20, SECRET, local_memory=make[dst], remote_memory=make[src]
    ) as pair:
        yield pair, engine


async def test_device_memory_reads_land_byte_exact_at_every_size(
    kinds: tuple[Pair, HostDeviceEngine],
) -> None:
    pair, engine = kinds
    await checks.check_sizes(pair, (0, 1, 4096, 1 << 20))
    assert engine.batches > 0, "no read went through the device memory's engine"


async def test_a_shuffled_batch_of_small_pieces_is_one_engine_batch(
    kinds: tuple[Pair, HostDeviceEngine],
) -> None:
    pair, engine = kinds
    await checks.check_scattered_batch(pair)
    assert engine.batches == 1, "a scattered batch was not handed to the engine as one batch"
    assert engine.reads == 1024


async def test_device_memory_meets_the_rest_of_the_contract(
    kinds: tuple[Pair, HostDeviceEngine],
) -> None:
    pair, _ = kinds
    await checks.check_contiguous_batch(pair)
    await checks.check_concurrent_batches(pair)
    await checks.check_input_forms(pair)
    await checks.check_refusal_reads_nothing(
        pair, (LOCAL, 0, REMOTE, pair.remote.size - 10, 64), "ends past the region"
    )


async def test_a_device_error_fails_only_the_batch_that_met_it_naming_its_suspect_bytes() -> None:
    engine = HostDeviceEngine()
    async with open_pair(
        "local", 1 << 20, 1 << 20, SECRET, local_memory=_device(engine), remote_memory=_host
    ) as pair:
        batch = checks.shuffled_batch(16, 4096)
        engine.fail_next(at_read=3)
        with pytest.raises(PullFailed, match="HOSTDEV_ERROR") as failed:
            await pair.peer.get(batch)
        assert failed.value.suspect, "a failed device batch named no suspect destination bytes"
        assert {r.region for r in failed.value.suspect} == {LOCAL}
        # The transport, the peer and the engine go on: the same reads land next time.
        await pair.peer.get(batch)
        checks.expect(pair, batch)


async def test_a_pair_of_kinds_no_engine_moves_is_refused_before_any_byte_moves() -> None:
    engine = HostDeviceEngine()
    async with open_pair(
        "local",
        1 << 20,
        1 << 20,
        SECRET,
        local_memory=_device(engine),
        remote_memory=lambda n, _: OtherDeviceMemory(n, engine),
    ) as pair:
        checks.fill(pair.local, 0x5A)
        batch = np.array([(LOCAL, 0, REMOTE, 0, 4096)], READ_DTYPE)
        with pytest.raises(KindRefused, match="otherdev"):
            await pair.peer.get(batch)
        assert (checks.contents(pair.local) == 0x5A).all()
        assert engine.batches == 0


async def test_host_memory_is_registered_once_and_forgotten_when_its_mapping_closes() -> None:
    engine = HostDeviceEngine()
    async with ShmTransport(secret=SECRET) as shm:
        dev = HostDeviceMemory(1 << 20, engine)
        with (
            SharedSegment.create(1 << 20, "host") as host,
            SharedSegment.create(4096, "untouched") as other,
        ):
            host.numpy()[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
            await shm.register(1, dev)
            await shm.register(2, host)
            await shm.register(3, other)  # registered, never read: never pinned
            loop = shm.loopback()
            for k in range(3):  # three pulls host -> device through the daemon's own path
                await loop.get([(1, k * 4096, 2, k * 4096, 4096)])
            assert dev.read(0, 3 * 4096) == host.numpy()[: 3 * 4096].tobytes()
            assert engine.pinned == [host.address], "the host region was not registered once"
            address = host.address
            await shm.deregister(2)
        # The registration belongs to the mapping: it goes when the mapping does.
        assert address in engine.forgotten
        dev.close()


async def test_a_same_host_peer_never_advertises_device_memory() -> None:
    engine = HostDeviceEngine()
    async with ShmTransport(secret=SECRET) as shm:
        dev = HostDeviceMemory(4096, engine)
        with SharedSegment.create(4096, "host") as host:
            await shm.register(1, dev)
            await shm.register(2, host)
            assert [r.region_id for r in shm.advertise().regions] == [2]
        dev.close()


def test_transports_that_read_only_host_memory_do_not_register_device_memory() -> None:
    dev = HostDeviceMemory(4096, HostDeviceEngine())
    try:
        assert not create_transport("tcp", secret=SECRET).registers(dev)
        assert create_transport("shm", secret=SECRET).registers(dev)
        with SharedSegment.create(4096, "host") as host:
            assert create_transport("tcp", secret=SECRET).registers(host)
    finally:
        dev.close()


def test_a_host_only_daemon_and_client_never_load_cuda() -> None:
    code = (
        "import sys, pathlib, refitd.daemon.app.service, refitd.daemon.app.node, transports.shm\n"
        "assert not [m for m in sys.modules if m == 'transports.cuda' or "
        "m.startswith(('cuda.bindings', 'cupy', 'torch'))], 'the daemon imported CUDA'\n"
        "import refitd.client, refitd.client.receiver\n"
        "assert 'transports.cuda' not in sys.modules, 'the client imported transports.cuda'\n"
        "assert 'libcuda' not in pathlib.Path('/proc/self/maps').read_text(), 'libcuda loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_indexed_gather_lands_every_small_read_in_its_place() -> None:
    # The GPU engine's gather for small pieces, run on CPU memory: same indices, same copy.
    import torch

    from transports.cuda import gather_units

    rng = np.random.default_rng(5)
    units = 1 << 16
    space = torch.from_numpy(rng.integers(0, 1 << 62, units, dtype=np.int64))
    base = space.data_ptr()
    before = space.numpy().view(np.uint8).copy()
    sizes = rng.integers(1, 64, 300).astype(np.int64) * 8
    src = rng.integers(0, units * 4 - 512, 300).astype(np.int64) // 8 * 8  # first half
    dst = units * 4 + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    gather_units(space, base, base + dst, base + src, sizes)
    want = before.copy()
    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
        want[d : d + n] = before[s : s + n]
    assert np.array_equal(space.numpy().view(np.uint8), want)


def test_a_strided_block_read_row_by_row_is_one_2d_copy_and_irregular_reads_are_not() -> None:
    from transports.cuda import strided_runs

    rows = np.arange(64, dtype=np.int64)
    # 64 rows of 2 KiB, 8 KiB apart at the source, packed at the destination (a pack
    # spec read directly), then three irregular reads, then a contiguous run of 4.
    dst = np.concatenate([rows * 2048, [1 << 20, (1 << 20) + 9000, (1 << 20) + 100]])
    src = np.concatenate([rows * 8192, [5, 70000, 3]])
    n = np.concatenate([np.full(64, 2048), [100, 100, 100]])
    dst = np.concatenate([dst, (2 << 20) + np.arange(4) * 512]).astype(np.int64)
    src = np.concatenate([src, (3 << 20) + np.arange(4) * 512]).astype(np.int64)
    n = np.concatenate([n, np.full(4, 512)]).astype(np.int64)
    assert strided_runs(dst, src, n) == [(0, 64, 2048, 8192), (67, 4, 512, 512)]
    # rows that would overlap (pitch below the width) or run backwards are never a run
    assert strided_runs(np.arange(8) * 100, np.arange(8) * 4096, np.full(8, 200)) == []
    assert strided_runs(np.arange(8)[::-1] * 4096, np.arange(8) * 4096, np.full(8, 64)) == []


def test_the_2d_copy_descriptor_has_the_drivers_layout() -> None:
    import ctypes

    from transports.cuda import _Memcpy2D

    # CUDA_MEMCPY2D on x86-64 (cuda.h): 16 fields, 128 bytes.
    assert ctypes.sizeof(_Memcpy2D) == 128
    offsets = {name: getattr(_Memcpy2D, name).offset for name, _ in _Memcpy2D._fields_}
    assert (offsets["srcDevice"], offsets["srcPitch"], offsets["dstMemoryType"]) == (32, 48, 72)
    assert (offsets["dstDevice"], offsets["WidthInBytes"], offsets["Height"]) == (88, 112, 120)


def test_a_batchs_region_pairs_are_those_of_a_row_wise_unique_for_any_ids() -> None:
    from transports.memory import _region_pairs

    rng = np.random.default_rng(3)
    for lo, hi in ((0, 4), (5, 10_000), (-3, 3), (0, 1)):
        dst = rng.integers(lo, hi, 4096).astype(np.int64)
        src = rng.integers(lo, hi, 4096).astype(np.int64)
        pairs, inverse = _region_pairs(dst, src)
        want, where = np.unique(np.stack([dst, src], axis=1), axis=0, return_inverse=True)
        assert np.array_equal(pairs, want) and np.array_equal(inverse, where.reshape(-1))
    big = np.array([1 << 40, 0], np.int64)
    pairs, inverse = _region_pairs(big, big[::-1].copy())
    assert pairs.tolist() == [[0, 1 << 40], [1 << 40, 0]] and inverse.tolist() == [1, 0]
