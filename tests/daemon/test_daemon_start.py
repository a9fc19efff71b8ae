"""A daemon's start: UCX only where it is asked for or may be used, and ready as
soon as the daemon serves (with UCX up first whenever UCX is to carry pulls)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.daemons import daemon_config, serving_daemons

from refitd.client import SyncRefitClient
from refitd.client.spawn import serve_command
from refitd.daemon.node import Daemon
from refitd.daemon.paths import has_rdma, rdma_devices
from transports.ucx.info import ucx_transports

pytestmark = pytest.mark.timeout(60)


def test_the_rdma_devices_are_what_the_kernel_lists_and_none_where_it_lists_none(
    tmp_path: Path,
) -> None:
    for name in ("mlx5_1", "mlx5_0", "rxe0"):
        (tmp_path / name).mkdir()
    assert rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1", "rxe0"]
    assert rdma_devices(str(tmp_path / "absent")) == []
    assert not has_rdma([])


async def test_auto_without_rdma_asks_ucx_only_once_node_info_is_asked_for() -> None:
    """``ucx_info`` (about 0.4 s) runs at start only where UCX may start; elsewhere
    the first ``/v1/node`` asks it, and says what it said."""
    if rdma_devices():
        pytest.skip("this host has an RDMA device: auto asks UCX at start, as it must")
    daemon = Daemon(daemon_config())
    async with serving_daemons(daemon) as (c,):
        assert set(daemon.plane.by_scheme) == {"tcp"}
        assert daemon.ucx_transports == []  # not asked yet
        node = await c.node()
        assert node.ucx_transports == await ucx_transports()
        assert node.worker_info["scheme"] == "tcp" and not has_rdma(node.ucx_transports)
        assert (await c.node()).ucx_transports == node.ucx_transports  # asked once


async def test_a_shm_daemon_never_asks_ucx() -> None:
    daemon = Daemon(daemon_config(transport="shm"))
    async with serving_daemons(daemon) as (c,):
        assert (await c.node()).ucx_transports == []
        assert daemon.plane.by_scheme == {}


def test_serve_asked_for_ucx_reports_ready_only_with_ucx_up(secret_file: str) -> None:
    proc = subprocess.Popen(
        serve_command("--port", "0", "--transport", "ucx", "--secret-file", secret_file),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready", ready
        with SyncRefitClient(ready["url"]) as c:
            node = c.node()
            assert node.worker_info["scheme"] == "ucx", node
            assert any(p.startswith("tcp/") for p in node.ucx_transports), node
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_refitd_serve_loads_no_benchmark_and_no_other_command() -> None:
    code = (
        "import sys; from refitd.cli import _build_parser; "
        "_build_parser(['serve', '--port', '0']).parse_args(['serve', '--port', '0']); "
        "print(sorted(m for m in sys.modules if m.startswith(('refitd.bench', 'refitd.ops'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
