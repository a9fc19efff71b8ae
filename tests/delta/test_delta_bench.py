"""``refitd bench delta`` end to end, small: every version is refitted by delta and in
full, the two engines agree bit for bit, and the last line carries its keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_delta_refits_every_version_both_ways_and_verifies_them_equal() -> None:
    refitd = Path(sys.executable).with_name("refitd")
    out = subprocess.run(
        [str(refitd), "bench", "delta", "--layers", "2", "--hidden", "128", "--vocab", "1000",
         "--steps", "2"],
        capture_output=True, text=True, check=True, timeout=240,
    ).stdout.splitlines()  # fmt: skip
    keys = dict(kv.split("=") for kv in out[-1].split())
    assert keys["verified"] == "1", out
    assert keys["path"] == "shm"
    changed, wire = float(keys["changed_fraction"]), float(keys["wire_ratio"])
    assert 0 < changed < 1 and 0 < wire < 1, keys
    parts = dict(kv.split("=") for kv in out[-3].split())
    assert {"delta_s", "full_s", "stage_s", "pull_s", "digest_s"} <= parts.keys(), out[-3]
    # Where the deltas' wall time went, in parts that add up (the source's inside them).
    where = dict(kv.split("=") for kv in out[-4].removeprefix("where: ").split())
    assert {"plan_s", "first_s", "stream_s", "tail_s", "src_encode_s"} <= where.keys(), out[-4]
    speeds = dict(kv.split("=") for kv in out[-2].split())
    assert {"stage_GBps", "place_GBps", "digest_GBps"} <= speeds.keys(), out[-2]
    assert 1 < float(speeds["wire_B_per_change"]) < 3, out[-2]


def test_bench_delta_moe_applies_thousands_of_expert_tensors_exactly_and_prints_its_share() -> None:
    refitd = Path(sys.executable).with_name("refitd")
    out = subprocess.run(
        [str(refitd), "bench", "delta", "--moe", "--moe-layers", "4", "--experts", "64",
         "--steps", "2"],
        capture_output=True, text=True, check=True, timeout=240,
    ).stdout.splitlines()  # fmt: skip
    keys = dict(kv.split("=") for kv in out[-1].split())
    assert keys["verified"] == "1", out
    assert int(keys["tensors"]) == 4 * 64 * 3
    assert 0 < float(keys["apply_share"]) < 1 and 0 < float(keys["wire_ratio"]) < 1, keys
    assert not [line for line in out if "refitted in full" in line], out


def test_bench_delta_refuses_a_mirror_without_another_host() -> None:
    refitd = Path(sys.executable).with_name("refitd")
    out = subprocess.run(
        [str(refitd), "bench", "delta", "--steps", "1", "--mirror"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "add --link-gbit" in out.stdout, out.stdout + out.stderr
