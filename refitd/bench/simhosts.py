"""Simulated hosts on one machine: each a network namespace plus a mount namespace
with its own ``/dev/shm``, all joined by one bridge (tests and ``refitd bench hosts``).

Layout (every name starts with ``rfh<pid>-`` so stale ones of a dead run are found):

- a *switch* namespace holding the bridge ``br0``; nothing else listens there;
- per host, a namespace with ``lo`` and ``eth0`` (one end of a veth pair whose other
  end is a port of the bridge) at ``10.213.0.<n>/24``;
- per host, an *anchor* process that entered the host's network namespace, made a
  private mount namespace and mounted a fresh tmpfs on ``/dev/shm``; every process
  of that host joins both namespaces through ``nsenter --target <anchor>``.

Nothing is added to the machine's own network namespace, and traffic reaches only
the addresses of these hosts. :meth:`SimNet.close` (and leaving the ``async with``)
stops the anchors (so their mount namespaces and tmpfs go) and deletes every
namespace it made; the veth pairs and the bridge go with them. An anchor also ends
when its parent dies (its stdin pipe closes), and the next :class:`SimNet` removes
the namespaces of runs whose process is gone.

Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux);
:func:`missing` says which is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refitd.client.spawn import SpawnedDaemon

__all__ = [
    "HOST_ENV",
    "SUBNET",
    "Cluster",
    "HostWorker",
    "SimHost",
    "SimNet",
    "missing",
    "namespaces",
]

SUBNET = "10.213.0"
"""The hosts' /24: host ``n`` (from 1) is ``10.213.0.n``. Only reachable inside the
switch; each run has its own switch namespace, so concurrent runs do not collide."""

_TOOLS = ("ip", "unshare", "nsenter", "mount")

HOST_ENV = {"UCX_TLS": "^cma,sysv,posix,knem,xpmem"}
"""Environment of every daemon on a simulated host. The hosts share one kernel, so
UCX's shared-memory transports would still reach across them (``cma`` reads another
process's memory by pid, ``sysv`` segments live in the shared IPC namespace) and
UCX would silently pick them over the network; on separate machines they are
unreachable. Disabling them makes UCX between simulated hosts what it is between
real ones: tcp over the hosts' links."""
_STALE = re.compile(r"^rfh(\d+)-")


def missing() -> str | None:
    """Why simulated hosts cannot run here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and mount namespaces)"
    for tool in _TOOLS:
        if shutil.which(tool) is None:
            return f"simulated hosts need `{tool}` on PATH"
    # root alone is not enough: a container may refuse new namespaces (no CAP_SYS_ADMIN)
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "true"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return f"new network and mount namespaces are not allowed here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def namespaces() -> list[str]:
    """Names of every network namespace ``ip netns`` knows on this machine."""
    return [
        line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line.strip()
    ]


def remove_stale() -> list[str]:
    """Delete namespaces left by runs whose process is gone; returns their names."""
    gone = []
    for name in namespaces():
        m = _STALE.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


@dataclass
class SimHost:
    """One simulated host: its name, address and the anchor whose namespaces it is."""

    name: str
    netns: str
    address: str
    anchor: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.anchor.pid

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host (its network and mount namespaces)."""
        return ["nsenter", f"--target={self.pid}", "--net", "--mount", "--", *argv]

    async def exec(self, *argv: str, **kw: object) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(*self.wrap(list(argv)), **kw)  # type: ignore[arg-type]


@dataclass
class SimNet:
    """A bridge and the hosts on it; an async context manager that tears all down."""

    prefix: str = field(default_factory=lambda: f"rfh{os.getpid()}-{os.urandom(2).hex()}")
    hosts: dict[str, SimHost] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    async def __aenter__(self) -> SimNet:
        why = missing()
        if why is not None:
            raise RuntimeError(why)
        await asyncio.to_thread(remove_stale)
        await asyncio.to_thread(self._make_switch)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _make_switch(self) -> None:
        _ip("netns", "add", self.switch)
        self._namespaces.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _make_host(self, name: str, n: int) -> tuple[str, str]:
        ns = f"{self.prefix}-{name}"
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        port = f"p{n}"
        # Both ends are created inside namespaces of ours: nothing appears in the
        # machine's own namespace, not even for a moment.
        _ip(
            "-n",
            ns,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.switch,
        )
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        address = f"{SUBNET}.{n}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns, address

    async def add_host(self, name: str, *, shm_size: str = "50%") -> SimHost:
        """A new host named ``name`` (letters, digits, ``-``) with a private ``/dev/shm``
        (a tmpfs of ``shm_size``, tmpfs syntax); returns once its namespaces exist."""
        if not re.fullmatch(r"[a-z0-9-]{1,12}", name) or name in self.hosts or name == "sw":
            raise ValueError(f"host name {name!r} refused: 1-12 of [a-z0-9-], unique, not 'sw'")
        n = len(self.hosts) + 1
        ns, address = await asyncio.to_thread(self._make_host, name, n)
        script = (
            f"mount -t tmpfs -o size={shm_size},mode=1777 refitd-shm /dev/shm && "
            "echo up && exec cat >/dev/null"
        )
        anchor = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns,
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert anchor.stdout is not None
        async with asyncio.timeout(30):
            line = await anchor.stdout.readline()
        if line.strip() != b"up":
            await anchor.wait()
            raise RuntimeError(f"host {name}: private /dev/shm could not be mounted")
        host = SimHost(name, ns, address, anchor)
        self.hosts[name] = host
        return host

    async def close(self) -> None:
        """Stop every anchor and delete every namespace made here (idempotent)."""
        for host in self.hosts.values():
            proc = host.anchor
            if proc.returncode is None:
                if proc.stdin is not None:
                    proc.stdin.close()
                try:
                    async with asyncio.timeout(5):
                        await proc.wait()
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        self.hosts.clear()
        names, self._namespaces = self._namespaces, []
        for ns in reversed(names):
            await asyncio.to_thread(_ip, "netns", "del", ns, check=False)


# ---------------------------------------------------------------- daemons and workers


class HostWorker:
    """A :mod:`refitd.bench.hostwork` process on a host: one JSON request, one answer."""

    def __init__(self, host: SimHost, proc: asyncio.subprocess.Process, token: str) -> None:
        self.host = host
        self.proc = proc
        self.token = token

    async def call(self, op: str, timeout_s: float = 300.0, **req: object) -> dict[str, object]:
        import json

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "token": self.token, **req}).encode() + b"\n")
        await self.proc.stdin.drain()
        async with asyncio.timeout(timeout_s):
            line = await self.proc.stdout.readline()
        if not line:
            code = await self.proc.wait()
            raise RuntimeError(f"worker on {self.host.name} exited ({code}) during {op!r}")
        out: dict[str, object] = json.loads(line)
        return out

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(ConnectionError):
                self.proc.stdin.write(b'{"op": "quit"}\n')
                await self.proc.stdin.drain()
            try:
                async with asyncio.timeout(30):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def serve_worker(worker: Any, ops: tuple[str, ...]) -> int:
    """Run ``worker`` as the process a :class:`HostWorker` talks to: one JSON request
    a line on stdin, its answer a line on stdout, ``op`` naming one of ``worker``'s
    methods in ``ops`` (another is answered ``ProtocolError``; a refusal a method
    raises is answered as its class and detail), until ``quit`` or end of input; then
    ``worker.close()``."""
    import json

    import uvloop

    from refitd.errors import RefitError

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while line := await reader.readline():
                req = json.loads(line)
                op = req.get("op")
                if op == "quit":
                    break
                handler = getattr(worker, op, None) if op in ops else None
                out: dict[str, Any]
                if handler is None:
                    out = {"ok": False, "error": "ProtocolError", "detail": op}
                else:
                    try:
                        out = await handler(req)
                    except RefitError as exc:
                        out = {"ok": False, "error": type(exc).__name__, "detail": str(exc)}
                sys.stdout.write(json.dumps(out) + "\n")
                sys.stdout.flush()
        finally:
            with contextlib.suppress(RefitError):
                await worker.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve())
    return 0


@dataclass
class Cluster:
    """Daemons and workers on the hosts of ``net``, sharing one deployment secret and
    one bearer token (files under ``workdir``, mode 0600). Everything started here
    stops when the cluster's ``async with`` block ends."""

    net: SimNet
    workdir: str
    token: str = field(default_factory=lambda: os.urandom(16).hex())
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    def __post_init__(self) -> None:
        from pathlib import Path

        d = Path(self.workdir)
        self.secret_file = d / "secret"
        self.secret_file.write_text(os.urandom(32).hex())
        self.token_file = d / "tokens"
        self.token_file.write_text(f"cluster {self.token}\n")
        for f in (self.secret_file, self.token_file):
            f.chmod(0o600)

    async def __aenter__(self) -> Cluster:
        await self.stack.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stack.aclose()

    def serve_args(self, *extra: str) -> list[str]:
        return [
            "--set",
            f"server.token_file={self.token_file}",
            "--set",
            f"server.peer_token_file={self.token_file}",
            # every daemon of the cluster trusts every host of it, on any port
            "--set",
            "peers.allow=" + ",".join(f"http://{h.address}:*" for h in self.net.hosts.values()),
            *extra,
        ]

    @contextlib.asynccontextmanager
    async def daemon_cm(
        self, host: SimHost, node_id: str, *extra: str, transport: str = "auto"
    ) -> AsyncIterator[SpawnedDaemon]:
        """A ``refitd serve`` on ``host`` at its address (any free port)."""
        from refitd.client.spawn import spawn_daemon

        async with spawn_daemon(
            secret_file=str(self.secret_file),
            transport=transport,
            node_id=node_id,
            host=host.address,
            extra_args=self.serve_args(*extra),
            prefix=host.wrap([]),
            env=HOST_ENV,
        ) as d:
            yield d

    async def daemon(
        self, host: SimHost, node_id: str, *extra: str, transport: str = "auto"
    ) -> SpawnedDaemon:
        """:meth:`daemon_cm`, stopped when the cluster closes."""
        return await self.stack.enter_async_context(
            self.daemon_cm(host, node_id, *extra, transport=transport)
        )

    async def worker(self, host: SimHost) -> HostWorker:
        import sys

        proc = await host.exec(
            sys.executable,
            "-m",
            "refitd.bench.hostwork",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        w = HostWorker(host, proc, self.token)
        self.stack.push_async_callback(w.close)
        return w
