"""What the CUDA engine decides before it calls the driver, checked without a GPU.

`transports.cudacopies` and the size rule of `transports.cuda` are pure: which reads
one indexed gather may copy, which reads lie in which device's allocations, and
what an opened allocation may be registered as. The driver calls around them are
tests/gpu's (their first run is tests/gpu/run-on-device.sh).
"""

from __future__ import annotations

import numpy as np
import pytest

from refitd.errors import ProtocolError
from transports.cuda import check_opened_size
from transports.cudacopies import gather_mask, on_one_device

MiB = 1 << 20
MINE = [(0x7000_0000_0000, 64 * MiB), (0x7000_1000_0000, 64 * MiB)]  # two allocations here
THEIRS = (0x7100_0000_0000, 64 * MiB)  # an allocation of another device


def _reads(pairs: list[tuple[int, int]], n: int = 4096) -> tuple[np.ndarray, ...]:
    dst = np.array([d for d, _ in pairs], np.int64)
    src = np.array([s for _, s in pairs], np.int64)
    return dst, src, np.full(len(pairs), n, np.int64)


def test_small_reads_between_this_devices_allocations_are_gathered_together() -> None:
    a, b = MINE[0][0], MINE[1][0]
    dst, src, n = _reads([(a, b), (a + 4096, b + 8192), (b + 65536, a + 12288)])
    assert gather_mask(dst, src, n, np.ones(3, bool), MINE).all()


def test_a_read_reaching_another_devices_memory_is_never_in_the_gather() -> None:
    a, b, other = MINE[0][0], MINE[1][0], THEIRS[0]
    dst, src, n = _reads([(a, b), (a + 4096, other), (other + 4096, b), (a + 8192, b + 4096)])
    small = gather_mask(dst, src, n, np.ones(4, bool), MINE)
    assert small.tolist() == [True, False, False, True]


def test_host_memory_and_reads_past_an_allocations_end_are_never_in_the_gather() -> None:
    a, b = MINE[0][0], MINE[1][0]
    end = a + 64 * MiB - 2048  # its last 2 KiB and 2 KiB past it
    host = 0x5555_0000_0000
    dst, src, n = _reads([(a, b), (a + 4096, host), (end, b + 4096), (a + 8192, b + 8192)])
    assert gather_mask(dst, src, n, np.ones(4, bool), MINE).tolist() == [True, False, False, True]


def test_a_lone_small_read_large_reads_and_unaligned_ones_are_copied_on_their_own() -> None:
    a, b = MINE[0][0], MINE[1][0]
    dst, src, n = _reads([(a, b), (a + 4096, b + 4096)])
    assert not gather_mask(dst, src, n, np.array([True, False]), MINE).any()  # one is left
    big = np.array([4096, 128 << 10], np.int64)
    assert not gather_mask(dst, src, big, np.ones(2, bool), MINE).any()
    dst[1] += 4
    assert not gather_mask(dst, src, n, np.ones(2, bool), MINE).any()


def test_reads_are_placed_in_the_allocation_that_holds_them_whole() -> None:
    a = MINE[0][0]
    addresses = np.array([a, a + 64 * MiB - 8, a + 64 * MiB, a - 8, MINE[1][0]], np.int64)
    got = on_one_device(addresses, np.full(5, 8, np.int64), MINE)
    assert got.tolist() == [True, True, False, False, True]
    assert not on_one_device(addresses, np.full(5, 8, np.int64), []).any()


def test_an_opened_allocation_rounded_up_by_the_driver_is_the_region_stated() -> None:
    check_opened_size(2 * MiB, 2 * MiB)
    check_opened_size(2 * MiB, 2 * MiB - 512)  # the importer sees it rounded to 2 MiB


def test_an_opened_allocation_smaller_than_stated_is_refused_naming_both_sizes() -> None:
    with pytest.raises(ProtocolError, match=r"holds 4096 bytes, fewer than the 8192 stated"):
        check_opened_size(4096, 8192)


def test_the_batched_copy_attributes_have_the_drivers_layout() -> None:
    import ctypes

    from transports.cudacopies import MemcpyAttributes

    # CUmemcpyAttributes (cuda.h, 12.8+): an enum, two CUmemLocation {type, id}, flags.
    assert ctypes.sizeof(MemcpyAttributes) == 24
    offsets = {
        name: getattr(MemcpyAttributes, name).offset for name, _ in MemcpyAttributes._fields_
    }
    assert (offsets["srcLocHintType"], offsets["dstLocHintType"], offsets["flags"]) == (4, 12, 20)
