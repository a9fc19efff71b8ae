"""How a mirror cuts a version into chunks, and an engine's reads at their edges: pure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.daemon.mirror.chunks import (
    CHUNK_BYTES,
    CHUNKS_PER_VERSION,
    MAX_CHUNK_BYTES,
    chunk_bytes,
    chunk_count,
    chunk_reads,
    cut_chunks,
)
from refitd.errors import ProtocolError

MIB = 1 << 20


@pytest.mark.parametrize("total", [1, 8 * MIB, 64 * MIB, 1 << 30, 1 << 40])
def test_a_chunk_is_about_a_sixty_fourth_of_the_version_within_its_bounds(total: int) -> None:
    c = chunk_bytes(total)
    assert CHUNK_BYTES <= c <= MAX_CHUNK_BYTES
    assert c & (c - 1) == 0  # a power of two
    if CHUNK_BYTES * CHUNKS_PER_VERSION <= total <= MAX_CHUNK_BYTES * CHUNKS_PER_VERSION:
        assert CHUNKS_PER_VERSION <= -(-total // c) < 2 * CHUNKS_PER_VERSION


def test_reads_are_cut_at_chunk_edges_in_fill_order_and_land_where_they_would() -> None:
    chunks = cut_chunks({7: [(0, 5 * MIB)], 9: [(MIB, 3 * MIB)]}, MIB)
    rows = np.array(
        [
            [9, MIB + 10, 1, 0, 2 * MIB - 20],  # across region 9's two chunks
            [7, 512 << 10, 1, 4 * MIB, 3 * MIB],  # across four chunks of region 7
            [7, 0, 1, 8 * MIB, 0],  # a read of no bytes: still one descriptor
        ],
        dtype=np.int64,
    )
    out, ends, k = chunk_reads(rows, chunks)
    assert list(k) == sorted(k)  # in the order the chunks fill
    assert ends.sum() == len(rows)  # each descriptor ends once
    assert out[:, 4].sum() == rows[:, 4].sum()
    for (src, off, _, _, n), ki in zip(out.tolist(), k.tolist(), strict=True):
        cs, co, cn = chunks[ki].tolist()
        assert src == cs and co <= off and off + n <= co + cn  # inside one chunk
    # every byte lands where the whole rows would put it
    rng = np.random.default_rng(0)
    memory = {r: rng.integers(0, 256, 5 * MIB, dtype=np.uint8) for r in (7, 9)}

    def land(reads: np.ndarray) -> np.ndarray:
        dst = np.zeros(9 * MIB, dtype=np.uint8)
        for src, off, _, doff, n in reads.tolist():
            dst[doff : doff + n] = memory[src][off : off + n]
        return dst

    assert np.array_equal(land(out), land(rows))


def test_a_read_outside_every_chunk_is_refused() -> None:
    chunks = cut_chunks({7: [(MIB, 2 * MIB)]}, MIB)
    with pytest.raises(ProtocolError):
        chunk_reads(np.array([[7, 0, 1, 0, 100]], dtype=np.int64), chunks)
    # across the gap between two extents: its bytes in the gap are no chunk's
    chunks = cut_chunks({7: [(0, MIB), (2 * MIB, 3 * MIB)]}, MIB)
    with pytest.raises(ProtocolError):
        chunk_reads(np.array([[7, MIB - 10, 1, 0, MIB + 20]], dtype=np.int64), chunks)


REGION = 256
"""Bytes of each region in the property below (chunks of 16 bytes)."""


@st.composite
def scoped_reads(draw: st.DrawFn) -> tuple[dict[int, list[tuple[int, int]]], np.ndarray]:
    """A version's scope (up to three regions, extents with gaps between, a region
    possibly with none) and reads a lease on it may make: each inside one extent, or
    of no bytes anywhere in its region (a scope check lets those through)."""
    scope: dict[int, list[tuple[int, int]]] = {}
    for rid in draw(st.sets(st.integers(1, 9), min_size=1, max_size=3)):
        edges = sorted(draw(st.sets(st.integers(0, REGION), max_size=6)))
        scope[rid] = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=False) if a < b]
    extents = [(r, a, b) for r, ext in scope.items() for a, b in ext]
    rows = []
    for _ in range(draw(st.integers(1, 12))):
        if extents and draw(st.booleans()):
            r, a, b = draw(st.sampled_from(extents))
            off = draw(st.integers(a, b - 1))
            n = draw(st.integers(1, b - off))
        else:
            r, off, n = draw(st.sampled_from(sorted(scope))), draw(st.integers(0, REGION)), 0
        rows.append([r, off, 0, 0, n])
    out = np.array(rows, dtype=np.int64)
    out[:, 3] = np.cumsum(out[:, 4]) - out[:, 4]  # destinations do not overlap
    return scope, out


@settings(max_examples=300, deadline=None)
@given(scoped_reads())
def test_every_read_a_lease_may_make_is_cut_into_chunks_and_lands_where_it_would(
    case: tuple[dict[int, list[tuple[int, int]]], np.ndarray],
) -> None:
    scope, rows = case
    chunks = cut_chunks(scope, 16)
    if not len(chunks):
        return  # a version of no bytes: nothing to mirror
    out, ends, k = chunk_reads(rows, chunks)
    assert list(k) == sorted(k) and ends.sum() == len(rows)
    for (src, off, _, _, n), ki in zip(out.tolist(), k.tolist(), strict=True):
        cs, co, cn = chunks[ki].tolist()
        assert n == 0 or (src == cs and co <= off and off + n <= co + cn)
    memory = {r: np.arange(REGION, dtype=np.uint8) + np.uint8(r) for r in scope}

    def land(reads: np.ndarray) -> np.ndarray:
        dst = np.zeros(12 * REGION, dtype=np.uint8)
        for src, off, _, doff, n in reads.tolist():
            dst[doff : doff + n] = memory[src][off : off + n]
        return dst

    assert np.array_equal(land(out), land(rows))


@given(
    st.dictionaries(
        st.integers(0, 8),
        st.lists(st.tuples(st.integers(0, 8 << 20), st.integers(1, 48 << 20)), max_size=3),
        min_size=1,
        max_size=4,
    )
)
def test_the_chunk_count_the_holder_book_deals_is_the_number_of_chunks_a_mirror_cuts(
    gaps: dict[int, list[tuple[int, int]]],
) -> None:
    scope: dict[int, list[tuple[int, int]]] = {}
    for rid, runs in gaps.items():
        pos, ext = 0, []
        for gap, n in runs:
            ext.append((pos + gap, pos + gap + n))
            pos += gap + n
        scope[rid] = ext
    assert chunk_count(scope) == len(cut_chunks(scope))
