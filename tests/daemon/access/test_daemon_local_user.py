"""What an unprivileged local user gets from a daemon: nothing but its health.

A real daemon (a child process, tokens, the ``tcp`` data plane), probed from a process
running as ``nobody`` with no token: every route but the public ones is 401, the
holder book and ``/metrics`` included; a region's segment does not open; the data
server closes its connection unanswered. Root only (it drops to another uid); skipped
with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import pytest

from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon
from transports.segments import SHM_DIR
from transports.tcp.frames import HELLO, MAGIC

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to probe as another uid"),
]

NOBODY = 65534
PROBES = [
    ("GET", "/v1/health"),
    ("GET", "/v1/regions"),
    ("GET", "/metrics"),
    ("POST", "/v1/mirrors/holders"),
    ("POST", "/v1/leases"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _status(port: int, method: str, path: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n\r\n{}".encode()
        )
        line = s.makefile("rb").readline().split()
        return int(line[1])


def _data_server(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(HELLO.pack(MAGIC, 1, 1, bytes(16)))
        try:
            return "closed" if s.recv(64) == b"" else "answered"
        except ConnectionResetError:
            return "closed"


def probe_as(uid: int, http_port: int, segment: Path, data_port: int) -> dict[str, object]:
    """From a child process running as ``uid``: what each probe got."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, probe, report, exit without cleanup
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out: dict[str, object] = {f"{m} {p}": _status(http_port, m, p) for m, p in PROBES}
            try:
                with open(segment, "rb"):
                    out["segment"] = "opened"
            except PermissionError:
                out["segment"] = "denied"
            out["data server"] = _data_server(data_port)
            os.write(w, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result: dict[str, object] = json.loads(got)
    return result


async def test_an_unprivileged_local_user_without_a_token_gets_only_the_daemons_health(
    secret_file: str, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("a token-of-a\n")
    tokens.chmod(0o600)
    data_port = free_port()
    args = [
        "--set",
        f"server.token_file={tokens}",
        "--set",
        f"data_plane.tcp_port={data_port}",
        "--set",
        "mirrors.policy=always",
    ]
    async with (
        spawn_daemon(secret_file=secret_file, transport="tcp", extra_args=args) as d,
        RefitClient(d.url, token="token-of-a") as a,
    ):
        region = await a.create_region(4096, label="a")
        port = int(d.url.rsplit(":", 1)[1])
        got = await asyncio.to_thread(
            probe_as, NOBODY, port, SHM_DIR / region.handle.lstrip("/"), data_port
        )
        assert got == {
            "GET /v1/health": 200,
            "GET /v1/regions": 401,
            "GET /metrics": 401,
            "POST /v1/mirrors/holders": 401,
            "POST /v1/leases": 401,
            "segment": "denied",
            "data server": "closed",
        }
