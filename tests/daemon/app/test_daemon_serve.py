"""`refitd serve` as a process: ready line, TCP and Unix socket, orderly SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

import refitd.client
from refitd.client import SyncRefitClient
from refitd.client.spawn import serve_command
from refitd.errors import AccessDenied, NotFoundError

pytestmark = pytest.mark.timeout(60)


def test_the_client_package_exports_exactly_its_public_names() -> None:
    public = {n for n in dir(refitd.client) if not n.startswith("_") and n[0].isupper()}
    assert set(refitd.client.__all__) == public
    for name in public:  # each is imported on first use
        assert getattr(refitd.client, name).__name__ == name


def test_serve_reports_its_bound_port_serves_tcp_and_unix_and_exits_cleanly_on_sigterm(
    tmp_path: Path,
) -> None:
    """With a Unix socket and no token file, the API is the socket's: TCP answers
    health, and refuses the rest (it would admit uids the socket refuses)."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    sock = tmp_path / "refitd.sock"
    proc = subprocess.Popen(
        serve_command(
            "--port", "0", "--unix", str(sock), "--secret-file", str(secret), "--node-id", "proc"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["node_id"] == "proc"
        assert not ready["url"].endswith(":0")
        with SyncRefitClient(ready["url"]) as c:
            assert c.health() == {"status": "ok"}
            with pytest.raises(AccessDenied, match="over TCP refused"):
                c.create_region(4096, label="sync")
        with SyncRefitClient("http://localhost", unix_path=str(sock)) as u:
            region = u.create_region(4096, label="sync")
            assert u.node().node_id == "proc"
            with pytest.raises(NotFoundError):
                u.manifest("absent", 1)
            assert [r.region_id for r in u.regions()] == [region.region_id]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
