"""The cases of ``refitd bench fanout``, run on one fleet of simulated hosts.

A :class:`Fleet` is one trainer host and engine hosts ``e0``, ``e1``, … of
:mod:`refitd.bench.simhosts`, each host's link shaped both ways with a ``tc`` token
bucket (:func:`shape_both`); the trainer's daemon; per engine host a daemon with
``[mirrors] policy = "never"`` (*direct*, left out by :func:`faults`) and one with
``"always"`` (*mirrored*); and a host worker per host (:mod:`refitd.bench.fanoutwork`).
Every case is made of *rounds* (:meth:`Fleet.round`): the trainer publishes a new
version of the model (one ``uint8`` tensor), the first ``N`` engine hosts pull it at
once, ``replicas`` replicas each through one of their daemons, and every replica is
then checked byte for byte.

- *direct* at ``N``: one round through the direct daemons;
- *mirrored* at ``N``: an untimed round through exactly those ``N`` hosts' mirrored
  daemons, then the timed one. As in a refit loop after its first step with that
  fleet, the source's holder book has seen exactly these hosts hold the version
  before the timed one (what it deals the next version's chunks on), and each host
  holds a mirror the next version takes the regions of;
- *straggler* at ``N``: the mirrored case with one host's link (both directions)
  shaped to a quarter of the others', its own untimed round under that shaping
  first, so the book has seen the host slow; the link is restored after it;
- *kill* at ``N``: the mirrored case with one host's mirrored daemon SIGKILLed once
  its mirror holds half its chunks (watched through the trainer's worker); the other
  hosts must end exact;
- *restarted* at ``N``: that daemon started again on its host (same name and
  configuration, a new port), then one more round of all ``N`` hosts: its replicas
  must refit that version exactly.

Times are wall-clock seconds from the round's start (the simulated hosts share one
clock) until a host's last replica held the version; checking the bytes comes after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "MIB",
    "Case",
    "Fleet",
    "HostRun",
    "fanout",
    "faults",
    "hops",
    "open_fleet",
    "shape_both",
    "sizes",
    "start_worker",
]

MIB = 1 << 20


@dataclass(frozen=True)
class HostRun:
    """One engine host in one round. Holders are named by host (``trainer`` for the
    source); times are seconds from the round's start."""

    name: str
    #: when its last replica held the version (0: it never did)
    held_s: float
    #: every replica of it held the version bit for bit
    exact: bool
    #: mirrored: chunks its mirror read from each holder, by holder name
    reads: tuple[tuple[str, int], ...] = ()
    #: mirrored: chunks asked again of another holder after theirs failed, stopped or
    #: was slow
    reasked: int = 0
    #: mirrored: the holders it was told to read, in order
    tried: tuple[str, ...] = ()
    #: mirrored: when its mirror began and completed (0: not seen)
    began_s: float = 0.0
    completed_s: float = 0.0


@dataclass(frozen=True)
class Case:
    """One measured case: ``n`` engine hosts; ``mode`` direct, mirrored, straggler,
    kill, restarted, or ``link`` (one model over one link, ``n`` 1). ``seconds``
    until every replica held the version (kill: every replica of the hosts not
    killed); ``verified``: every replica exact, in the case's untimed rounds too
    (kill: the killed host's replicas aside)."""

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
    #: every engine host of the timed round, in host order
    hosts: tuple[HostRun, ...] = ()
    #: straggler, kill, restarted: the host slowed, killed or restarted
    faulted: str = ""
    #: what was done to it, in words
    note: str = ""

    def others_s(self, name: str) -> float:
        """When the last replica of every host but ``name`` held the version."""
        return max((h.held_s for h in self.hosts if h.name != name), default=0.0)


def sizes(max_hosts: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= max_hosts]


def hops(hosts: tuple[HostRun, ...]) -> tuple[float, tuple[float, ...]]:
    """From the mirrored hosts of one round: when the first mirror completed, and how
    long each mirror that last read another host's mirror completed after it (s; the
    relay hops' lag)."""
    done = {h.name: h.completed_s for h in hosts if h.completed_s > 0}
    lags = tuple(
        h.completed_s - done[h.tried[-1]]
        for h in hosts
        if h.completed_s > 0 and h.tried and h.tried[-1] in done
    )
    return min(done.values(), default=0.0), lags


async def shape_both(net: Any, host: Any, gbit: float) -> None:
    """A token bucket of ``gbit`` on both directions of ``host``'s link: its ``eth0``
    (what it sends) and its bridge port (what it receives). Replaces the bucket the
    link had, so a link is shaped again the same way."""
    burst = max(256 << 10, int(gbit * 1e9 / 8 / 250))
    port = f"p{host.address.rsplit('.', 1)[1]}"
    for ns, dev in ((host.netns, "eth0"), (net.switch, port)):
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{gbit}gbit", "burst", str(burst), "latency", "50ms",
        )  # fmt: skip
        if await proc.wait() != 0:
            raise RuntimeError(f"tc could not shape {host.name}'s link ({dev}) to {gbit} Gbit/s")


async def start_worker(cluster: Any, host: Any) -> Any:
    """A :mod:`refitd.bench.fanoutwork` process on ``host``, closed with ``cluster``."""
    from refitd.bench.simhosts import HostWorker

    proc = await host.exec(
        sys.executable,
        "-m",
        "refitd.bench.fanoutwork",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    w = HostWorker(host, proc, cluster.token)
    cluster.stack.push_async_callback(w.close)
    return w


async def _mirrored_daemon(cluster: Any, host: Any) -> Any:
    return await cluster.daemon(host, f"{host.name}-m", "--set", "mirrors.policy=always")


async def _tx_bytes(host: Any) -> int:
    proc = await host.exec(
        "cat", "/sys/class/net/eth0/statistics/tx_bytes", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return int(out)


async def _link(a: Any, b: Any, nbytes: int) -> Case:
    """One model's time over one link from ``a`` to ``b``: the best of one and of four
    plain TCP streams moving ``nbytes``."""
    from refitd.bench.hostpaths import streams

    best = min([min(await streams(a, b, nbytes, 1, count)) for count in (1, 4)])
    return Case(1, "link", best, 0.0, True, ("tcp-stream",))


@dataclass(frozen=True)
class Round:
    """One version pulled by the first ``len(hosts)`` engine hosts at once."""

    seconds: float
    uplink_ratio: float
    verified: bool
    paths: tuple[str, ...]
    hosts: tuple[HostRun, ...]
    note: str = ""


@dataclass
class Fleet:
    """The hosts, daemons and workers of one run (see the module's docstring)."""

    net: Any
    cluster: Any
    trainer: Any
    engines: list[Any]
    src: Any
    direct: list[Any]
    mirrored: list[Any]
    trainer_worker: Any
    workers: list[Any]
    nbytes: int
    gbit: float
    replicas: int
    version: int = 0
    #: daemon URL -> its host's name (``trainer`` for the source)
    names: dict[str, str] = field(default_factory=dict)

    def name(self, url: str) -> str:
        return self.names.get(url.rstrip("/"), url)

    async def warm_up(self) -> None:
        """Untimed: every engine host pulls one version of the model's size through
        each of its daemons, one host at a time, so every process has imported what
        it needs and opened its connections (the first pull of a fresh worker and
        daemon costs seconds here), and every mirrored daemon holds a mirror the next
        version takes the regions of."""
        self.version += 1
        tw, nbytes, v = self.trainer_worker, self.nbytes, self.version
        assert (await tw.call("publish", url=self.src.url, version=v, nbytes=nbytes))["ok"]
        for i, w in enumerate(self.workers):
            for d in (*self.direct[i : i + 1], self.mirrored[i]):
                await w.call("prepare", local=d.url, count=1, nbytes=nbytes)
                warm = await w.call(
                    "replicas", local=d.url, source=self.src.url, version=v, count=1, nbytes=nbytes
                )
                check = await w.call("verify", version=v, nbytes=nbytes)
                assert warm.get("ok") and check.get("verified"), (warm, check)

    async def round(self, n: int, mirrored: bool, kill: str = "") -> Round:
        """A new version pulled at once by the first ``n`` engine hosts, through their
        mirrored daemons or their direct ones; ``kill``: the host whose mirrored daemon
        is SIGKILLed once its mirror holds half its chunks."""
        daemons = self.mirrored if mirrored else self.direct
        tw, ew, nbytes = self.trainer_worker, self.workers[:n], self.nbytes
        self.version += 1
        v = self.version
        pub = await tw.call("publish", url=self.src.url, version=v, nbytes=nbytes)
        assert pub["ok"], pub
        for i, w in enumerate(ew):
            await w.call("prepare", local=daemons[i].url, count=self.replicas, nbytes=nbytes)
        k = next(i for i, h in enumerate(self.engines) if h.name == kill) if kill else -1
        sent = await _tx_bytes(self.trainer)
        t = time.time()
        calls = [
            asyncio.create_task(
                w.call(
                    "replicas",
                    local=daemons[i].url,
                    source=self.src.url,
                    version=v,
                    count=self.replicas,
                    nbytes=nbytes,
                )
            )
            for i, w in enumerate(ew)
        ]
        note = ""
        last: dict[str, Any] = {}  # the killed host's mirror as last seen
        try:
            if k >= 0:
                note, last = await self._kill_at_half(daemons[k], v, calls[k], t)
            outs = await asyncio.gather(*calls)
        finally:
            for c in calls:
                c.cancel()
        up = (await _tx_bytes(self.trainer) - sent) / nbytes
        checks = await asyncio.gather(
            *(
                w.call("forget", url=daemons[i].url)
                if i == k
                else w.call("verify", version=v, nbytes=nbytes)
                for i, w in enumerate(ew)
            )
        )
        states: list[dict[str, Any]] = [{} for _ in ew]
        if mirrored:  # the killed host's: the last one seen before the kill
            got = iter(
                await asyncio.gather(
                    *(
                        w.call("mirror", url=daemons[i].url, version=v)
                        for i, w in enumerate(ew)
                        if i != k
                    )
                )
            )
            states = [last if i == k else next(got) for i in range(n)]
        hosts = tuple(
            self._host_run(self.engines[i].name, t, o, c, st)
            for i, (o, c, st) in enumerate(zip(outs, checks, states, strict=True))
        )
        ok = all(h.exact for i, h in enumerate(hosts) if i != k)
        if not ok:
            print(f"N={n} (version {v}): NOT VERIFIED: {outs} {checks}")
        paths = tuple(sorted({p for i, o in enumerate(outs) if i != k for p in o.get("paths", [])}))
        seconds = max(h.held_s for i, h in enumerate(hosts) if i != k)
        return Round(seconds, up, ok, paths, hosts, note)

    def _host_run(
        self, name: str, t: float, out: dict[str, Any], check: dict[str, Any], st: dict[str, Any]
    ) -> HostRun:
        held = float(out["held_at"]) - t if out.get("ok") and "held_at" in out else 0.0
        began, completed = float(st.get("began_at", 0)), float(st.get("completed_at", 0))
        reads = sorted((self.name(u), int(c)) for u, c in (st.get("reads") or {}).items())
        return HostRun(
            name,
            held,
            bool(out.get("ok") and check.get("verified")),
            tuple(reads),
            int(st.get("reasked", 0)),
            tuple(self.name(str(u)) for u in st.get("tried") or ()),
            began - t if began else 0.0,
            completed - t if completed else 0.0,
        )

    async def _kill_at_half(
        self, d: Any, version: int, call: asyncio.Task[Any], t: float
    ) -> tuple[str, dict[str, Any]]:
        """SIGKILL the daemon ``d`` once its mirror of ``version`` holds half its
        chunks (or its replicas' pulls ended first); returns what was done, in words,
        and the mirror's last state seen."""
        deadline = time.monotonic() + 120.0  # a safety net, not a measure
        st: dict[str, Any] = {}
        done = total = 0
        while not call.done():
            st = await self.trainer_worker.call("mirror", url=d.url, version=version)
            done, total = int(st.get("chunks_done", 0)), int(st.get("chunks_total", 0))
            if total and 2 * done >= total:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the mirror at {d.url} held {done}/{total} chunks after 120 s")
            await asyncio.sleep(0.005)
        os.kill(d.pid, signal.SIGKILL)
        when = f"{self.name(d.url)}'s mirrored daemon killed at {time.time() - t:.2f} s"
        if call.done():
            return f"{when}, after its replicas held the version", st
        return f"{when}, its mirror holding {done}/{total} chunks", st

    def _case(self, n: int, mode: str, r: Round, *more: Round, faulted: str = "") -> Case:
        first, lags = hops(r.hosts)
        ok = r.verified and all(m.verified for m in more)
        return Case(
            n, mode, r.seconds, r.uplink_ratio, ok, r.paths, first, lags, r.hosts, faulted, r.note
        )

    async def direct_case(self, n: int) -> Case:
        r = await self.round(n, mirrored=False)
        return Case(n, "direct", r.seconds, r.uplink_ratio, r.verified, r.paths, hosts=r.hosts)

    async def mirrored_case(self, n: int) -> Case:
        warm = await self.round(n, mirrored=True)  # the book sees exactly these n hosts
        return self._case(n, "mirrored", await self.round(n, mirrored=True), warm)

    async def fault_cases(self, plain: Case) -> list[Case]:
        """The straggler, kill and restarted cases at ``plain.n``, the plain mirrored
        case of this run: the straggler is the host whose mirror completed first in
        it, the killed host the one in the middle of their order (not the first)."""
        n = plain.n
        order = sorted(plain.hosts, key=lambda h: (h.completed_s or h.held_s, h.name))
        slow, victim = order[0].name, order[n // 2].name
        host = next(h for h in self.engines if h.name == slow)
        await shape_both(self.net, host, self.gbit / 4)
        try:
            warm = await self.round(n, mirrored=True)  # the book sees it slow
            r = await self.round(n, mirrored=True)
        finally:
            await shape_both(self.net, host, self.gbit)
        r = replace(r, note=f"{slow}'s link at {self.gbit / 4:g} Gbit/s, a quarter of the others'")
        cases = [self._case(n, "straggler", r, warm, faulted=slow)]
        warm = await self.round(n, mirrored=True)  # the book sees every link whole again
        r = await self.round(n, mirrored=True, kill=victim)
        cases.append(self._case(n, "kill", r, warm, faulted=victim))
        k = next(i for i, h in enumerate(self.engines) if h.name == victim)
        d = self.mirrored[k] = await _mirrored_daemon(self.cluster, self.engines[k])
        self.names[d.url.rstrip("/")] = victim
        r = await self.round(n, mirrored=True)
        r = replace(r, note=f"{victim}'s mirrored daemon started again, at {d.url}")
        cases.append(self._case(n, "restarted", r, faulted=victim))
        return cases


@contextlib.asynccontextmanager
async def open_fleet(
    workdir: Path, nbytes: int, gbit: float, hosts: int, replicas: int, *, direct: bool = True
) -> AsyncIterator[Fleet]:
    """A trainer host and ``hosts`` engine hosts with their daemons and workers (no
    direct daemons when ``direct`` is false); all gone when the block ends."""
    from refitd.bench.simhosts import Cluster, SimNet

    async with SimNet() as net:
        trainer = await net.add_host("trainer")
        engines = [await net.add_host(f"e{i}") for i in range(hosts)]
        for h in [trainer, *engines]:
            await shape_both(net, h, gbit)
        async with Cluster(net, str(workdir)) as cluster:
            src = await cluster.daemon(trainer, "trainer")
            # One at a time: many interpreters starting at once on a small machine
            # miss the start deadline.
            ds, ms = [], []
            for h in engines:
                if direct:
                    ds.append(await cluster.daemon(h, f"{h.name}-d"))
                ms.append(await _mirrored_daemon(cluster, h))
            workers = [await start_worker(cluster, h) for h in [trainer, *engines]]
            fleet = Fleet(
                net,
                cluster,
                trainer,
                engines,
                src,
                ds,
                ms,
                workers[0],
                workers[1:],
                nbytes,
                gbit,
                replicas,
            )
            fleet.names[src.url.rstrip("/")] = "trainer"
            for h, d in zip(engines, ms, strict=True):
                fleet.names[d.url.rstrip("/")] = h.name
            for h, d in zip(engines, ds, strict=False):
                fleet.names[d.url.rstrip("/")] = f"{h.name}-d"
            yield fleet


async def fanout(
    workdir: Path, nbytes: int, gbit: float, max_hosts: int, replicas: int, faults_at: int = 0
) -> list[Case]:
    """Every case on one fleet: one model over one link, then direct and mirrored per
    ``N`` of :func:`sizes`; then, when ``faults_at`` is one of those ``N`` (2 or more),
    the straggler, kill and restarted cases at that ``N``."""
    ns = sizes(max_hosts)
    if faults_at and (faults_at < 2 or faults_at not in ns):
        raise ValueError(f"faults at N = {faults_at}: it must be one of {ns[1:]}")
    cases: list[Case] = []
    async with open_fleet(workdir, nbytes, gbit, ns[-1], replicas) as fleet:
        cases.append(await _link(fleet.trainer, fleet.engines[0], nbytes))
        await fleet.warm_up()
        for n in ns:
            cases.append(await fleet.direct_case(n))
            cases.append(await fleet.mirrored_case(n))
        if faults_at:
            plain = next(c for c in cases if (c.n, c.mode) == (faults_at, "mirrored"))
            cases += await fleet.fault_cases(plain)
    return cases


async def faults(workdir: Path, nbytes: int, gbit: float, n: int, replicas: int) -> list[Case]:
    """The plain mirrored case at ``n`` (2 or more) engine hosts, then its straggler,
    kill and restarted cases, on a fleet of mirrored daemons only."""
    if n < 2:
        raise ValueError(f"faults at N = {n}: a straggler or a kill needs another host")
    async with open_fleet(workdir, nbytes, gbit, n, replicas, direct=False) as fleet:
        await fleet.warm_up()
        plain = await fleet.mirrored_case(n)
        return [plain, *await fleet.fault_cases(plain)]
