"""``merge_ranges``: the one range merge (suspect ranges, a lease's readable extents,
a receiver's staged bytes), checked against the bytes the ranges cover; and
``within``: the one range containment, checked against exact arithmetic and held by
every bound that asks it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refitd.daemon.access.trust import merge_extents
from refitd.daemon.mirror.digest import digest_rows
from refitd.daemon.state.manifestcheck import check_manifest_bounds
from refitd.delta.compare import Table, check_bounds
from refitd.errors import ConflictError, ProtocolError
from refitd.wire import ManifestIn, ShardEntry, TensorEntry
from transports.batch import (
    merge_ranges,
    rows_as_batch,
    spans_of,
    validate_batch,
    within,
    within_spans,
)
from transports.interface import AdvertisedRegion, ByteRange, PeerInfo
from transports.segments import SharedSegment
from transports.tcp.frames import Grant, check_scope

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


# ---------------------------------------------------------------- containment

_I64 = st.integers(-(2**63), 2**63 - 1)


def _inside(offset: int, nbytes: int, size: int) -> bool:
    """The rule in exact arithmetic: the reference the one function is held to."""
    return offset >= 0 and nbytes >= 0 and offset + nbytes <= size


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(_I64, _I64, _I64), min_size=1, max_size=20))
@example([(0, 1, -(2**63)), (0, 2**63 - 1, -(2**63)), (0, 0, -1)])  # size - nbytes wraps
def test_within_is_exact_containment_with_no_int64_overflow(
    ranges: list[tuple[int, int, int]],
) -> None:
    o, n, s = (np.array([r[i] for r in ranges], np.int64) for i in range(3))
    assert within(o, n, s).tolist() == [_inside(*r) for r in ranges]
    assert [within(*r) for r in ranges] == [_inside(*r) for r in ranges]


_extent = st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1))


@settings(max_examples=500, deadline=None)
@given(
    st.lists(_extent.map(lambda e: (min(e), max(e))), max_size=8),
    st.lists(st.tuples(_I64, _I64), min_size=1, max_size=20),
)
def test_within_spans_is_exact_containment_in_one_of_the_spans_with_no_int64_overflow(
    extents: list[tuple[int, int]], ranges: list[tuple[int, int]]
) -> None:
    """A range lies in a region's readable spans iff one span holds it whole, in exact
    arithmetic; the span named is the last starting at or before the range."""
    starts, ends = spans_of(extents)
    spans = list(zip(starts.tolist(), ends.tolist(), strict=True))
    o, n = (np.array([r[i] for r in ranges], np.int64) for i in range(2))
    k, inside = within_spans(o, n, starts, ends)
    assert inside.tolist() == [
        any(s <= off and _inside(off, nb, e) for s, e in spans) for off, nb in ranges
    ]
    assert k.tolist() == [
        max((i for i, (s, _) in enumerate(spans) if s <= off), default=-1) for off, _ in ranges
    ]
    # the spans are non-empty, sorted and apart
    assert all(a < b for a, b in spans)
    assert all(b < c for (_, b), (c, _) in itertools.pairwise(spans))


SIZE = 8
CASES = [
    (0, 0), (0, SIZE), (SIZE, 0), (SIZE - 1, 1),  # inside, to the very end
    (SIZE - 1, 2), (SIZE + 1, 0), (0, SIZE + 1), (-1, 1),  # one byte out
    (2**62, 2**62),  # whose end overflows int64
]  # fmt: skip


def _batch_remote(offset: int, nbytes: int) -> None:
    # wire rows: (source region, offset, destination region, offset, nbytes)
    batch = rows_as_batch(np.array([[1, offset, 2, 0, nbytes]], np.int64))
    validate_batch(batch, {2: 2**62}, {1: SIZE})


def _batch_local(offset: int, nbytes: int) -> None:
    batch = rows_as_batch(np.array([[1, 0, 2, offset, nbytes]], np.int64))
    validate_batch(batch, {2: SIZE}, {1: 2**62})


def _digest_row(offset: int, nbytes: int) -> None:
    digest_rows({1: memoryview(bytearray(SIZE))}, np.array([[1, offset, nbytes]], np.int64))


def _manifest_shard(offset: int, nbytes: int) -> None:
    shard = ShardEntry((0,), (nbytes,), 1, offset)
    tensor = TensorEntry("w", (nbytes,), "uint8", [shard])
    check_manifest_bounds(ManifestIn("m", 1, 0, 1, [tensor]), {1: SIZE})


def _segment_view(offset: int, nbytes: int) -> None:
    with SharedSegment.create(SIZE, "ranges") as seg:
        seg.numpy(np.uint8, offset, nbytes)


def _tcp_grant(offset: int, nbytes: int) -> None:
    # a grant of the whole region (one span), as the tcp data server checks a read
    record = PeerInfo("tcp", "src", b"", (AdvertisedRegion(1, 3, 0, SIZE),))
    one = np.array([1], np.int64), np.array([offset], np.int64), np.array([nbytes], np.int64)
    if check_scope(Grant(record), *one, {1: 3}, {1: SIZE}) is not None:
        raise ProtocolError("outside the grant")


def _delta_block(offset: int, nbytes: int) -> None:
    table = Table([("w", (0,), (nbytes,), "uint8")], *(np.array([v], np.int64) for v in
                  (1, offset, nbytes)), frozenset({1}), np.zeros(1, np.int64))  # fmt: skip
    try:
        check_bounds(table, {1: SIZE}, "compare")
    except ConflictError as exc:
        raise ProtocolError(str(exc)) from exc


@pytest.mark.parametrize(
    "check",
    [
        _batch_remote,
        _batch_local,
        _digest_row,
        _manifest_shard,
        _segment_view,
        _tcp_grant,
        _delta_block,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
@pytest.mark.parametrize(("offset", "nbytes"), CASES)
def test_every_bound_refuses_exactly_the_ranges_outside_their_region(
    check: Callable[[int, int], None], offset: int, nbytes: int
) -> None:
    """A read's two sides, a digest row, a published shard, a segment view, a read the
    tcp data server checks against its grant and a block a delta compares: each
    refuses a range iff it leaves its region (:func:`transports.batch.within`)."""
    if _inside(offset, nbytes, SIZE):
        check(offset, nbytes)
    else:
        with pytest.raises(ProtocolError):
            check(offset, nbytes)
