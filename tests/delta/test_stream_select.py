"""The source's selection of a stream's changes, against a unit-by-unit reference:
which changes each read covers, in stream order, and their old and new units."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.delta.diff import unit_dtype
from refitd.delta.stream import ChangeIndex, changed_pairs, select


@given(
    unit=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
    regions=st.integers(1, 3),
    reads=st.integers(0, 12),
)
@settings(max_examples=80, deadline=None)
def test_selected_changes_and_their_units_are_those_a_unit_by_unit_walk_finds(
    unit: int, seed: int, regions: int, reads: int
) -> None:
    rng = np.random.default_rng(seed)
    size = 400  # units per region
    per = {
        r: np.sort(rng.choice(size, int(rng.integers(0, size)), replace=False)).astype(np.int64)
        * unit
        for r in range(regions)
    }
    index = ChangeIndex.of(per)
    values = rng.integers(0, 256, len(index.offsets) * 2 * unit, dtype=np.uint8)
    rows = []
    for _ in range(reads):
        lo = int(rng.integers(0, size))
        rows.append(
            (
                int(rng.integers(0, regions + 1)),
                lo * unit,
                int(rng.integers(0, size - lo + 1)) * unit,
            )
        )
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    k, at = select(index, table, unit)
    want_k, want_at, start = [], [], 0
    for region, lo, n in rows:
        span = index.spans.get(region, (0, 0))
        for i in range(span[0], span[1]):
            if lo <= index.offsets[i] < lo + n:
                want_k.append(start + (int(index.offsets[i]) - lo) // unit)
                want_at.append(i)
        start += n // unit
    assert k.tolist() == want_k and at.tolist() == want_at
    old, new = changed_pairs(values, at, unit)
    pairs = values.reshape(-1, 2, unit)
    dt = unit_dtype(unit)
    assert old.tolist() == [pairs[i, 0].view(dt)[0] for i in want_at]
    assert new.tolist() == [pairs[i, 1].view(dt)[0] for i in want_at]
