"""`refitd bench hosts` end to end, at a small size."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.etcd import needs_etcd
from support.hosts import needs_hosts

pytestmark = [needs_hosts, needs_etcd, pytest.mark.timeout(480)]


def test_bench_hosts_pulls_over_autos_tcp_and_over_ucx_and_prints_its_ratios_last() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "refitd.cli", "bench", "hosts", "--gib", "0.02", "--repeat", "1",
         "--sources", "50"],
        capture_output=True, text=True, timeout=420, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    last = dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].split())
    assert set(last) == {
        "cross_host_gbps", "link_gbps", "cross_host_ratio", "busy_ratio", "tcp_path_ratio",
        "ucx_path_ratio", "ucx_busy_ratio", "tcp_4k_ratio", "tcp_lanes1_ratio",
        "tcp_lanes2_ratio", "tcp_src_cpu_s_per_gb", "ucx_src_cpu_s_per_gb", "discovery_50_s",
        "path", "verified",
    }  # fmt: skip
    # auto picks refitd's tcp lanes between hosts without RDMA; every byte checked
    assert last["verified"] == "1" and last["path"] == "tcp"
    assert float(last["cross_host_gbps"]) > 0 and float(last["link_gbps"]) > 0
    assert float(last["ucx_path_ratio"]) > 0 and float(last["tcp_src_cpu_s_per_gb"]) >= 0


def test_bench_hosts_with_a_shaped_link_reports_the_pull_against_the_shaped_rate() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "refitd.cli", "bench", "hosts", "--gib", "0.02", "--repeat", "1",
         "--sources", "10", "--link-gbit", "1"],
        capture_output=True, text=True, timeout=420, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    last = dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].split())
    assert last["verified"] == "1" and "links shaped to 1 Gbit/s" in out.stdout
    # a 1 Gbit/s link carries at most 0.125 GB/s (plus the bucket's burst)
    assert 0 < float(last["link_gbps"]) < 0.2
    assert 0 < float(last["shaped_ratio"]) < 1.6
