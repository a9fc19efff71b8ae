"""GPU expert slots (``CudaSlotMemory``): their copies' order against every reader, and pageable rows.

Every test needs a CUDA device and skips, naming why, without one (the ``gpu``
fixture); unlike tests/gpu/test_offload_gpu.py they need no transformers.
NOTE: written without a GPU; their first run is tests/gpu/run-on-device.sh.
"""

from __future__ import annotations

import pytest

from refitd.experts import SlotGeometry
from refitd.experts.residency import CopyRoute

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("gpu")]

ROW = 4 << 20


def test_a_slot_copy_waits_for_a_declared_side_stream_still_reading_the_slot() -> None:
    import torch

    from refitd.experts.cuda import CudaSlotMemory

    device = CudaSlotMemory(SlotGeometry(1, 2, (ROW,)))
    old = torch.full((ROW,), 3, dtype=torch.uint8).pin_memory()
    device.begin_plan(CopyRoute.INDEXED)
    device.write_slot(0, 1, memoryview(old.numpy()))
    device.flush()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    device.read_on(side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued first
        seen = device.bank(0)[1].clone()  # a kernel on the side stream reads the slot
    new = torch.full((ROW,), 9, dtype=torch.uint8).pin_memory()
    device.begin_plan(CopyRoute.INDEXED)
    device.write_slot(0, 1, memoryview(new.numpy()))
    device.flush()
    side.synchronize()
    assert (seen.cpu() == 3).all(), "the copy overwrote a slot a side stream still read"
    assert (device.bank(0)[1].cpu() == 9).all()


def test_a_pageable_row_is_copied_page_locked_and_counted() -> None:
    import torch

    from refitd.experts.cuda import CudaSlotMemory

    device = CudaSlotMemory(SlotGeometry(1, 2, (ROW,)))
    row = bytearray(b"\x05" * ROW)  # pageable host memory
    device.begin_plan(CopyRoute.INDEXED)
    device.write_slot(0, 0, row)
    device.flush()
    assert device.pageable_rows == 1
    assert (device.bank(0)[0].cpu() == 5).all()
    pinned = torch.full((ROW,), 6, dtype=torch.uint8).pin_memory()
    device.begin_plan(CopyRoute.INDEXED)
    device.write_slot(0, 1, memoryview(pinned.numpy()))
    device.flush()
    assert device.pageable_rows == 1, "a page-locked row was staged again"
