"""`refitd bench hosts` end to end, at a small size."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.etcd import needs_etcd
from support.hosts import needs_hosts

pytestmark = [needs_hosts, needs_etcd, pytest.mark.timeout(240)]


def test_bench_hosts_pulls_across_hosts_over_ucx_and_prints_its_ratios_last() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "refitd.cli", "bench", "hosts", "--gib", "0.02", "--repeat", "1",
         "--sources", "50"],
        capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    last = dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].split())
    assert set(last) == {
        "cross_host_gbps", "tcp_gbps", "cross_host_ratio", "discovery_50_s", "path", "verified"
    }  # fmt: skip
    assert last["verified"] == "1" and last["path"] == "ucx"
    assert float(last["cross_host_gbps"]) > 0 and float(last["tcp_gbps"]) > 0
