"""The CUDA engine's driver calls in this process: registrations, bounces, contexts, lanes.

What tests/transports/test_transport_device_pins.py checks on the CPU's device
model, checked here against the real driver: a registration goes with its mapping,
a range registered outside the pin table is bounced, a shrunk segment fails one
copy by name, the cap bounces the rest, driver calls leave a caller's context as
it was, and batches of two event loops share one engine. The engine copies
between this process's own GPU memory (``DeviceAllocation``) and shared segments;
no daemon (tests/gpu/test_gpu_regions.py covers the daemon's path).

Every test needs a CUDA device and skips, naming why, without one.
NOTE: written without a GPU; their first run is tests/gpu/run-on-device.sh.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from transports.local import CopyFault
from transports.pins import PINS, page_span
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(300)

N = 32 << 20  # four bounce loads


@pytest.fixture
def engine(gpu: None) -> Iterator[Any]:
    from transports.cuda import CudaEngine

    cap = PINS.cap
    yield CudaEngine.for_device(0)
    PINS.limit(cap)


@pytest.fixture
def device(gpu: None) -> Iterator[Any]:
    from transports.cuda import DeviceAllocation

    yield DeviceAllocation(0, N)


def _fill(seg: SharedSegment, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, seg.size, dtype=np.uint8)
    seg.numpy()[:] = data
    return data


def _read(device: Any, nbytes: int) -> np.ndarray:
    import torch

    flat = torch.as_tensor(device, device="cuda:0")
    return flat[:nbytes].cpu().numpy()


def _copy(engine: Any, dst: int, src: int, nbytes: int, host: list[SharedSegment]) -> None:
    one = (np.array([x], np.int64) for x in (dst, src, nbytes))
    asyncio.run(engine.copy(*one, host))


def test_a_segment_closed_after_a_gpu_copy_leaves_no_registration_behind(
    engine: Any, device: Any
) -> None:
    seg = SharedSegment.create(N, "first")
    data = _fill(seg, 1)
    _copy(engine, device.pointer, seg.address, N, [seg])
    address = seg.address
    assert address in PINS.pinned()
    assert np.array_equal(_read(device, N), data)
    seg.close()
    assert address not in PINS.pinned()
    # A new mapping (at that address or not) is registered for itself and copies its
    # own bytes, never the pages of the one before.
    again = SharedSegment.create(N, "second")
    try:
        fresh = _fill(again, 2)
        _copy(engine, device.pointer, again.address, N, [again])
        assert np.array_equal(_read(device, N), fresh)
    finally:
        again.close()


def test_a_range_registered_outside_the_pin_table_is_bounced_and_lands_exact(
    engine: Any, device: Any
) -> None:
    import torch

    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    with SharedSegment.create(N, "foreign") as seg:
        data = _fill(seg, 3)
        assert int(cudart.cudaHostRegister(seg.address, page_span(N), 0)) == 0
        try:
            bounced = engine.bounced_bytes
            _copy(engine, device.pointer, seg.address, N, [seg])
            assert seg.address not in PINS.pinned(), "712 was taken as the table's pin"
            assert engine.bounced_bytes == bounced + N
            assert np.array_equal(_read(device, N), data)
        finally:
            assert int(cudart.cudaHostUnregister(seg.address)) == 0
        _copy(engine, device.pointer, seg.address, N, [seg])  # asked again: taken now
        assert seg.address in PINS.pinned()


def test_a_segment_shrunk_under_its_mapping_fails_the_copy_by_name_and_the_process_lives(
    engine: Any, device: Any
) -> None:
    with SharedSegment.create(N, "shrunk") as seg:
        os.truncate(SHM_DIR / seg.name, 4096)
        with pytest.raises(CopyFault, match="source"):
            _copy(engine, device.pointer, seg.address, N, [seg])
        assert seg.address not in PINS.pinned()
        assert PINS.why_not(seg.address)
        with pytest.raises(CopyFault, match="destination"):
            _copy(engine, seg.address, device.pointer, N, [seg])
    with SharedSegment.create(4096, "after") as ok:  # the engine goes on
        data = _fill(ok, 4)
        _copy(engine, device.pointer, ok.address, 4096, [ok])
        assert np.array_equal(_read(device, 4096), data)


def test_past_the_cap_both_directions_bounce_at_the_right_bytes(engine: Any, device: Any) -> None:
    PINS.limit(PINS.pinned_bytes)  # nothing more may be locked
    with SharedSegment.create(N, "in") as src, SharedSegment.create(N, "out") as dst:
        data = _fill(src, 5)
        bounced = engine.bounced_bytes
        _copy(engine, device.pointer, src.address, N, [src])
        _copy(engine, dst.address, device.pointer, N, [dst])
        assert src.address not in PINS.pinned() and dst.address not in PINS.pinned()
        assert engine.bounced_bytes == bounced + 2 * N
        assert np.array_equal(dst.numpy(), data)


def test_driver_calls_leave_a_callers_thread_with_the_context_it_had(gpu: None) -> None:
    import torch

    from transports.cuda import DeviceAllocation, export_allocation
    from transports.cudadriver import driver

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    found: list[int] = []

    def bare_thread() -> None:  # a thread with no context: a trainer's, the collector's
        before = driver().current_context()
        export_allocation(t.data_ptr(), 0)
        a = DeviceAllocation(0, 4096)
        del a
        found.extend([before, driver().current_context()])

    th = threading.Thread(target=bare_thread)
    th.start()
    th.join(60)
    assert found == [0, 0], "a driver call left a context current in the caller's thread"
    mine = driver().current_context()  # PyTorch's, made current by the tensor above
    export_allocation(t.data_ptr())
    assert driver().current_context() == mine


def test_export_names_the_tensors_device_and_refuses_another(gpu: None) -> None:
    import torch

    from transports.cuda import CudaError, export_allocation
    from transports.cudadriver import device_count

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    assert export_allocation(t.data_ptr(), 0).ordinal == 0
    if device_count() < 2:
        pytest.skip("one GPU here: the refusal of another device needs two")
    with pytest.raises(CudaError, match="not on GPU 1"):
        export_allocation(t.data_ptr(), 1)


def test_batches_of_two_event_loops_share_one_gpu_engine(engine: Any, device: Any) -> None:
    segs = [SharedSegment.create(N // 2, f"loop{i}") for i in range(2)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for k in range(4):
                piece = N // 8
                _copy(
                    engine,
                    device.pointer + i * (N // 2) + k * piece,
                    segs[i].address + k * piece,
                    piece,
                    [segs[i]],
                )
        except BaseException as exc:
            errors.append(exc)

    try:
        datas = [_fill(s, 10 + i) for i, s in enumerate(segs)]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors
        assert np.array_equal(_read(device, N), np.concatenate(datas))
    finally:
        for s in segs:
            s.close()


@pytest.mark.parametrize("batched", [True, False])
def test_shuffled_small_pieces_land_exact_through_either_copy_path(
    engine: Any, device: Any, batched: bool
) -> None:
    from transports.cudadriver import driver

    if batched and driver().batch_copy() is None:
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
    engine.batched = batched
    try:
        n = N // 2 // 4096
        perm = np.random.default_rng(21).permutation(n).astype(np.int64)
        with SharedSegment.create(N // 2, "pieces") as seg:
            data = _fill(seg, 22)
            # host -> GPU (first half), then GPU -> GPU (into the second half)
            lo, hi = device.pointer, device.pointer + N // 2
            size = np.full(n, 4096, np.int64)
            asyncio.run(
                engine.copy(lo + perm * 4096, seg.address + np.arange(n) * 4096, size, [seg])
            )
            asyncio.run(engine.copy(hi + np.arange(n) * 4096, lo + perm * 4096, size, []))
        got = _read(device, N)
        assert np.array_equal(got[: N // 2].reshape(n, 4096)[perm], data.reshape(n, 4096))
        assert np.array_equal(got[N // 2 :], data)
    finally:
        engine.batched = True
