"""The "Running as a service" steps of docs/operations.md, followed verbatim in a scratch prefix,
give a daemon that starts the way the unit starts it and serves a pull.

The unit runs ``refitd serve`` as user ``refitd`` with ProtectSystem=strict,
ProtectHome and PrivateTmp. Here a mount namespace stands in for systemd: the root
file system (the prefix, the venv and any home) is read-only, /tmp is private, every
C compiler is masked, and a stand-in system user runs the daemon. Issue 13: the
data-plane child used to compile its C helper at first use, could not write anywhere,
and the daemon never sent READY.

Slow (a fresh venv with torch and UCX, twice): about two minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.docs import code_blocks, section

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: useradd, mount namespaces"),
    pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3"),
]

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"
COMPILERS = ("cc", "gcc", "c++", "g++", "c89", "c99", "clang", "tcc", "x86_64-linux-gnu-gcc")


def readme_service_steps() -> list[str]:
    """The command lines of the first bash block under "## Running as a service" in
    docs/operations.md."""
    block = code_blocks(section("docs/operations.md", "## Running as a service"), "bash")[0]
    return [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


@dataclass
class Installed:
    prefix: Path
    user: str
    uid: int
    gid: int

    @property
    def bin(self) -> Path:
        return self.prefix / "usr/local/bin"

    @property
    def config(self) -> Path:
        return self.prefix / "etc/refitd/refitd.toml"


def _run(cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw
    )  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    """Each documented step, with the system paths moved into a scratch prefix, the
    system user made by useradd (a stand-in name, so the host's own refitd user, if
    any, is untouched) and the systemctl lines left out (no systemd here)."""
    prefix = Path(tempfile.mkdtemp(prefix="refitd-svc-", dir="/var/tmp"))
    prefix.chmod(0o755)
    user = f"rfx{os.getpid() % 100000}"
    for d in ("usr/local/bin", "usr/lib/sysusers.d", "usr/lib/tmpfiles.d", "etc/systemd/system"):
        (prefix / d).mkdir(parents=True)

    def moved(line: str) -> str:
        return re.sub(
            r"(?<![\w/.])(?=/opt/refitd|/usr/local/bin|/usr/lib/|/etc/)", str(prefix), line
        )

    try:
        for line in readme_service_steps():
            if line.startswith(("systemctl", "refitd status")):
                continue
            if line.startswith("python3 -m venv"):
                line = SYSTEM_PYTHON + line.removeprefix("python3")
            if line.startswith("systemd-sysusers"):
                sysusers = (ROOT / "systemd/refitd.sysusers").read_text()
                entry = next(ln for ln in sysusers.splitlines() if ln.startswith("u "))
                home, shell = entry.split()[-2:]
                _run(f"useradd --system --no-create-home --home-dir {home} --shell {shell} {user}")
                continue
            if line.startswith("systemd-tmpfiles"):
                conf = prefix / "usr/lib/tmpfiles.d/refitd.conf"
                conf.write_text(
                    re.sub(r"\brefitd refitd\b|\broot refitd\b", _owner(user), conf.read_text())
                )
                # With --root, tmpfiles resolves owners in the root's user database.
                for db in ("passwd", "group"):
                    shutil.copy(f"/etc/{db}", prefix / "etc" / db)
                _run(f"systemd-tmpfiles --create --root={prefix} {conf}")
                continue
            line = re.sub(r"-g refitd\b", f"-g {user}", moved(line))
            if line.startswith("refitd "):
                line = f"{prefix}/usr/local/bin/{line}"
            _run(line)
        pw = _run(f"getent passwd {user}").stdout.split(":")
        yield Installed(prefix, user, int(pw[2]), int(pw[3]))
    finally:
        subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(prefix, ignore_errors=True)


def _owner(user: str):  # type: ignore[no-untyped-def]
    return lambda m: m.group(0).replace("refitd", user)


def sandboxed(inst: Installed, argv: list[str], env: dict[str, str]) -> list[str]:
    """``argv`` as the unit runs it: in a private mount namespace with the root file
    system read-only (ProtectSystem=strict; ProtectHome follows), a private /tmp
    (PrivateTmp), every compiler masked, as the service user without new privileges."""
    masks = sorted({os.path.realpath(p) for c in COMPILERS if (p := shutil.which(c))})
    script = "\n".join(
        [
            "set -e",
            "mount -o remount,bind,ro /",
            "mount -t tmpfs -o mode=1777 tmpfs /tmp",
            *(f"mount --bind /dev/null {m}" for m in masks),
            'exec "$@"',
        ]
    )
    envs = [f"{k}={v}" for k, v in env.items()]
    return [
        "unshare", "-m", "--propagation", "private", "--", "sh", "-c", script, "sandbox",
        "setpriv", f"--reuid={inst.uid}", f"--regid={inst.gid}", "--init-groups",
        "--no-new-privs", "env", "-i", *envs, *argv,
    ]  # fmt: skip


UNIT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_the_readme_steps_give_a_service_that_reaches_ready_in_its_sandbox_and_serves_a_pull(
    installed: Installed,
) -> None:
    inst = installed
    exec_start = (ROOT / "systemd/refitd.service").read_text()
    assert "ExecStart=/usr/bin/env refitd serve --config /etc/refitd/refitd.toml" in exec_start
    path = f"{inst.bin}:{UNIT_PATH}"
    env = {"PATH": path, "HOME": "/var/empty", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}

    # Inside the sandbox: nothing writable but /tmp and /dev/shm, and no compiler runs.
    probe = (
        f"touch {inst.prefix}/opt/refitd/x 2>/dev/null && echo prefix-writable; "
        "for c in cc gcc; do $c --version >/dev/null 2>&1 && echo compiler-$c; done; "
        "ls -A /tmp; echo probed"
    )
    out = subprocess.run(
        sandboxed(inst, ["/bin/sh", "-c", probe], env), capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["probed"], out.stdout + out.stderr

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"refitd-test-notify-{os.getpid()}"
    notify.bind("\0" + name)
    notify.settimeout(1)
    env |= {"NOTIFY_SOCKET": "@" + name, "REFITD_SERVER_PORT": "0"}
    argv = ["/usr/bin/env", "refitd", "serve", "--config", str(inst.config)]
    daemon = subprocess.Popen(
        sandboxed(inst, argv, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        messages: list[str] = []
        deadline = time.monotonic() + 120
        while not any("READY=1" in m for m in messages):
            assert daemon.poll() is None, daemon.communicate()[1][-4000:]
            assert time.monotonic() < deadline, messages
            try:
                messages.append(notify.recv(4096).decode())
            except TimeoutError:
                continue
        assert daemon.stdout is not None
        ready = json.loads(daemon.stdout.readline())
        assert ready["event"] == "ready"
        assert psuser(ready["pid"]) == inst.uid

        # A trainer running as the service's user publishes 64 KiB and pulls it into a
        # second region through the installed `refitd pull`.
        client = subprocess.run(
            [
                "setpriv", f"--reuid={inst.uid}", f"--regid={inst.gid}", "--init-groups",
                "env", "-i", f"PATH={path}", "HOME=/var/empty",
                str(inst.prefix / "opt/refitd/bin/python"), "-P", "-c", CLIENT, ready["url"],
            ],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert client.returncode == 0, client.stdout + client.stderr
        assert client.stdout.split()[-1] == "pulled-exact"
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            _, err = daemon.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            _, err = daemon.communicate()
        notify.close()
    assert daemon.returncode == 0, err[-4000:]
    assert err.strip().splitlines()[-1].endswith("INFO refitd: stopped")


def psuser(pid: int) -> int:
    return int(
        next(
            ln
            for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
            if ln.startswith("Uid:")
        ).split()[1]
    )


CLIENT = """
import json, subprocess, sys
import numpy as np
from refitd.client.sync import SyncRefitClient
from refitd.wire import ManifestIn, ShardEntry, TensorEntry
from transports.segments import SharedSegment

url = sys.argv[1]
with SyncRefitClient(url) as c:
    src = c.create_region(1 << 16, label="trainer")
    dst = c.create_region(1 << 16, label="engine")
    seg = SharedSegment.attach(src.handle, src.nbytes)
    seg.numpy()[:] = np.arange(1 << 16) % 251
    seg.close()
    shard = ShardEntry((0,), (1 << 16,), src.region_id, 0)
    c.publish(ManifestIn("m", 1, 0, 1, [TensorEntry("w", (1 << 16,), "uint8", [shard])]))
    plan = json.dumps({"model": "m", "descriptors": [[src.region_id, 0, dst.region_id, 0, 1 << 16]]})
    subprocess.run(["refitd", "pull", "-", "--url", url, "--json"], input=plan.encode(), check=True)
    seg = SharedSegment.attach(dst.handle, dst.nbytes)
    ok = np.array_equal(seg.numpy(), np.arange(1 << 16) % 251)
    seg.close()
print("pulled-exact" if ok else "pulled-wrong")
"""


def test_a_wheel_from_pip_wheel_installs_and_loads_its_helpers_on_a_host_without_a_compiler(
    installed: Installed, tmp_path: Path
) -> None:
    inst = installed
    dist = tmp_path / "dist"
    py = f"{inst.prefix}/opt/refitd/bin/python"
    _run(f"{py} -m pip wheel --no-deps -w {dist} .")
    (wheel,) = dist.glob("refitd-*.whl")
    assert re.search(r"-cp311-abi3-linux_x86_64\.whl$", wheel.name), wheel.name
    venv = tmp_path / "fresh"
    _run(f"{SYSTEM_PYTHON} -m venv {venv}")
    # The helpers need only the package and the libucx wheel their runpath points into.
    _run(f"{venv}/bin/pip install --quiet --no-deps {wheel} 'libucx-cu12==1.21.*' msgspec")
    env = {"PATH": str(tmp_path / "no-bin"), "HOME": str(tmp_path / "no-home")}
    checks = [
        # Alone, _ucx finds libucp through its runpath into the installed libucx wheel.
        "import transports.native._copy, transports.native._ucx; print('imported')",
        # As the data plane loads it: the wheel's libucp first, then the helper on it.
        "from transports.native import copy_lib, ucx_lib, loaded_libucp; copy_lib(); "
        "ucx_lib(); print('loaded', len(loaded_libucp()))",
    ]
    for check, want in zip(checks, (["imported"], ["loaded", "1"])):
        out = subprocess.run(
            [f"{venv}/bin/python", "-P", "-c", check],
            cwd="/",
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == want
    site = next(venv.glob("lib/python3*/site-packages"))
    assert not list((site / "transports").rglob("*.c"))  # no source for a runtime build
