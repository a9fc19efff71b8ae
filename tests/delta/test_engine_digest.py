"""The engine's block digest: kept up to date from a refit's writes it equals one taken
afresh, and a write outside a refit is found within ``every`` windowed checks, even
under later deltas that read the value it left."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.delta.diff import lanes_of, unit_dtype
from refitd.delta.digest import EngineDigest

UNITS = st.sampled_from([1, 2, 4, 8])


def _writes(
    rng: np.random.Generator, buf: np.ndarray, unit: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    units = buf.view(unit_dtype(unit))
    idx = np.sort(rng.choice(len(units), size=min(n, len(units)), replace=False)).astype(np.int64)
    new = rng.integers(0, 2 ** (8 * unit), len(idx), dtype=np.uint64).astype(unit_dtype(unit))
    old = units[idx].copy()
    units[idx] = new
    return idx * unit, old, new


@given(unit=UNITS, nbytes=st.integers(0, 600_000), seed=st.integers(0, 2**32 - 1), data=st.data())
@settings(max_examples=60, deadline=None)
def test_a_digest_updated_from_writes_and_rewrites_equals_one_taken_afresh(
    unit: int, nbytes: int, seed: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, nbytes // unit * unit, dtype=np.uint8)
    digest = EngineDigest.of(buf)
    for _ in range(data.draw(st.integers(1, 3))):
        offsets, old, new = _writes(rng, buf, unit, data.draw(st.integers(0, 5000)))
        digest.update(offsets, old, new)
        if len(buf):  # a whole span rewritten (a replayed full read), at any byte
            lo = data.draw(st.integers(0, len(buf) - 1))
            hi = data.draw(st.integers(lo, len(buf)))
            before = buf[lo:hi].copy()
            buf[lo:hi] = rng.integers(0, 256, hi - lo, dtype=np.uint8)
            digest.rewrite(lo, before, buf[lo:hi])
    fresh = EngineDigest.of(buf)
    assert np.array_equal(digest.lanes, fresh.lanes)
    assert np.array_equal(digest.whole(), lanes_of(buf))
    assert digest.differs(buf) is None


@given(
    every=st.integers(1, 9),
    nbytes=st.integers(4096, 2_000_000),
    seed=st.integers(0, 2**32 - 1),
    checks_before=st.integers(0, 20),
)
@settings(max_examples=60, deadline=None)
def test_a_write_outside_a_refit_is_found_within_every_windowed_checks_under_later_deltas(
    every: int, nbytes: int, seed: int, checks_before: int
) -> None:
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, nbytes // 2 * 2, dtype=np.uint8)
    digest = EngineDigest.of(buf)
    for _ in range(checks_before):  # the window is anywhere when the write happens
        assert digest.differs(buf, every) is None
    at = int(rng.integers(0, len(buf)))
    buf[at] ^= 1 + int(rng.integers(0, 255))  # written outside a refit
    found = None
    for _ in range(every):
        offsets, old, new = _writes(rng, buf, 2, 2000)  # a delta over it, reading what is there
        digest.update(offsets, old, new)
        found = digest.differs(buf, every)
        if found is not None:
            break
    assert found == at // digest.block
