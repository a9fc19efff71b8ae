"""Swap mode's carry-over (:mod:`refitd.client.swap`): the engine bytes a pull does not
write are copied from the serving copy into the shadow before the swap, exactly those."""

from __future__ import annotations

from refitd.client.swap import unwritten_ranges


def test_the_bytes_a_swap_carries_over_are_exactly_those_no_pull_writes() -> None:
    spans = [(0, 100), (128, 64), (256, 16)]
    written = [(10, 20), (25, 30), (128, 64), (0, 5), (260, 4)]
    assert unwritten_ranges(spans, written) == [(5, 5), (55, 45), (256, 4), (264, 8)]
    assert unwritten_ranges(spans, [(0, 1000)]) == []
    assert unwritten_ranges(spans, []) == spans
