"""``merge_ranges``: the one range merge (suspect ranges, a lease's readable extents,
a receiver's staged bytes), checked against the bytes the ranges cover."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.daemon.access.trust import merge_extents
from transports.batch import merge_ranges
from transports.interface import ByteRange

_range = st.tuples(st.integers(0, 3), st.integers(0, 200), st.integers(-5, 60))


@settings(max_examples=300, deadline=None)
@given(st.lists(_range, max_size=30))
def test_merged_ranges_cover_exactly_the_bytes_of_the_input_and_never_touch(
    ranges: list[tuple[int, int, int]],
) -> None:
    region, offset, nbytes = (np.array([r[i] for r in ranges], np.int64) for i in range(3))
    merged = merge_ranges(region, offset, nbytes)
    covered = {(r, b) for r, o, n in ranges for b in range(o, o + n)}
    assert {(m.region, b) for m in merged for b in range(m.offset, m.offset + m.nbytes)} == covered
    assert all(m.nbytes > 0 for m in merged)
    keys = [(m.region, m.offset) for m in merged]
    assert keys == sorted(keys)
    for a, b in itertools.pairwise(merged):
        # sorted and apart: a range that touched its neighbour would have joined it
        assert a.region != b.region or a.offset + a.nbytes < b.offset


def test_touching_ranges_join_and_empty_ones_vanish() -> None:
    got = merge_ranges([1, 1, 1, 0, 2], [10, 0, 5, 0, 7], [5, 5, 5, 3, 0])
    assert got == [ByteRange(0, 0, 3), ByteRange(1, 0, 15)]
    assert merge_ranges([], [], []) == []


def test_a_leases_extents_are_the_merged_ranges_as_start_end_pairs() -> None:
    assert merge_extents([(7, 0, 4), (7, 4, 9), (7, 20, 30), (3, 5, 5), (2, 8, 1)]) == {
        7: [(0, 9), (20, 30)]
    }
