"""``refitd bench transport`` end to end, small: its rows report the median of the
runs with their spread, and its last line carries every key, verified. A rate it
measured is printed nonzero however slow the host made it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from refitd.bench.transport import figures

pytestmark = pytest.mark.timeout(300)


def test_bench_transport_prints_medians_with_their_spread_and_verifies_every_byte() -> None:
    refitd = Path(sys.executable).with_name("refitd")
    out = subprocess.run(
        [str(refitd), "bench", "transport", "--total-mib", "1", "--pieces", "4KiB,1MiB",
         "--schemes", "local,tcp", "--repeat", "3"],
        capture_output=True, text=True, check=True, timeout=240,
    ).stdout.splitlines()  # fmt: skip
    assert "median of 3" in out[0], out[0]
    assert out[1].split()[-1] == "spread", out[1]
    rows = [line.split() for line in out[2:-1]]
    cases = {(r[0], r[1], r[2]) for r in rows}
    for scheme in ("memcpy", "local", "tcp"):
        assert {(scheme, "4KiB", "contiguous"), (scheme, "4KiB", "shuffled")} <= cases
        assert (scheme, "1MiB", "contiguous") in cases
    for r in rows:
        gbps, ratio, spread = map(float, r[5:8])
        assert gbps > 0 and ratio > 0 and spread >= 0, r
        if r[0] == "memcpy":
            assert ratio == 1.0, r
    keys = dict(kv.split("=") for kv in out[-1].split())
    assert keys["verified"] == "1"
    assert {"memcpy_gbps", "tcp_4KiB_shuffled_gbps", "local_1MiB_ratio"} <= keys.keys()


def test_a_measured_rate_too_small_for_two_decimals_is_printed_nonzero() -> None:
    """A slow transport on a busy host (tcp at 4 KiB pieces) reaches a few thousandths
    of memcpy: its row and key say so, never ``0.00``."""
    assert figures(1.0) == "1.00" and figures(12.345) == "12.35" and figures(0.0) == "0.00"
    for tiny in (0.004, 0.0996, 3e-6):
        assert float(figures(tiny)) == pytest.approx(tiny, rel=0.05)
