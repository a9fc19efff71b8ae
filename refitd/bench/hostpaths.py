"""The cross-host part of ``refitd bench hosts``: one refit over each data path,
against what the link carries, quiet and busy.

Two simulated hosts (:mod:`refitd.bench.simhosts`), A the source, B the reader. On
them, in one run:

- the **link**: plain TCP streams from A to B, 1 and 4 at once (``socket.sendall``
  into ``recv_into``); ``link_gbps`` is the best of both, the most the link was
  seen to carry;
- the **paths**: daemon pairs in ``auto`` mode (which picks ``tcp`` here: the hosts
  share no memory and the UCX wheel has no RDMA), forced ``ucx`` (UCX over tcp), and
  forced ``tcp`` readers with 1 and 2 lanes; each pulls the same ``nbytes`` from a
  source region on A, as 1 MiB pieces (and, over ``auto``, as scattered 4 KiB
  pieces), every byte checked;
- **busy**: the ``auto`` and ``ucx`` pulls again while two CPU-bound processes run on
  host A (started and stopped here), as a trainer host's data loaders would.

Also measured: the CPU seconds the source host's daemon (with its children) spent
per GB pulled, per path. With ``link_gbit`` each host's veth is shaped with ``tc``
(token bucket) to that rate first, so the pull can be compared with a link of
known size. Every figure is the best of ``repeat`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MIB", "PathRuns", "cross_host"]

MIB = 1 << 20
SCATTERED = 4 << 10

_RECEIVER = """
import json, socket, sys, threading, time
host, n, repeat, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket()
s.bind((host, 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
share = n // streams
bufs = [memoryview(bytearray(share)) for _ in range(streams)]
def take(c, buf, got):
    k = 0
    while k < share:
        r = c.recv_into(buf[k:], min(share - k, 1 << 22))
        if not r:
            break
        k += r
    got.append(k)
out = []
for _ in range(repeat):
    conns = [s.accept()[0] for _ in range(streams)]
    got = []
    t = time.perf_counter()
    ts = [threading.Thread(target=take, args=(c, b, got)) for c, b in zip(conns, bufs)]
    for th in ts: th.start()
    for c in conns: c.sendall(b"g")
    for th in ts: th.join()
    out.append(time.perf_counter() - t if sum(got) == share * streams else -1.0)
    for c in conns: c.sendall(b"k"); c.close()
print(json.dumps(out), flush=True)
"""

_SENDER = """
import socket, sys, threading
host, port, n, repeat, streams = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                  int(sys.argv[4]), int(sys.argv[5]))
data = memoryview(bytearray(n // streams))
def send(c):
    c.recv(1)
    c.sendall(data)
    c.recv(1)
    c.close()
for _ in range(repeat):
    conns = [socket.create_connection((host, port)) for _ in range(streams)]
    ts = [threading.Thread(target=send, args=(c,)) for c in conns]
    for t in ts: t.start()
    for t in ts: t.join()
"""

_BURNER = "while True:\n    pass\n"


@dataclass
class PathRuns:
    """One case: seconds of each run, the path the pulls took, bytes checked, and the
    source host's daemon CPU seconds over all runs."""

    seconds: list[float]
    paths: list[str]
    verified: bool
    cpu_s: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes * len(self.seconds) / 1e9)


@dataclass
class CrossHost:
    """Everything the cross-host part measured (GB/s are 10^9 bytes per second)."""

    nbytes: int
    link_1: list[float] = field(default_factory=list)  # seconds per run, 1 stream
    link_4: list[float] = field(default_factory=list)  # 4 streams
    cases: dict[str, PathRuns] = field(default_factory=dict)
    link_gbit: float = 0.0

    @property
    def link_gbps(self) -> float:
        return self.nbytes / min(self.link_1 + self.link_4) / 1e9


def cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of ``pid`` and every live descendant (``/proc``; the
    simulated hosts share the machine's pid namespace)."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = fields
        kids.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / tick
        todo.extend(kids.get(p, []))
    return total


async def shape(host: Any, gbit: float) -> None:
    """A token bucket of ``gbit`` Gbit/s on ``host``'s veth (notes/hosts.md)."""
    burst = max(256 << 10, int(gbit * 1e9 / 8 / 250))
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
        "rate", f"{gbit}gbit", "burst", str(burst), "latency", "50ms",
    )  # fmt: skip
    if await proc.wait() != 0:
        raise RuntimeError(f"tc could not shape {host.name}'s link to {gbit} Gbit/s")


@contextlib.asynccontextmanager
async def busy(host: Any, n: int = 2) -> AsyncIterator[None]:
    """``n`` CPU-bound processes on ``host`` for the block."""
    procs = [await host.exec(sys.executable, "-c", _BURNER) for _ in range(n)]
    try:
        await asyncio.sleep(0.5)  # let them take their cores
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()


async def streams(a: Any, b: Any, nbytes: int, repeat: int, count: int) -> list[float]:
    """Seconds of each of ``repeat`` runs of ``count`` TCP streams moving ``nbytes``
    in all from a to b."""
    recv = await b.exec(
        sys.executable, "-c", _RECEIVER, b.address, str(nbytes), str(repeat), str(count),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert recv.stdout is not None
    port = int(await recv.stdout.readline())
    send = await a.exec(
        sys.executable, "-c", _SENDER, b.address, str(port), str(nbytes), str(repeat), str(count)
    )
    if await send.wait() != 0:
        raise RuntimeError("the TCP sender failed")
    out: list[float] = json.loads(await recv.stdout.readline())
    await recv.wait()
    if min(out) < 0:
        raise RuntimeError("a TCP stream ended short")
    return out


async def cross_host(
    workdir: Path, nbytes: int, repeat: int, link_gbit: float = 0.0, log: Any = print
) -> CrossHost:
    from refitd.bench.simhosts import Cluster, SimNet

    out = CrossHost(nbytes, link_gbit=link_gbit)
    async with SimNet() as net:
        a, b = await net.add_host("a"), await net.add_host("b")
        if link_gbit:
            for h in (a, b):
                await shape(h, link_gbit)
        async with Cluster(net, str(workdir)) as cluster:
            src = {
                "auto": await cluster.daemon(a, "host-a"),
                "ucx": await cluster.daemon(a, "host-a-ucx", transport="ucx"),
            }
            readers = {
                "auto": await cluster.daemon(b, "host-b"),
                "ucx": await cluster.daemon(b, "host-b-ucx", transport="ucx"),
                "lanes1": await cluster.daemon(
                    b, "host-b-l1", "--set", "data_plane.lanes=1", transport="tcp"
                ),
                "lanes2": await cluster.daemon(
                    b, "host-b-l2", "--set", "data_plane.lanes=2", transport="tcp"
                ),
            }
            wa, wb = await cluster.worker(a), await cluster.worker(b)
            regions = {}
            for key, d in src.items():
                got = await wa.call("source", url=d.url, model="blob", nbytes=nbytes)
                assert got["ok"], got
                regions[key] = int(got["region"])  # type: ignore[call-overload]

            async def case(name: str, reader: str, piece: int) -> None:
                source = "ucx" if reader == "ucx" else "auto"
                d = src[source]
                before = cpu_seconds(d.pid)
                got = await wb.call(
                    "pull_bytes", local=readers[reader].url, source=d.url, model="blob",
                    region=regions[source], nbytes=nbytes, repeat=repeat, piece=piece,
                )  # fmt: skip
                assert got["ok"], got
                runs = PathRuns(
                    list(got["seconds"]),  # type: ignore[call-overload]
                    list(got["paths"]),  # type: ignore[call-overload]
                    bool(got["verified"]),
                    cpu_seconds(d.pid) - before,
                    nbytes,
                )
                out.cases[name] = runs
                log(
                    f"  {name:<14} path {'+'.join(runs.paths):<4} best {runs.gbps:.3f} GB/s, "
                    f"source host CPU {runs.cpu_s_per_gb:.2f} s/GB"
                    + ("" if runs.verified else ", bytes MISMATCH")
                )

            out.link_1 = await streams(a, b, nbytes, repeat, 1)
            out.link_4 = await streams(a, b, nbytes, repeat, 4)
            log(f"  link: best of 1 and 4 TCP streams {out.link_gbps:.3f} GB/s")
            await case("auto", "auto", MIB)
            await case("ucx", "ucx", MIB)
            await case("auto_4k", "auto", SCATTERED)
            await case("lanes1", "lanes1", MIB)
            await case("lanes2", "lanes2", MIB)
            async with busy(a):
                await case("auto_busy", "auto", MIB)
                await case("ucx_busy", "ucx", MIB)
    return out
