"""``refitd bench experts --prefetch``: lookahead prefetch against the demand-paging optimum.

For each preset trace (or a recorded one with predictions), pool size (1×, 2×, 4×
the experts a token activates) and prediction recall, four policies replay the same
decode:

- LRU on demand, ours (the cache's default) on demand, Belady's MIN on demand (the
  optimum of any policy that cannot prefetch);
- ours with prefetch: after each layer's ``ensure``, ``prefetch(layer + 1, predicted)``
  with the prediction the trace carries for the next layer (no budget, no skipping:
  the generator's predictions carry no confidence to skip by).

Two kinds of figures:

- **critical-path misses per decode token**: routed experts neither resident nor in
  flight when their layer runs. A prefetch issued one layer ahead counts as landed in
  time, so this is what ``ensure`` reports missing. Bytes moved per token (at the
  model's bf16 expert size) include every prefetched copy, wasted or not.
- **stall time per decode token** from a timeline model, per ``TIMELINES`` preset:
  a layer computes for ``C`` seconds; one link (FIFO, ``B`` bytes/s) carries every
  copy. At a layer's start its demand misses are queued behind whatever prefetch is
  still on the link, then the next layer's prefetch copies are queued; the layer's
  compute starts once its demand copies and the in-flight copies it routes have
  landed, and the wait is its stall. ``C`` is the layer's active bytes (a preset's
  active parameters in bf16 over its layers, batch 1 decode being memory-bound)
  over the preset's compute bandwidth. Nothing is tuned: a prefetch can hide at most
  the compute of the layer it overlaps, so where one expert's copy takes longer than
  a layer's compute (link-bound) prefetch saves little stall however good the
  prediction.

The last line is ``key=value`` pairs; ``critical_vs_belady`` and
``prefetch_bytes_ratio`` are averaged over the cells at recall 0.8 where Belady
misses more than 1% of routed experts, the stall ratios over the same cells.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TIMELINES", "Timeline", "run_prefetch"]

TARGET_CRITICAL = 0.5
TARGET_BYTES = 1.5
TARGET_PREFETCH_US = 15.0
HEADLINE_RECALL = 0.8


@dataclass(frozen=True)
class Timeline:
    """A hardware preset of the timeline model: link and compute bandwidth, bytes/s."""

    name: str
    label: str
    link_bps: float
    compute_bps: float
    source: str


TIMELINES: tuple[Timeline, ...] = (
    Timeline(
        "linkbound",
        "GPU over PCIe Gen5, batch 1",
        50e9,
        2.7e12,
        "link: PCIe 5.0 x16, 63 GB/s raw per direction, 50 GB/s assumed for pinned "
        "host-to-device copies; compute: H100 SXM HBM3, 3.35 TB/s, 2.7 TB/s assumed "
        "for batch-1 decode reading the layer's active weights",
    ),
    Timeline(
        "hybrid",
        "CPU-assisted hybrid decode",
        25e9,
        90e9,
        "link: PCIe 4.0 x16, 31.5 GB/s raw, 25 GB/s assumed; compute: the layer's "
        "active weights read by a CPU from dual-channel DDR5-5600 (89.6 GB/s), as in "
        "llama.cpp --n-cpu-moe or KTransformers on a workstation",
    ),
)

# Active parameters per token and layers (all, not only MoE ones) per preset: the
# models' published figures; bf16, so 2 bytes each.
_ACTIVE: dict[str, tuple[float, int]] = {
    "mixtral-8x7b": (12.9e9, 32),
    "qwen3-30b-a3b": (3.3e9, 48),
    "deepseek-v3": (37e9, 61),
}


def layer_compute_s(preset: str, timeline: Timeline) -> float:
    """Seconds one layer computes at batch 1 under ``timeline``."""
    active, layers = _ACTIVE[preset]
    return 2 * active / layers / timeline.compute_bps


@dataclass
class Run:
    """One policy over one trace and pool: decode-token totals."""

    critical: int = 0
    copies: int = 0
    prefetched: int = 0
    used: int = 0
    wasted: int = 0
    stall: tuple[float, ...] = ()
    seconds: float = 0.0


def replay(
    trace: object,
    size: int,
    policy: object,
    prefetch: bool,
    expert_bytes: int,
    compute_s: Sequence[float],
    timelines: Sequence[Timeline],
) -> Run:
    """Replay ``trace`` through a cache of ``size`` slots (``policy`` None: ours),
    prefetching the trace's predictions one layer ahead when ``prefetch``; count
    decode tokens only, and run the timeline model for each of ``timelines``."""
    from refitd.experts import ExpertCache
    from refitd.experts.traces import DECODE, RoutingTrace

    assert isinstance(trace, RoutingTrace)
    shape = trace.shape
    n_layers, n_exp = shape.num_layers, shape.num_experts
    cache = ExpertCache(n_layers, n_exp, size, policy=policy)  # type: ignore[arg-type]
    run = Run()
    nt = len(timelines)
    copy_s = [expert_bytes / tl.link_bps for tl in timelines]
    stall = [0.0] * nt
    now = [0.0] * nt
    link = [0.0] * nt
    # Per timeline: global key -> when its prefetch copy lands.
    landing: list[dict[int, float]] = [{} for _ in range(nt)]
    t0 = time.perf_counter()
    for tok in trace.tokens:
        decode = tok.phase == DECODE
        for layer, routed in enumerate(tok.layers):
            plan = cache.ensure(layer, routed)
            pre = None
            if prefetch and layer + 1 < n_layers:
                predicted = tok.prediction(layer + 1)
                if predicted:
                    pre = cache.prefetch(layer + 1, predicted)
            if not decode:
                continue
            run.critical += plan.missing
            run.copies += plan.fetched
            base = layer * n_exp
            for i in range(nt):
                t = now[i]
                ready = t
                lands = landing[i]
                if lands:
                    for e in routed:
                        at = lands.get(base + e)
                        if at is not None and at > ready:
                            ready = at
                if plan.fetched:
                    link[i] = max(link[i], t) + plan.fetched * copy_s[i]
                    ready = max(ready, link[i])
                if pre is not None and pre.copy.dst_slots:
                    nbase = base + n_exp
                    at = max(link[i], t)
                    for e in pre.copy.src_rows:
                        at += copy_s[i]
                        lands[nbase + e] = at
                    link[i] = at
                stall[i] += ready - t
                now[i] = ready + compute_s[i]
            if pre is not None:
                run.prefetched += len(pre.copy.dst_slots)
        if decode and len(landing[0]) > 4 * n_layers * shape.top_k:
            for i in range(nt):
                landing[i] = {k: v for k, v in landing[i].items() if v > now[i]}
    run.seconds = time.perf_counter() - t0
    st = cache.stats()
    run.used, run.wasted = st.prefetch_used, st.prefetch_wasted
    run.stall = tuple(stall)
    return run


def _time_prefetch(calls: int) -> tuple[float, int]:
    """Median µs of ``prefetch`` with 8 predicted experts on a Qwen3-30B-A3B-shaped
    pool of 2× (768 slots), in the steady state of a recall-0.8 decode replay; and the
    predicted experts per timed call."""
    from refitd.bench.expertcases import timer_overhead
    from refitd.experts import ExpertCache
    from refitd.experts.prediction import with_predictions
    from refitd.experts.traces import DECODE, preset_config, routing_model

    model = routing_model(preset_config("qwen3-30b-a3b", requests=1, decode_tokens=96))
    trace = with_predictions(model, HEADLINE_RECALL)
    shape = trace.shape
    cache = ExpertCache(shape.num_layers, shape.num_experts, 2 * shape.active)
    samples: list[int] = []
    width = 0
    for n, tok in enumerate(trace.tokens):
        for layer, routed in enumerate(tok.layers):
            cache.ensure(layer, routed)
            if layer + 1 < shape.num_layers:
                predicted = tok.prediction(layer + 1)
                if not predicted:
                    continue
                t0 = time.perf_counter_ns()
                cache.prefetch(layer + 1, predicted)
                dt = time.perf_counter_ns() - t0
                if tok.phase == DECODE and n > 16 and len(samples) < calls:
                    samples.append(dt)
                    width = max(width, len(predicted))
    overhead = min(timer_overhead() for _ in range(3))
    return max(0.0, statistics.median(samples) - overhead) / 1e3, width


def _recalls(text: str) -> list[float]:
    out = sorted({float(r) for r in text.split(",") if r.strip()}, reverse=True)
    if not out or not all(0.0 <= r <= 1.0 for r in out):
        raise SystemExit(f"--recalls takes values in [0, 1], got {text!r}")
    return out


def run_prefetch(args: argparse.Namespace, expert_banks: dict[str, tuple[int, ...]]) -> int:
    """The ``--prefetch`` mode of ``refitd bench experts`` (see the module docstring)."""
    from refitd.bench.expertcases import pool_sizes, preset_models, time_ensure
    from refitd.experts import BeladyPolicy, LruPolicy
    from refitd.experts.prediction import RECALLS, with_predictions
    from refitd.experts.tracefile import read_trace_file
    from refitd.experts.traces import RoutingTrace

    started = time.perf_counter()
    recalls = _recalls(args.recalls)
    print("recall sweep (top-k predictions, so precision = recall):")
    for r in recalls:
        print(f"  {r:.1f}: {RECALLS.get(r, 'not a published figure')}")
    print("timeline presets (per-layer compute = active bf16 bytes per layer / compute):")
    for tl in TIMELINES:
        print(f"  {tl.name}: {tl.label}; {tl.source}")

    cases: list[tuple[str, RoutingTrace, dict[float, RoutingTrace], int]] = []
    if args.trace:
        trace = read_trace_file(args.trace, num_experts=args.experts)
        if not trace.has_predictions():
            print(
                "the recorded trace carries no predictions (a 'predicted' list per line): "
                "nothing to prefetch"
            )
            return 2
        cases.append((trace.shape.name, trace, {trace.recall(): trace}, args.expert_bytes or 0))
    else:
        for name, model in preset_models(args):
            swept = {r: with_predictions(model, r, seed=args.seed) for r in recalls}
            cases.append((name, model.trace, swept, sum(expert_banks[name])))

    headline: dict[str, list[float]] = {
        "critical": [],
        "bytes": [],
        "linkbound": [],
        "hybrid": [],
    }
    for name, base, swept, expert_bytes in cases:
        shape = base.shape
        tokens = max(1, base.decode_tokens())
        compute = [layer_compute_s(name, tl) if name in _ACTIVE else 0.0 for tl in TIMELINES]
        print(
            f"\n{name}: {shape.num_layers} MoE layers × {shape.num_experts} experts, "
            f"top-{shape.top_k}; {base.decode_tokens()} decode tokens; expert "
            f"{expert_bytes / 1e6:.1f} MB; layer compute "
            + ", ".join(f"{tl.name} {c * 1e6:.0f} µs" for tl, c in zip(TIMELINES, compute))
            + "; one expert's copy "
            + ", ".join(f"{tl.name} {expert_bytes / tl.link_bps * 1e6:.0f} µs" for tl in TIMELINES)
        )
        print(
            f"  {'pool':>9} {'recall':>6} | critical misses/token: {'LRU':>6} {'ours':>6} "
            f"{'Belady':>6} {'ours+pf':>7} {'pf/B':>5} | MB/token: {'ours':>7} {'ours+pf':>7} "
            f"{'ratio':>5} {'used':>5} | stall ms/token "
            + " ".join(f"{tl.name}: LRU/ours/Belady/ours+pf" for tl in TIMELINES)
        )
        steps = base.steps()
        for label, size in pool_sizes(shape.active, shape.num_experts):

            def go(
                trace: object,
                policy: object,
                pf: bool,
                size: int = size,
                nbytes: int = expert_bytes,
                compute: list[float] = compute,
            ) -> Run:
                return replay(trace, size, policy, pf, nbytes, compute, TIMELINES)

            lru = go(base, LruPolicy(), False)
            ours = go(base, None, False)
            best = go(base, BeladyPolicy(steps, shape.num_experts), False)
            for recall, trace in swept.items():
                pf = go(trace, None, True)
                per = [r.critical / tokens for r in (lru, ours, best, pf)]
                ratio = per[3] / per[2] if per[2] else float("nan")
                mb = [
                    c * expert_bytes / tokens / 1e6
                    for c in (ours.copies, pf.copies + pf.prefetched)
                ]
                bratio = mb[1] / mb[0] if mb[0] else float("nan")
                used = pf.used / (pf.used + pf.wasted) if pf.used + pf.wasted else float("nan")
                stalls = " ".join(
                    "/".join(f"{r.stall[i] / tokens * 1e3:.2f}" for r in (lru, ours, best, pf))
                    for i in range(len(TIMELINES))
                )
                print(
                    f"  {label + ' ' + str(size):>9} {recall:6.2f} | {'':22}{per[0]:6.2f} "
                    f"{per[1]:6.2f} {per[2]:6.2f} {per[3]:7.2f} {ratio:5.2f} | {'':10}"
                    f"{mb[0]:7.1f} {mb[1]:7.1f} {bratio:5.2f} {used:5.2f} | {stalls}",
                    flush=True,
                )
                counted = abs(recall - HEADLINE_RECALL) < 1e-9 or bool(args.trace)
                if counted and best.critical / tokens > 0.01 * shape.active:
                    headline["critical"].append(ratio)
                    headline["bytes"].append(bratio)
                    for i, tl in enumerate(TIMELINES):
                        if best.stall[i] > 0:
                            headline[tl.name].append(pf.stall[i] / best.stall[i])

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    gc.collect()
    gc.disable()
    try:
        warm_us, _, _, _, warm_bytes = time_ensure(args.calls)
        prefetch_us, width = _time_prefetch(max(200, args.calls // 20))
    finally:
        gc.enable()
    crit, bts = mean(headline["critical"]), mean(headline["bytes"])
    link, hyb = mean(headline["linkbound"]), mean(headline["hybrid"])

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT MET"

    which = "the recorded trace" if args.trace else f"recall {HEADLINE_RECALL}"
    print(
        f"\nover {len(headline['critical'])} cells ({which}, Belady missing >1% of routes): "
        f"ours with prefetch ÷ Belady on demand, critical-path misses {crit:.2f} "
        f"(target ≤ {TARGET_CRITICAL}: {verdict(crit <= TARGET_CRITICAL)}); bytes with ÷ "
        f"without prefetch {bts:.2f} (≤ {TARGET_BYTES}: {verdict(bts <= TARGET_BYTES)}); "
        f"stall ÷ Belady's: link-bound {link:.2f}, hybrid {hyb:.2f} (no target)"
    )
    print(
        f"ensure() warm {warm_us:.2f} µs (≤ 10: {verdict(warm_us <= 10.0)}); prefetch() of "
        f"{width} predicted experts {prefetch_us:.2f} µs median (≤ {TARGET_PREFETCH_US}: "
        f"{verdict(prefetch_us <= TARGET_PREFETCH_US)}); a warm step moved {warm_bytes} B "
        f"({verdict(warm_bytes == 0)}); {time.perf_counter() - started:.0f} s"
    )
    print(
        f"critical_vs_belady={crit:.3f} prefetch_bytes_ratio={bts:.3f} "
        f"stall_vs_belady_linkbound={link:.3f} stall_vs_belady_hybrid={hyb:.3f} "
        f"ensure_warm_us={warm_us:.2f} prefetch_us={prefetch_us:.2f} "
        f"warm_step_bytes={warm_bytes} cells={len(headline['critical'])}"
    )
    return 0
