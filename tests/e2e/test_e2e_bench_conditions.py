"""The conditions `refitd bench refit` prints beside its ratios: page-fault counts
and a memcpy baseline on the memory kind a refit copies."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from refitd.bench.conditions import SegmentMemcpy, faults


def test_touching_fresh_pages_counts_one_minor_fault_per_page() -> None:
    pages = 256
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as fresh:
        before = faults()
        for i in range(pages):
            fresh[i * mmap.PAGESIZE] = 1
        taken = faults() - before
    assert taken.minor >= pages
    assert faults(os.getpid()).minor >= before.minor + pages


def test_a_process_that_is_gone_has_no_faults() -> None:
    assert faults(2**22 + 1).minor == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_segment_memcpy_copies_every_byte_and_reports_bandwidth(threads: int) -> None:
    """On any number of threads (each its own share, the last share the odd bytes'),
    every byte of the segment is copied."""
    with SegmentMemcpy((1 << 20) + 7, threads=threads) as m:
        m._dst.numpy()[:] = 0
        assert m.gbps(3 << 20) > 0
        assert np.array_equal(m._dst.numpy(), m._src.numpy())
