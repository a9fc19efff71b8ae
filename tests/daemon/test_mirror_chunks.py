"""How a mirror cuts a version into chunks, and an engine's reads at their edges: pure."""

from __future__ import annotations

import numpy as np
import pytest

from refitd.daemon.mirror import (
    CHUNK_BYTES,
    CHUNKS_PER_VERSION,
    MAX_CHUNK_BYTES,
    chunk_bytes,
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
