"""Host memory a device copies: registered per mapping, bounced where it is not, fenced always.

The ``hostdev`` engine (tests/support/devices.py) is a `transports.devcopy` engine
as CUDA's is, over a driver model that keeps the process's registrations as CUDA
does, queues copies until a stream is synchronised, and refuses a host address it
holds no registration of (where libcuda would copy it pageable and unguarded). So
the rules the GPU path lives by run here: real transports, real shared segments,
the real pin table (`transports.pins`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from support.devices import DRIVER, HostDeviceEngine, HostDeviceMemory

from transports import checks
from transports.checks import LOCAL, REMOTE, open_pair
from transports.devcopy import bounce_chunks
from transports.interface import PullFailed
from transports.pins import PINS, PinTable, page_span
from transports.segments import SHM_DIR, SharedSegment
from transports.shm import ShmTransport

pytestmark = pytest.mark.timeout(120)

SECRET = b"pins-secret-0123456789abcdef"
N = 1 << 20


@pytest.fixture
def cap() -> Iterator[PinTable]:
    """The process's pin table, its cap restored after the test."""
    before = PINS.cap
    yield PINS
    PINS.limit(before)


def _host(n: int, label: str) -> SharedSegment:
    return SharedSegment.create(n, label)


async def test_a_peer_segment_shm_unmaps_loses_its_registration_with_its_mapping() -> None:
    engine = HostDeviceEngine()
    async with open_pair(
        "shm",
        N,
        N,
        SECRET,
        local_memory=lambda n, _: HostDeviceMemory(n, engine),
        remote_memory=_host,
        max_mappings=0,
    ) as pair:
        assert isinstance(pair.puller, ShmTransport)
        batch = checks.shuffled_batch(16, 4096)
        await pair.peer.get(batch)
        checks.expect(pair, batch)
        (mapped,) = engine.pinned  # the puller's own mapping of the peer's segment
        assert mapped != pair.remote.address
        assert mapped in PINS.pinned() and mapped in DRIVER.registered
        await pair.peer.close()  # unused past max_mappings=0: unmapped now
        assert pair.puller.mapped == 0
        assert mapped not in PINS.pinned(), "the table kept a registration its mapping outlived"
        assert mapped not in DRIVER.registered, "the driver still holds the unmapped pages"


async def test_a_range_the_driver_holds_already_is_refused_then_asked_again() -> None:
    engine = HostDeviceEngine()
    async with ShmTransport(secret=SECRET) as shm:
        dev = HostDeviceMemory(N, engine)
        with SharedSegment.create(N, "host") as host:
            address = host.address
            host.numpy()[:] = np.random.default_rng(3).integers(0, 256, N, dtype=np.uint8)
            await shm.register(1, dev)
            await shm.register(2, host)
            # A registration not the table's (one that outlived an earlier mapping at
            # this address, or another library's): the driver answers 712.
            DRIVER.registered[host.address] = page_span(N)
            foreign = PINS.counts.foreign
            loop = shm.loopback()
            await loop.get([(1, 0, 2, 0, N // 2)])
            assert host.address not in PINS.pinned(), "712 was taken as this mapping's pin"
            assert PINS.counts.foreign == foreign + 1
            assert engine.bounced_bytes == N // 2, "the refused memory was not bounced"
            del DRIVER.registered[host.address]  # its holder let it go: asked again, taken
            await loop.get([(1, N // 2, 2, N // 2, N // 2)])
            assert host.address in PINS.pinned()
            assert engine.bounced_bytes == N // 2
            assert dev.read(0, N) == host.numpy().tobytes()
        assert address not in PINS.pinned() and address not in DRIVER.registered
        dev.close()


@pytest.mark.parametrize("side", ["source", "destination"])
async def test_a_segment_shrunk_under_its_mapping_fails_one_read_and_never_reaches_the_driver(
    side: str,
) -> None:
    engine = HostDeviceEngine()
    async with ShmTransport(secret=SECRET) as shm:
        dev = HostDeviceMemory(N, engine)
        with SharedSegment.create(N, "shrunk") as host:
            await shm.register(1, dev)
            await shm.register(2, host)
            os.truncate(SHM_DIR / host.name, 4096)  # its owner may do this at any time
            read = (1, 0, 2, 0, N) if side == "source" else (2, 0, 1, 0, N)
            with pytest.raises(PullFailed, match=f"{side} region 2 faulted under the copy"):
                await shm.loopback().get([read])
            assert host.address not in PINS.pinned()
            assert "INVALID_VALUE" in (PINS.why_not(host.address) or "")
            assert engine.pending == 0
            # The process, the transport and the engine go on.
            dev.write(0, b"\x07" * 4096)
            await shm.loopback().get([(2, 0, 1, 0, 4096)] if side == "destination" else [])
        dev.close()


async def test_host_memory_past_the_pinned_cap_is_bounced_never_locked(cap: PinTable) -> None:
    engine = HostDeviceEngine(bounce_bytes=64 << 10)  # a 1 MiB read spans 16 loads
    cap.limit(cap.pinned_bytes + N // 2)
    over = cap.counts.over_cap
    async with open_pair(
        "local",
        N,
        N,
        SECRET,
        local_memory=lambda n, _: HostDeviceMemory(n, engine),
        remote_memory=_host,
    ) as pair:
        batch = np.array([(LOCAL, 0, REMOTE, 0, N)], checks.READ_DTYPE)
        await pair.peer.get(batch)
        checks.expect(pair, batch)
        assert pair.remote.address not in cap.pinned()
        assert cap.counts.over_cap == over + 1
        assert engine.bounced_bytes == N and engine.pinned == []
        cap.limit(None)  # room again: the next batch registers it
        await pair.peer.get(batch)
        assert pair.remote.address in cap.pinned()


async def test_a_failed_batch_returns_only_once_nothing_of_it_runs_on_the_device() -> None:
    engine = HostDeviceEngine()
    async with open_pair(
        "local",
        N,
        N,
        SECRET,
        local_memory=lambda n, _: HostDeviceMemory(n, engine),
        remote_memory=_host,
    ) as pair:
        batch = checks.shuffled_batch(16, 4096)
        engine.fail_next(at_read=5)
        with pytest.raises(PullFailed, match="HOSTDEV_ERROR_LAUNCH_FAILED"):
            await pair.peer.get(batch)
        assert engine.pending == 0, "copies of the failed batch still ran after it returned"
        assert engine.reads == 5, "the reads issued before the failure did not land"


def test_one_engine_serves_batches_of_two_event_loops_at_once() -> None:
    engine = HostDeviceEngine(lanes=2)
    dev = HostDeviceMemory(2 * N, engine)
    segs = [SharedSegment.create(N, f"loop{i}") for i in range(2)]
    errors: list[BaseException] = []

    async def run(i: int) -> None:
        seg = segs[i]
        seg.numpy()[:] = i + 1
        for k in range(8):
            at = np.array([dev.address + i * N + k * (N // 8)], np.int64)
            src = np.array([seg.address + k * (N // 8)], np.int64)
            await engine.copy(at, src, np.array([N // 8], np.int64), [seg])

    def thread(i: int) -> None:
        try:
            asyncio.run(run(i))
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert dev.read(0, N) == b"\x01" * N and dev.read(N, N) == b"\x02" * N
        assert len(engine.streams) <= 2
    finally:
        for s in segs:
            s.close()
        dev.close()


@pytest.mark.parametrize("lanes", [1, 2])
async def test_batches_overlap_on_the_engines_lanes_each_fenced_on_its_own(lanes: int) -> None:
    engine = HostDeviceEngine(lanes=lanes)
    dev = HostDeviceMemory(2 * N, engine)
    try:
        with SharedSegment.create(N, "src") as seg:
            seg.numpy()[:] = 4
            gate = engine.hold()  # the device is busy: no fence completes yet

            def batch(i: int) -> asyncio.Task[None]:
                one = [np.array([x], np.int64) for x in (dev.address + i * N, seg.address, N)]
                return asyncio.ensure_future(engine.copy(*one, [seg]))

            first, second = batch(0), batch(1)
            assert await asyncio.to_thread(engine.wait_held, lanes), "no batch reached its fence"
            # Both batches in flight at once with two lanes; the second waits for a
            # lane with one (where CUDA's engine ran one batch per device at a time).
            assert engine.waiting == lanes and len(engine.streams) == lanes
            gate.set()
            await asyncio.gather(first, second)
            assert dev.read(0, 2 * N) == b"\x04" * (2 * N)
    finally:
        dev.close()


@pytest.mark.parametrize(
    ("capacity", "longest"), [(1, 50), (7, 2000), (4096, 20000), (1 << 20, 20000)]
)
def test_bounce_loads_cover_every_byte_once_within_the_buffer(capacity: int, longest: int) -> None:
    nbytes = np.random.default_rng(capacity).integers(0, longest, 40).astype(np.int64)
    seen = np.zeros(int(nbytes.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    for load in bounce_chunks(nbytes, capacity):
        assert int(load[:, 2].sum()) <= capacity
        assert (load[:, 3] + load[:, 2] <= capacity).all()
        for read, off, n, _ in load.tolist():
            seen[starts[read] + off : starts[read] + off + n] += 1
    assert (seen == 1).all()
