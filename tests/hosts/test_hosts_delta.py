"""``refitd bench delta --link-gbit``, small: the trainer and the engines on two
simulated hosts over shaped links, every version refitted by delta and in full and
the two compared bit for bit; with ``--mirror`` the engines' host keeps a mirror of
every version, which the full refits read while the deltas still come from the
source (docs/delta.md, "Through a host mirror")."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.hosts import needs_hosts

pytestmark = [needs_hosts, pytest.mark.timeout(300)]

SMALL = ["--layers", "2", "--hidden", "128", "--vocab", "1000", "--steps", "2"]


def _bench(*extra: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "refitd.cli", "bench", "delta", *SMALL, *extra],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()


def _last(lines: list[str]) -> dict[str, str]:
    return dict(kv.split("=") for kv in lines[-1].split())


def test_bench_delta_across_a_shaped_link_refits_every_version_by_delta_over_tcp() -> None:
    lines = _bench("--link-gbit", "1")
    last = _last(lines)
    assert last["verified"] == "1" and last["path"] == "tcp" and last["link_gbit"] == "1"
    assert "link 1 Gbit/s, trainer and engines on two hosts" in lines[0]
    assert not [line for line in lines if "refitted in full" in line], lines
    assert 0 < float(last["wire_ratio"]) < 0.2, last


def test_bench_delta_through_a_host_mirror_over_a_shaped_link_still_refits_by_delta() -> None:
    lines = _bench("--link-gbit", "1", "--mirror")
    last = _last(lines)
    # The full refits read the engines' host mirror (shm); every delta came from the
    # source across the link, and both engines hold the same bytes after each version.
    assert last["verified"] == "1" and last["path"] == "shm", last
    assert "mirroring every version" in lines[0]
    assert not [line for line in lines if "refitted in full" in line], lines
    assert 0 < float(last["wire_ratio"]) < 0.2, last
