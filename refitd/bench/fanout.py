"""``refitd bench fanout``: many replicas on many hosts, direct pulls vs host mirrors.

Simulated hosts (:mod:`refitd.bench.simhosts`): one trainer host and up to ``N``
engine hosts, each link (both directions of its veth) shaped with a ``tc`` token
bucket to ``--link-gbit`` (default 1 Gbit/s), so the link, not memory, is what is
shared. The trainer's daemon publishes a model of ``--mib`` MiB (one new version per
case). Every engine host runs two daemons, one with ``[mirrors] policy = "never"``
and one with ``"always"``, and ``--replicas`` engine replicas (2), each of which
leases the version at the trainer, pulls every byte through its host's daemon and
checks every byte.

Per ``N`` (1, 2, 4; 8 with ``--hosts 8``), in the same run: *direct* (every replica
reads the trainer) and *mirrored* (one mirror per host, relayed host to host):

- seconds from the start until every replica holds the version;
- bytes the trainer host sent on its link ÷ model bytes.

In the same run, one model's time over one link: the best of one and of four plain
TCP streams moving the model's bytes from the trainer host to the first engine host.

The last line::

    fanout_ratio_4=… direct_ratio_4=… uplink_ratio_4=… mirrored_n1_ratio=… verified=1

``fanout_ratio_4`` is mirrored seconds at N = 4 ÷ mirrored seconds at N = 1 (the
target is ≤ 1.3), ``direct_ratio_4`` the same for direct pulls (about N: the
trainer's link carries every replica's copy), ``uplink_ratio_4`` the trainer's
bytes ÷ model bytes at N = 4 mirrored (target ≤ 1.1), ``mirrored_n1_ratio`` the
mirrored seconds at N = 1 ÷ one model's time over one link (target ≤ 1.15),
``verified`` 1 when every replica of every case was bit-exact. With ``--hosts 8``
also ``fanout_ratio_8`` and ``uplink_ratio_8``. Where the mirrored time at N = 4 goes:
``first_done_ratio_4``, when the first mirror completed at N = 4 ÷ at N = 1 (the
start: every host making its mirror at once), and ``hop_lag_4``, the most any relay
completed after its upstream (s). Needs root, ``ip``, ``unshare``,
``nsenter`` and ``tc``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Case", "add_arguments", "fanout", "run"]

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=64, help="model size, MiB (default 64)")
    parser.add_argument(
        "--link-gbit", type=float, default=1.0, help="every host's link, Gbit/s (default 1)"
    )
    parser.add_argument(
        "--hosts", type=int, default=4, help="most engine hosts: 4 (N = 1, 2, 4) or 8 (adds 8)"
    )
    parser.add_argument("--replicas", type=int, default=2, help="replicas per host (default 2)")


def run(args: argparse.Namespace) -> int:
    import uvloop

    from refitd.bench.simhosts import missing

    why = missing()
    if why is None and shutil.which("tc") is None:
        why = "simulated links need `tc` (iproute2) on PATH"
    if why is not None:
        print(f"refitd bench fanout: cannot run here: {why}")
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_main(args))


@dataclass(frozen=True)
class Case:
    """One measured case: ``n`` engine hosts, ``mode`` direct or mirrored (``link``:
    one model over one link, ``n`` 1)."""

    n: int
    mode: str
    seconds: float
    uplink_ratio: float
    verified: bool
    paths: tuple[str, ...]
    #: mirrored: when the first mirror completed, s from the start
    first_done_s: float = 0.0
    #: mirrored: each relay's completion after its upstream's, s (the hops' lag)
    hop_lags_s: tuple[float, ...] = ()


def sizes(max_hosts: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= max_hosts]


async def _main(args: argparse.Namespace) -> int:
    nbytes = max(1, args.mib) * MIB
    t0 = time.perf_counter()
    print(
        f"refitd bench fanout: {nbytes / MIB:.0f} MiB model, links {args.link_gbit:g} Gbit/s, "
        f"{args.replicas} replicas per host, N = {sizes(args.hosts)}; host cores: "
        f"{os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cases = await fanout(Path(tmp), nbytes, args.link_gbit, args.hosts, args.replicas)
    ideal = nbytes * 8 / (args.link_gbit * 1e9)
    for c in cases:
        if c.mode == "link":
            print(f"one model over one link (best of 1 and 4 TCP streams): {c.seconds:7.3f} s")
            continue
        print(
            f"N={c.n} {c.mode:>8}: {c.seconds:7.3f} s until every replica holds it "
            f"({c.seconds / ideal:.2f}x one model over one link); trainer sent "
            f"{c.uplink_ratio:.3f}x the model; paths {'+'.join(c.paths)}; "
            f"{'verified' if c.verified else 'NOT VERIFIED'}"
        )
        if c.mode == "mirrored":
            print(
                f"N={c.n} mirrored: first mirror complete at {c.first_done_s:.3f} s; each relay "
                f"after its upstream: {' '.join(f'+{x:.3f}' for x in c.hop_lags_s) or '-'} s"
            )
    line = summary(cases)
    print(f"{time.perf_counter() - t0:.0f} s in all")
    print(" ".join(f"{k}={v}" for k, v in line.items()))
    return 0 if line["verified"] == "1" else 1


def summary(cases: list[Case]) -> dict[str, str]:
    """The last line's values from ``cases`` (ratios at the largest N up to 4)."""
    by = {(c.n, c.mode): c for c in cases}
    top = max(n for n, _ in by if n <= 4)
    out: dict[str, str] = {}
    for mode, key in (("mirrored", "fanout"), ("direct", "direct")):
        out[f"{key}_ratio_{top}"] = f"{by[top, mode].seconds / by[1, mode].seconds:.3f}"
    out[f"uplink_ratio_{top}"] = f"{by[top, 'mirrored'].uplink_ratio:.3f}"
    m1, mt = by[1, "mirrored"], by[top, "mirrored"]
    if m1.first_done_s > 0 and mt.first_done_s > 0:  # where N = top's extra time goes
        out[f"first_done_ratio_{top}"] = f"{mt.first_done_s / m1.first_done_s:.3f}"
        out[f"hop_lag_{top}"] = f"{max(mt.hop_lags_s, default=0.0):.3f}"
    if (1, "link") in by:
        out["mirrored_n1_ratio"] = f"{by[1, 'mirrored'].seconds / by[1, 'link'].seconds:.3f}"
    if (8, "mirrored") in by:
        out["fanout_ratio_8"] = f"{by[8, 'mirrored'].seconds / by[1, 'mirrored'].seconds:.3f}"
        out["uplink_ratio_8"] = f"{by[8, 'mirrored'].uplink_ratio:.3f}"
    out["verified"] = str(int(all(c.verified for c in cases)))
    return out


async def shape_both(net: Any, host: Any, gbit: float) -> None:
    """A token bucket of ``gbit`` on both directions of ``host``'s link: its ``eth0``
    (what it sends) and its bridge port (what it receives)."""
    burst = max(256 << 10, int(gbit * 1e9 / 8 / 250))
    port = f"p{host.address.rsplit('.', 1)[1]}"
    for ns, dev in ((host.netns, "eth0"), (net.switch, port)):
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{gbit}gbit", "burst", str(burst), "latency", "50ms",
        )  # fmt: skip
        if await proc.wait() != 0:
            raise RuntimeError(f"tc could not shape {host.name}'s link ({dev}) to {gbit} Gbit/s")


async def fanout(
    workdir: Path, nbytes: int, gbit: float, max_hosts: int, replicas: int
) -> list[Case]:
    """Every case, direct then mirrored per N, on one set of simulated hosts."""
    from refitd.bench.simhosts import Cluster, SimNet

    ns = sizes(max_hosts)
    cases: list[Case] = []
    async with SimNet() as net:
        trainer = await net.add_host("trainer")
        engines = [await net.add_host(f"e{i}") for i in range(ns[-1])]
        for h in [trainer, *engines]:
            await shape_both(net, h, gbit)
        async with Cluster(net, str(workdir)) as cluster:
            src = await cluster.daemon(trainer, "trainer")
            # One at a time: many interpreters starting at once on a small machine
            # miss the start deadline.
            direct, mirrored = [], []
            for h in engines:
                direct.append(await cluster.daemon(h, f"{h.name}-d"))
                mirrored.append(
                    await cluster.daemon(h, f"{h.name}-m", "--set", "mirrors.policy=always")
                )
            workers = [await _worker(cluster, h) for h in [trainer, *engines]]
            cases.append(await _link(trainer, engines[0], nbytes))
            tw, ew = workers[0], workers[1:]
            # Untimed: every process imports what it needs and opens its connections
            # (the first pull of a fresh worker and daemon costs seconds here), and
            # every host holds a mirror of a version of the model's size, as in a refit
            # loop after its first step (the next version's mirror takes its regions).
            version = 1
            await tw.call("publish", url=src.url, version=version, nbytes=nbytes)
            for i, w in enumerate(ew):
                for d in (direct[i], mirrored[i]):
                    await w.call("prepare", local=d.url, count=1, nbytes=nbytes)
                    warm = await w.call(
                        "replicas", local=d.url, source=src.url, version=1, count=1, nbytes=nbytes
                    )
                    check = await w.call("verify", version=1, nbytes=nbytes)
                    assert warm.get("ok") and check.get("verified"), (warm, check)
            for n in ns:
                for mode, daemons in (("direct", direct), ("mirrored", mirrored)):
                    version += 1
                    pub = await tw.call("publish", url=src.url, version=version, nbytes=nbytes)
                    assert pub["ok"], pub
                    for i in range(n):
                        await ew[i].call(
                            "prepare", local=daemons[i].url, count=replicas, nbytes=nbytes
                        )
                    sent = await _tx_bytes(trainer)
                    t = time.time()
                    outs = await asyncio.gather(
                        *(
                            ew[i].call(
                                "replicas",
                                local=daemons[i].url,
                                source=src.url,
                                version=version,
                                count=replicas,
                                nbytes=nbytes,
                            )
                            for i in range(n)
                        )
                    )
                    # until the last replica held the version (checking it comes after)
                    seconds = max(float(o.get("held_at", time.time())) for o in outs) - t
                    up = (await _tx_bytes(trainer) - sent) / nbytes
                    checks = await asyncio.gather(
                        *(ew[i].call("verify", version=version, nbytes=nbytes) for i in range(n))
                    )
                    ok = all(o.get("ok") for o in outs) and all(c.get("verified") for c in checks)
                    if not ok:
                        print(f"N={n} {mode}: NOT VERIFIED: {outs} {checks}")
                    paths = tuple(sorted({p for o in outs for p in o.get("paths", [])}))
                    if mode == "mirrored":
                        chain = await asyncio.gather(
                            *(
                                ew[i].call("mirror", url=daemons[i].url, version=version)
                                for i in range(n)
                            )
                        )
                        print(
                            f"N={n} mirrors: "
                            + "; ".join(
                                f"{engines[i].name} from {c.get('tried')} "
                                f"{c.get('began_at', 0) - t:.2f}-{c.get('completed_at', 0) - t:.2f} s"
                                for i, c in enumerate(chain)
                            )
                        )
                        first, lags = hops(chain, [d.url for d in daemons[:n]], t)
                        cases.append(Case(n, mode, seconds, up, ok, paths, first, lags))
                        continue
                    cases.append(Case(n, mode, seconds, up, ok, paths))
    return cases


def hops(chain: list[dict[str, Any]], urls: list[str], t: float) -> tuple[float, tuple[float, ...]]:
    """From the mirrors' states (``chain[i]`` the mirror at ``urls[i]``): when the first
    one completed (s after ``t``), and how long each mirror that read from another
    host's mirror completed after it (s; the relay hops' lag)."""
    done = {
        u.rstrip("/"): float(c.get("completed_at", 0)) for u, c in zip(urls, chain, strict=True)
    }
    lags = []
    for c in chain:
        tried = c.get("tried") or [""]
        up = str(tried[-1]).rstrip("/")
        if up in done:
            lags.append(float(c.get("completed_at", 0)) - done[up])
    return min(done.values()) - t, tuple(lags)


async def _link(a: Any, b: Any, nbytes: int) -> Case:
    """One model's time over one link from ``a`` to ``b``: the best of one and of four
    plain TCP streams moving ``nbytes``."""
    from refitd.bench.hostpaths import streams

    best = min([min(await streams(a, b, nbytes, 1, count)) for count in (1, 4)])
    return Case(1, "link", best, 0.0, True, ("tcp-stream",))


async def _worker(cluster: Any, host: Any) -> Any:
    from refitd.bench.simhosts import HostWorker

    proc = await host.exec(
        sys.executable,
        "-m",
        "refitd.bench.fanout",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    w = HostWorker(host, proc, cluster.token)
    cluster.stack.push_async_callback(w.close)
    return w


async def _tx_bytes(host: Any) -> int:
    proc = await host.exec(
        "cat", "/sys/class/net/eth0/statistics/tx_bytes", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return int(out)


# ---------------------------------------------------------------- the host worker


def pattern(n: int, version: int) -> Any:
    """``n`` bytes that differ from position to position and from version to version."""
    import numpy as np

    words = np.arange((n + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    words += np.uint64(version)
    return words.view(np.uint8)[:n]


class _Worker:
    def __init__(self) -> None:
        self.clients: dict[str, Any] = {}
        self.prepared: dict[str, list[Any]] = {}  # daemon URL -> regions made by prepare
        self.pulled: list[tuple[str, Any]] = []  # (daemon URL, region) pulled, unchecked

    async def client(self, url: str, token: str) -> Any:
        from refitd.client.http import RefitClient

        c = self.clients.get(url)
        if c is None:
            c = self.clients[url] = await RefitClient(url, token=token).__aenter__()
        return c

    async def publish(self, req: dict[str, Any]) -> dict[str, Any]:
        """Version ``version``: one uint8 tensor of ``nbytes`` in a new region."""
        from refitd.wire import ManifestIn, ShardEntry, TensorEntry
        from transports.segments import SharedSegment

        c = await self.client(req["url"], req["token"])
        n, version = int(req["nbytes"]), int(req["version"])
        region = await c.create_region(n, label=f"model-v{version}")
        seg = SharedSegment.attach(region.handle, n)
        seg.numpy()[:] = pattern(n, version)
        seg.close()
        t = TensorEntry("w", (n,), "uint8", [ShardEntry((0,), (n,), region.region_id, 0)])
        await c.publish(ManifestIn("fanout", version, 0, 1, [t]))
        return {"ok": True}

    async def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        """``count`` engine memories of ``nbytes`` at ``local``, every page touched (an
        engine's weights exist before a refit): made before the clock starts."""
        from transports.segments import SharedSegment

        local = await self.client(req["local"], req["token"])
        n = int(req["nbytes"])
        for _ in range(int(req["count"])):
            dst = await local.create_region(n, label="replica")
            seg = SharedSegment.attach(dst.handle, n)
            seg.numpy()[:] = 0
            seg.close()
            self.prepared.setdefault(req["local"], []).append(dst)
        return {"ok": True}

    async def replicas(self, req: dict[str, Any]) -> dict[str, Any]:
        """``count`` replicas at once, each leasing ``version`` at ``source`` and pulling
        it whole through ``local`` into memory :meth:`prepare` made. Answers the paths
        and when the last pull ended (``time.time()``: the simulated hosts share one
        clock); :meth:`verify` checks the bytes later, so that checking on one host
        does not take the CPU from pulls still running on another."""
        results = await asyncio.gather(*(self._replica(req) for _ in range(int(req["count"]))))
        return {
            "ok": True,
            "paths": sorted({p for p, _ in results}),
            "held_at": max(t for _, t in results),
        }

    async def _replica(self, req: dict[str, Any]) -> tuple[str, float]:
        import numpy as np

        from refitd.wire import DescriptorTable, PullRequest

        local = await self.client(req["local"], req["token"])
        source = await self.client(req["source"], req["token"])
        n, version = int(req["nbytes"]), int(req["version"])
        lease = await source.acquire_lease("fanout", version, 300.0)
        try:
            manifest = await source.manifest("fanout", version)
            shard = manifest.tensors[0].shards[0]
            dst = self.prepared[req["local"]].pop()
            self.pulled.append((req["local"], dst))
            rows = np.array([[shard.region, shard.byte_offset, dst.region_id, 0, n]], np.int64)
            pull = PullRequest(
                "fanout", version, lease.lease_id, DescriptorTable.pack(rows), [], req["source"]
            )
            done = await local.pull(pull)
            return str(done.path), time.time()
        finally:
            await source.release_lease(lease.lease_id)

    async def verify(self, req: dict[str, Any]) -> dict[str, Any]:
        """Whether every replica :meth:`replicas` pulled holds ``version`` bit for bit;
        their memory is freed."""
        import numpy as np

        from transports.segments import SharedSegment

        n, version = int(req["nbytes"]), int(req["version"])
        want = pattern(n, version)
        ok = bool(self.pulled)
        for url, dst in self.pulled:
            seg = SharedSegment.attach(dst.handle, n)
            try:
                ok = ok and bool(np.array_equal(seg.numpy(), want))
            finally:
                seg.close()
            await (await self.client(url, req["token"])).delete_region(dst.region_id)
        self.pulled.clear()
        return {"ok": True, "verified": ok}

    async def mirror(self, req: dict[str, Any]) -> dict[str, Any]:
        """The state of the mirror of ``version`` at the daemon ``url``."""
        import msgspec

        from refitd.wire import routes as api

        c = await self.client(req["url"], req["token"])
        st = await c.send(api.MIRROR_STATE, model="fanout", version=int(req["version"]))
        out: dict[str, Any] = msgspec.to_builtins(st)
        return out

    async def pulls(self, req: dict[str, Any]) -> dict[str, Any]:
        """The pulls the daemon ``url`` lists to this worker's principal."""
        import msgspec

        from refitd.wire import routes as api

        c = await self.client(req["url"], req["token"])
        return {"ok": True, "pulls": msgspec.to_builtins(await c.send(api.LIST_PULLS))}

    async def close(self) -> None:
        for c in self.clients.values():
            await c.__aexit__(None, None, None)


async def _serve() -> None:
    from refitd.errors import RefitError

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    worker = _Worker()
    try:
        while line := await reader.readline():
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                break
            ops = {
                "publish": worker.publish,
                "prepare": worker.prepare,
                "replicas": worker.replicas,
                "verify": worker.verify,
                "mirror": worker.mirror,
                "pulls": worker.pulls,
            }
            handler = ops.get(op or "")
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


def main() -> int:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
