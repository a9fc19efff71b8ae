"""A daemon's start: UCX only where it is asked for or may be used, and ready as
soon as the daemon serves (with UCX up first whenever UCX is to carry pulls)."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.daemons import daemon_config, serving_daemons

from refitd.client import SyncRefitClient
from refitd.client.spawn import serve_command
from refitd.daemon.app.node import Daemon
from refitd.daemon.pull.paths import has_rdma, rdma_devices
from transports.ucx.info import ucx_transports

pytestmark = pytest.mark.timeout(60)

READY_DEADLINE_S = 180.0
"""How long a spawned ``refitd serve --transport ucx`` may take to print its ready
line. Its start took 3 s on the 2-core test host at load 1.5 and 15-17 s at load 14
(four starts at once beside other suites), growing with the load; the daemon itself
gives a UCX child 60 s to say hello before it fails the start saying why. Above
both, so a slow start passes and a stuck one fails with the daemon's own reason."""


def _log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a spawned daemon's log, for a failure message."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _ready_record(proc: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    """The ready record ``proc`` prints, waited for `READY_DEADLINE_S` at most; a
    daemon that exits first, or stays silent, fails the test with its log's tail."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(READY_DEADLINE_S):  # readable: the ready line, or end of file
            pytest.fail(
                f"refitd serve printed no ready line in {READY_DEADLINE_S:g} s; "
                f"its log:\n{_log_tail(log)}"
            )
    line = proc.stdout.readline()  # written whole, in one write, with its newline
    if not line:
        pytest.fail(
            f"refitd serve exited with status {proc.wait()} before ready; its log:\n"
            f"{_log_tail(log)}"
        )
    record: dict[str, Any] = json.loads(line)
    return record


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


@pytest.mark.timeout(READY_DEADLINE_S + 60)  # + the node request and a 30 s shutdown
def test_serve_asked_for_ucx_reports_ready_only_with_ucx_up(
    secret_file: str, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with log.open("wb") as log_file:  # a file, not a pipe: the daemon's log never blocks it
        proc = subprocess.Popen(
            serve_command("--port", "0", "--transport", "ucx", "--secret-file", secret_file),
            stdout=subprocess.PIPE,
            stderr=log_file,
        )
    try:
        ready = _ready_record(proc, log)
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
