"""Which reads of a mirror still filling are complete (:mod:`refitd.daemon.mirror.hold`).

The table asks the one range rule (``transports.batch.within_spans``): a read is
complete iff it lies in a gap between the chunks still filling. That is exactly "it
shares no byte with a chunk still filling" (a zero-byte read: lies strictly inside
none), checked here in exact arithmetic against chunk layouts and reads up to the
int64 edge.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.wire import MemoryKind, RegionInfo

INT64_MAX = 2**63 - 1
LOCAL = 7


def _filling(chunks: list[tuple[int, int, bool]]) -> FillingMirrors:
    """A table with one mirror over local region 7 (source region 3), cut into
    ``chunks``: ``(offset, nbytes, complete)``."""
    m = Mirror("http://source", "m", 1)
    m.regions = {3: RegionInfo(LOCAL, MemoryKind.HOST, "", INT64_MAX, 0)}
    m.chunks = np.array([(3, o, n) for o, n, _ in chunks], dtype=np.int64).reshape(-1, 3)
    m.done = np.array([d for _, _, d in chunks], dtype=bool)
    table = FillingMirrors()
    table.add(m)
    return table


def _touches(chunks: list[tuple[int, int, bool]], offset: int, nbytes: int) -> bool:
    """Whether ``[offset, offset + nbytes)`` shares a byte with a chunk still filling
    (a zero-byte read: lies strictly inside one), in exact arithmetic."""
    return any(not d and o + n > offset and o < offset + nbytes for o, n, d in chunks)


@st.composite
def _layouts(draw: st.DrawFn) -> list[tuple[int, int, bool]]:
    """Disjoint chunks in offset order, apart or touching, some complete."""
    out, at = [], draw(st.integers(0, 2**20))
    for gap, size, done in draw(
        st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 2**20), st.booleans()))
    ):
        out.append((at + gap, size, done))
        at += gap + size
    return out


_AT = st.one_of(st.integers(0, 2**23), st.integers(0, INT64_MAX))


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.lists(st.tuples(_AT, _AT), min_size=1, max_size=8))
def test_a_read_is_complete_iff_it_shares_no_byte_with_a_chunk_still_filling(
    chunks: list[tuple[int, int, bool]], reads: list[tuple[int, int]]
) -> None:
    reads = [(o, n) for o, n in reads if o + n <= INT64_MAX]  # a read ends in int64
    table = _filling(chunks)
    for o, n in reads:
        one = table.why_held(*(np.array([v], np.int64) for v in (LOCAL, o, n)))
        assert one == ("" if _touches(chunks, o, n) else None), (o, n)
    if reads:
        region = np.full(len(reads), LOCAL, np.int64)
        offset, nbytes = (np.array([r[i] for r in reads], np.int64) for i in range(2))
        many = table.why_held(region, offset, nbytes)
        assert many == ("" if any(_touches(chunks, o, n) for o, n in reads) else None)


def test_a_read_at_a_negative_offset_or_of_a_negative_size_is_never_complete() -> None:
    table = _filling([(0, 64, True)])  # every chunk complete
    for o, n in [(-1, 1), (0, -1), (-(2**63), 0), (INT64_MAX, 1)]:
        assert table.why_held(*(np.array([v], np.int64) for v in (LOCAL, o, n))) == ""
    assert table.why_held(*(np.array([v], np.int64) for v in (LOCAL, 0, 64))) is None
