"""The systemd unit and the sd_notify protocol, against real systemd tools and sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from refitd.daemon.app.sdnotify import Notifier

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "refitd.service"
HUGE_UNIT = ROOT / "systemd" / "refitd-shm-huge.service"
APT_INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "systemd"]


def systemd_tool(name: str) -> str:
    """Path of a systemd tool, installing Debian's systemd package when it is missing.

    Skips (saying why) only when the package cannot be installed here: not root, no
    apt-get, or no package mirror reachable.
    """
    found = shutil.which(name)
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(f"{name} is missing and cannot be installed here ({' '.join(APT_INSTALL)})")
    done = subprocess.run(APT_INSTALL, capture_output=True, text=True, timeout=600)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is missing; `{' '.join(APT_INSTALL)}` failed: {done.stderr[-300:]}")
    return found


@pytest.mark.parametrize("unit", [UNIT, HUGE_UNIT], ids=lambda p: p.name)
def test_each_unit_file_passes_systemd_analyze_verify_cleanly(unit: Path) -> None:
    done = subprocess.run(
        [systemd_tool("systemd-analyze"), "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr


def test_the_unit_is_type_notify_with_watchdog_hardening_and_memlock() -> None:
    text = UNIT.read_text()
    for line in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "RuntimeDirectory=refitd",
        "LimitMEMLOCK=infinity",
        "User=refitd",
    ]:
        assert f"\n{line}" in text, line


def test_the_sysusers_snippet_creates_the_refitd_user() -> None:
    done = subprocess.run(
        [systemd_tool("systemd-sysusers"), "--dry-run", str(ROOT / "systemd" / "refitd.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Either it would create the user, or the user already exists on this machine.
    assert "user 'refitd'" in done.stderr or "refitd" in Path("/etc/passwd").read_text()


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(10)
    yield sock, str(path)
    sock.close()


def test_ready_status_and_stopping_arrive_as_datagrams(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("serving on 127.0.0.1:7070")
    assert notifier.watchdog()
    assert notifier.stopping()
    notifier.close()
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:7070"
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert sock.recv(4096) == b"STOPPING=1"


def test_an_abstract_namespace_socket_is_addressed_with_a_leading_nul() -> None:
    name = f"refitd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(10)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.status("warming up")
        assert sock.recv(4096) == b"STATUS=warming up"
        notifier.close()
    finally:
        sock.close()


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False


def test_a_vanished_socket_is_reported_not_raised(tmp_path: Path) -> None:
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).ready() is False


def test_the_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s == 15.0
    assert Notifier({}).watchdog_interval_s is None


def test_a_watchdog_meant_for_another_process_is_ignored() -> None:
    env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier(env).watchdog_interval_s is None
    env["WATCHDOG_PID"] = str(os.getpid())
    assert Notifier(env).watchdog_interval_s == 15.0


async def test_the_watchdog_loop_pings_until_cancelled(
    listener: tuple[socket.socket, str],
) -> None:

    sock, path = listener
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(notifier.watchdog_loop())
    try:
        pings = [await asyncio.wait_for(loop.sock_recv(sock, 4096), 10) for _ in range(3)]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        notifier.close()
    assert pings == [b"WATCHDOG=1"] * 3


async def test_the_watchdog_loop_returns_at_once_without_a_watchdog() -> None:
    await Notifier({"NOTIFY_SOCKET": "/nonexistent"}).watchdog_loop()


def test_the_optional_huge_page_unit_runs_before_the_daemon() -> None:
    text = HUGE_UNIT.read_text()
    assert "Before=refitd.service" in text
    assert "WantedBy=refitd.service" in text


def test_the_huge_page_unit_sets_the_mode_the_daemon_reads_back() -> None:
    """The remount the unit runs, applied to /dev/shm's mount line, is read back by
    ``huge_page_mode`` as ``advise``: the mode under which refitd's madvised segments
    get huge pages."""
    from transports.segments import SHM_DIR, huge_page_mode

    start = next(
        line.split("=", 1)[1]
        for line in HUGE_UNIT.read_text().splitlines()
        if line.startswith("ExecStart=")
    )
    argv = start.split()
    assert argv[-1] == str(SHM_DIR)
    options = argv[argv.index("-o") + 1].split(",")
    assert "remount" in options
    mounts = f"tmpfs {SHM_DIR} tmpfs rw,nosuid,nodev 0 0\ntmpfs {SHM_DIR} tmpfs rw,{','.join(o for o in options if o != 'remount')} 0 0"
    assert huge_page_mode(mounts) == "advise"
