"""``refitd bench refit`` and the daemon demo: trainer → two daemons → engine refit.

The trainer side (publishing a layout, the capture for it, the trainer process) is
:mod:`refitd.bench.trainer`; :func:`publish_layout` and :func:`capture_for`, which
the end-to-end tests use too, are importable from here as well. The model it moves,
and the bit-exact check, are :mod:`refitd.bench.synthetic`'s.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refitd.bench.conditions import Faults, SegmentMemcpy, cpu_waited_us, faults
from refitd.bench.synthetic import model_bytes, synthetic_config, verify_ranks
from refitd.bench.trainer import capture_for, publish_layout

if TYPE_CHECKING:
    from refitd.client.http import RefitClient

__all__ = ["add_arguments", "capture_for", "publish_layout", "refit_flow", "run", "run_demo"]


# ---------------------------------------------------------------- the engine side


@dataclass
class VersionResult:
    version: int
    bytes: int
    seconds: float
    control_s: float
    replayed: bool
    verified: bool
    paths: tuple[str, ...] = ()  # data paths the pulls took ("shm", "ucx")
    memcpy_gbps: float = 0.0  # measured right after this version, on the same bytes
    breakdown: dict[str, float] = field(default_factory=dict)  # where the seconds went
    #: page faults taken during the pull, per process: "engine daemon" (the puller),
    #: "source daemon", "engine" (this process)
    faults: dict[str, Faults] = field(default_factory=dict)
    #: share of the pull's wall time some task of the host waited for a CPU (nan:
    #: the kernel reports no pressure)
    cpu_pressure: float = float("nan")

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def ratio(self) -> float:
        """This version's bandwidth ÷ the memcpy measured beside it."""
        return self.gbps / self.memcpy_gbps if self.memcpy_gbps else float("nan")


@dataclass
class FlowResult:
    cfg: Any
    model_bytes: int
    versions: list[VersionResult] = field(default_factory=list)
    memcpy_gbps: float = 0.0
    manifest_100k_s: float = float("nan")
    transport: str = ""  # the daemons' data-plane mode, as asked for
    memcpy_faults: int = 0  # page faults the baseline's copies took (0: warm mappings)

    @property
    def paths(self) -> str:
        """The paths every pull actually took, e.g. ``shm`` or ``ucx`` (``+``-joined)."""
        return "+".join(sorted({p for v in self.versions for p in v.paths})) or "none"


async def manifest_100k_seconds(client: RefitClient, n: int = 100_000) -> float:
    """Publish a 2-part model of ``n`` small tensors (each split over both parts, plus
    one replicated tensor per part) and time fetching its merged manifest once (the
    daemon merges on that first fetch)."""
    from refitd.wire import ManifestIn, ShardEntry, TensorEntry

    region = await client.create_region(64, label="manifest-bench")
    for part in (0, 1):
        tensors = [
            TensorEntry(
                f"layers.{i}.w",
                (2, 2),
                "bfloat16",
                [ShardEntry((part, 0), (1, 2), region.region_id, 0)],
            )
            for i in range(n)
        ]
        tensors.append(
            TensorEntry(
                "replicated", (2,), "bfloat16", [ShardEntry((0,), (2,), region.region_id, 0)]
            )
        )
        await client.publish(ManifestIn("manifest-100k", 1, part, 2, tensors))
    t = time.perf_counter()
    merged = await client.manifest("manifest-100k", 1)
    seconds = time.perf_counter() - t
    assert len(merged.tensors) == n + 1
    assert all(len(tt.shards) == 2 for tt in merged.tensors[:n])
    return seconds


async def refit_flow(
    *,
    gib: float,
    versions: int,
    transport: str,
    trainer_tp: int = 2,
    engine_tp: int = 4,
    measure_manifest: bool = True,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> FlowResult:
    """Two daemons, a trainer process, ``engine_tp`` engine ranks in this process.

    Every version is refit by all ranks at once; the pull lands directly in the
    parameters (``direct`` mode: the layout is fixed so no install copy is needed),
    then every parameter is checked bit for bit against the engine's own loader.
    """
    import asyncio
    import os
    import tempfile

    import torch

    from refitd.client.http import RefitClient
    from refitd.client.receiver import DaemonReceiver
    from refitd.client.spawn import spawn_daemon
    from refitd.testing.engines import EngineParallel, ToyEngine
    from refitd.testing.layouts import megatron_tp_ep

    cfg = synthetic_config(gib)
    result = FlowResult(cfg, model_bytes(cfg), transport=transport)
    # The baseline copies between two shared segments mapped once: the memory kind,
    # page size and warm mappings a replayed pull copies between (see conditions).
    from transports.local import copy_threads

    # On as many threads as the engine daemon's copier, which a replayed pull ends in.
    baseline = SegmentMemcpy(min(256 << 20, max(model_bytes(cfg), 1 << 20)), copy_threads())
    before = baseline.gbps(model_bytes(cfg))
    model = "synthetic"
    with baseline, tempfile.TemporaryDirectory() as tmp:
        secret_path = Path(tmp) / "secret"
        secret_path.write_text(os.urandom(32).hex())
        secret_path.chmod(0o600)
        secret = str(secret_path)
        async with (
            spawn_daemon(secret_file=secret, transport=transport, node_id="trainer-host") as a,
            spawn_daemon(
                secret_file=secret, transport=transport, node_id="engine-host", peers=[a.url]
            ) as b,
            RefitClient(a.url) as ca,
            RefitClient(b.url) as cb,
        ):
            trainer = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "refitd.bench.trainer",
                a.url,
                model,
                str(gib),
                str(trainer_tp),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            assert trainer.stdin is not None and trainer.stdout is not None
            capture = capture_for(megatron_tp_ep(cfg, trainer_tp, 1, None))
            ranks = []
            for rank in range(engine_tp):
                par = EngineParallel(engine_tp, rank)
                engine = ToyEngine(cfg, par)
                r = DaemonReceiver(
                    local=cb,
                    source=ca,
                    model=model,
                    engine=engine,
                    twin=functools.partial(ToyEngine, cfg, par),
                    capture=capture,
                    mode="direct",
                )
                ranks.append((par, engine, r))
            try:
                for v in range(1, versions + 1):
                    trainer.stdin.write(f"publish {v}\n".encode())
                    await trainer.stdin.drain()
                    line = (await trainer.stdout.readline()).decode().split()
                    if not line or line[0] != "published":
                        raise RuntimeError(f"trainer process failed publishing version {v}")
                    # Interleaved: each version has its own memcpy, the mean of one
                    # right before its pull and one right after, so a neighbour that
                    # slows the machine for a while slows both.
                    pre = baseline.gbps(model_bytes(cfg))
                    pids = {"engine daemon": b.pid, "source daemon": a.pid, "engine": 0}
                    counts = {k: faults(pid) for k, pid in pids.items()}
                    waited = cpu_waited_us()
                    vr = await _refit_version(v, ranks, progress, log)
                    vr.faults = {k: faults(pid) - counts[k] for k, pid in pids.items()}
                    if waited is not None and (now := cpu_waited_us()) is not None:
                        vr.cpu_pressure = (now - waited) / 1e6 / vr.seconds
                    vr.memcpy_gbps = (pre + baseline.gbps(model_bytes(cfg))) / 2
                    result.versions.append(vr)
                    t = time.perf_counter()
                    vr.verified = verify_ranks(cfg, v, ranks)
                    vr.breakdown["verify_s"] = time.perf_counter() - t
                    log(
                        f"version {v}: {vr.bytes / 2**30:.2f} GiB in {vr.seconds:.3f} s = "
                        f"{vr.bytes / vr.seconds / 1e9:.2f} GB/s, control plane {vr.control_s * 1e3:.1f} ms, "
                        f"{'replayed' if vr.replayed else 'planned'}, "
                        f"path {'+'.join(vr.paths)}, "
                        f"{'verified bit-exact' if vr.verified else 'MISMATCH'}; page faults "
                        + ", ".join(f"{k} {f.minor}" for k, f in vr.faults.items())
                        + f"; cpu pressure {vr.cpu_pressure:.2f}"
                    )
                if measure_manifest:
                    result.manifest_100k_s = await manifest_100k_seconds(ca)
            finally:
                trainer.stdin.write(b"quit\n")
                await trainer.stdin.drain()
                await trainer.wait()
                for _, _, r in ranks:
                    await r.close()
    # The headline baseline: the best memcpy of the run (before, and beside each
    # version), so it is never flattered by a neighbour slowing one measurement.
    result.memcpy_gbps = max([before, *(vr.memcpy_gbps for vr in result.versions)])
    result.memcpy_faults = baseline.faults_taken.minor + baseline.faults_taken.major
    del torch
    return result


async def _refit_version(
    version: int, ranks: list[Any], progress: bool, log: Callable[[str], None]
) -> VersionResult:
    import asyncio

    bar = None
    done: dict[int, int] = {}
    if progress:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeElapsedColumn

        bar = Progress(
            f"[bold]refit v{version}", BarColumn(), DownloadColumn(), TimeElapsedColumn()
        )
        task = bar.add_task("pull", total=None)
        bar.start()

    def on_progress(i: int) -> Callable[[Any], None]:
        def report(p: Any) -> None:
            done[i] = p.bytes_done
            if bar is not None:
                bar.update(task, completed=sum(done.values()), total=p.bytes_total * len(ranks))

        return report

    t = time.perf_counter()
    try:
        stats = await asyncio.gather(
            # Without a bar, no progress callback: each rank then waits on one long
            # poll the daemon answers when its pull ends, not on snapshots every 0.25 s.
            *(
                r.refit(version, on_progress=on_progress(i) if bar is not None else None)
                for i, (_, _, r) in enumerate(ranks)
            )
        )
    finally:
        if bar is not None:
            bar.stop()
    seconds = time.perf_counter() - t
    return VersionResult(
        version,
        sum(s.bytes for s in stats),
        seconds,
        max(s.manifest_s + s.plan_s for s in stats),
        all(s.replayed for s in stats),
        False,
        tuple(sorted({s.pull.path for s in stats})),
        breakdown=breakdown(stats),
    )


def breakdown(stats: list[Any]) -> dict[str, float]:
    """Where a version's seconds went, for the slowest rank of each phase (the ranks
    run at once): manifest fetch, planning, the daemon's own pull time (copying and
    packing, as the daemon timed it), the client's wait beyond that (HTTP, the event
    loops, progress polling), and installing into the parameters."""
    daemon = max(s.pull.seconds for s in stats)
    return {
        "manifest_s": max(s.manifest_s for s in stats),
        "plan_s": max(s.plan_s for s in stats),
        "pull_daemon_s": daemon,
        "pull_overhead_s": max(max(s.pull_s for s in stats) - daemon, 0.0),
        "install_s": max(s.install_s for s in stats),
    }


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=2.0, help="model size in GiB (default 2)")
    parser.add_argument(
        "--versions",
        type=int,
        default=5,
        help="versions to refit (default 5: the first plans, the rest replay and give the "
        "median and spread, each beside its own memcpy)",
    )
    parser.add_argument(
        "--transport",
        default="auto",
        help="daemons' data-plane mode: auto (default: UCX up, same-host peers read "
        "through shared memory), shm or ucx (force one path); the path taken is reported",
    )


def report(res: FlowResult, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Print the summary table; return the key=value fields."""
    import statistics

    later = res.versions[1:] or res.versions
    ratios = [v.ratio for v in later]
    control = max(v.control_s for v in later)
    verified = all(v.verified for v in res.versions)
    fields: dict[str, Any] = {
        "transport": res.transport,
        "path": res.paths,
        "model_gib": round(res.model_bytes / 2**30, 3),
        "versions": len(res.versions),
        "refit_gbps": round(statistics.median(v.gbps for v in later), 3),
        "memcpy_gbps": round(statistics.median(v.memcpy_gbps for v in later), 3),
        # The median over the replayed versions of (version GB/s ÷ its own memcpy),
        # and the spread of those ratios (max - min).
        "refit_ratio": round(statistics.median(ratios), 3),
        "refit_ratio_spread": round(max(ratios) - min(ratios), 3),
        # Every replayed version's ratio, so a reader sees which one moved the spread.
        "ratios": ",".join(f"{r:.2f}" for r in ratios),
        # Page faults (minor + major, all three processes) taken during the replayed
        # pulls, the most of any version: 0 when every mapping was warm; a pull that
        # faults runs at the kernel's fault rate, not memory speed.
        "pull_faults": max(sum(f.minor + f.major for f in v.faults.values()) for v in later),
        "memcpy_faults": res.memcpy_faults,
        # The most CPU pressure during a replayed pull (0: no task ever waited for a
        # core; near 1: neighbours loaded the host and the spread is theirs).
        "cpu_pressure": round(max(v.cpu_pressure for v in later), 2),
        "first_refit_s": round(res.versions[0].seconds, 3),
        "control_plane_s": round(control, 4),
    }
    # Where the replayed versions' time went (medians), so a regression explains itself.
    for key in later[0].breakdown:
        fields[key] = round(statistics.median(v.breakdown[key] for v in later), 4)
    fields["manifest_100k_s"] = round(res.manifest_100k_s, 3)
    fields["verified"] = int(verified)
    return fields


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import uvloop
    from rich.console import Console
    from rich.table import Table

    from transports.segments import huge_page_mode

    console = Console()
    console.print(
        f"[bold]refitd bench refit[/bold]: Megatron TP2 trainer → engine TP4, "
        f"{args.gib:g} GiB bf16, {args.versions} versions, two daemons ({args.transport}); "
        f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, shared memory "
        f"huge pages: {huge_page_mode()}"
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        res = runner.run(
            refit_flow(
                gib=args.gib, versions=args.versions, transport=args.transport, log=console.print
            )
        )
    table = Table(title="per version (all 4 engine ranks at once)")
    for col in (
        "version",
        "GiB pulled",
        "seconds",
        "GB/s",
        "memcpy GB/s",
        "× memcpy",
        "control plane ms",
        "page faults",
        "cpu pressure",
        "plan",
        "path",
        "verified",
    ):
        table.add_column(col, justify="right")
    for v in res.versions:
        g = v.bytes / v.seconds / 1e9
        table.add_row(
            str(v.version),
            f"{v.bytes / 2**30:.2f}",
            f"{v.seconds:.3f}",
            f"{g:.2f}",
            f"{v.memcpy_gbps:.2f}",
            f"{v.ratio:.2f}",
            f"{v.control_s * 1e3:.1f}",
            str(sum(f.minor + f.major for f in v.faults.values())),
            f"{v.cpu_pressure:.2f}",
            "replayed" if v.replayed else "planned",
            "+".join(v.paths),
            "yes" if v.verified else "NO",
        )
    console.print(table)
    fields = report(res)
    from transports.local import copy_threads

    console.print(
        f"memcpy ({copy_threads()} threads as the daemon's copier, between two shared "
        f"segments mapped once) measured before and "
        f"after each version's pull; best of the run "
        f"{res.memcpy_gbps:.2f} GB/s; "
        f"100k-tensor manifest fetched and merged in {res.manifest_100k_s:.3f} s"
    )
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0 if fields["verified"] else 1


def run_demo(gib: float = 1.0, versions: int = 2, transport: str = "auto") -> int:
    """The daemon-based demo (``make demo``): two daemons on loopback, a trainer
    process publishing a ``gib`` GiB model as Megatron TP2, this process refitting
    four engine ranks (TP4) with a progress bar, every parameter verified bit for bit,
    and the effective bandwidth against memcpy measured in the same run. Returns the
    exit status: 0 only if every version verified."""
    import asyncio

    import uvloop
    from rich.console import Console

    console = Console()
    console.print(
        f"[bold]refitd demo[/bold]: a trainer process publishes a {gib:g} GiB bf16 model "
        f"(Megatron TP2, fused qkv and gate_up) through daemon A; this engine process refits "
        f"4 TP ranks through daemon B ({transport}); {versions} versions"
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        res = runner.run(
            refit_flow(
                gib=gib,
                versions=versions,
                transport=transport,
                progress=True,
                measure_manifest=False,
                log=console.print,
            )
        )
    fields = report(res)
    last = res.versions[-1]
    g = last.bytes / last.seconds / 1e9
    console.print(
        f"refit of {last.bytes / 2**30:.2f} GiB: {g:.2f} GB/s effective vs memcpy "
        f"{res.memcpy_gbps:.2f} GB/s in the same run ({g / res.memcpy_gbps:.2f}×); first "
        f"(cold, planned) refit {res.versions[0].seconds:.2f} s"
    )
    if fields["verified"]:
        console.print("[green]verified: every parameter of every engine rank is bit-exact[/green]")
    else:
        console.print("[red]MISMATCH: some engine parameter differs from the loader's result[/red]")
    print(" ".join(f"{k}={v}" for k, v in fields.items() if k != "manifest_100k_s"))
    return 0 if fields["verified"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--demo":
        sys.exit(run_demo())
