"""``refitd bench inflight``: a serving vLLM engine refitted in flight, under load.

An ``AsyncLLM`` (the ``bench vllm`` Llama, default preset 608 MB of bf16) with refitd
as its weight-transfer backend serves ``--streams`` concurrent streaming requests at
all times, while a trainer (this process, one rank) publishes ``--updates`` versions.
Each is brought in by :func:`~refitd.integrations.vllm.inflight.inflight_update`:
the worker pulls it into its inactive copy and prepares vLLM's post-load processing
while the engine generates, then the engine pauses (``mode="keep"``,
``clear_cache=False``) only for the swap. Before the first update the same streams run
for ``--quiet-s`` seconds with no prefetch: the baseline of ``tokens_ratio_during``.
``--tp`` runs the engine (and the fresh one that verifies) at that many TP ranks.

The last line:

- ``swap_p50_s``, ``swap_p99_s``: refitd's work inside the pause, from the pause
  completing to the resume being asked, per update;
- ``pause_p99_s``: from the pause request to the resume completing (vLLM's own pause
  and resume included);
- ``stall_p99_s``: per update, the longest gap between two tokens of any stream from
  the prefetch's start to the resume, minus the median gap of the quiet window;
- ``refit_s``: median, from the prefetch's start to the swap's end;
- ``tokens_ratio_during``: tokens/s while a prefetch runs ÷ tokens/s in the quiet window;
- ``aborted``: requests aborted or errored;
- ``stall_pull_p99_s``, ``stall_prepare_p99_s``: as ``stall_p99_s``, for the gaps
  that end while rank 0 pulled, or prepared processing (by the worker's own marks);
  ``quiet_gap_max_s``: the quiet window's longest gap, what the host makes unrefitted;
- ``verified``: 1 when, after the last swap, every parameter equals a fresh load of the
  last version bit for bit, and new requests' tokens and logprobs equal a fresh
  engine's.

One update before the quiet window plans (captures the model's loaders on a meta twin)
and is not counted: every measured update replays the compiled plan. Percentiles over
``--updates`` values are nearest-rank (with 10, p99 is the largest).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refitd.bench.vllm import (
    LLM_CPU_KWARGS,
    PRESETS,
    _draw,
    _shapes,
    beside_a_daemon,
    llama_config,
    offline,
)

__all__ = ["add_arguments", "run"]

PROMPTS = ([5, 17, 33, 99, 200], [7, 300, 42])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="600mb", help="model size (default 600mb)"
    )
    parser.add_argument("--updates", type=int, default=10, help="versions published (default 10)")
    parser.add_argument(
        "--streams", type=int, default=8, help="concurrent streaming requests (default 8)"
    )
    parser.add_argument(
        "--quiet-s", type=float, default=4.0, help="the no-prefetch window, seconds (default 4)"
    )
    parser.add_argument(
        "--prefetch-nice",
        type=int,
        default=19,
        help="CPU priority of the workers' prefetch thread (default 19, the lowest)",
    )
    parser.add_argument(
        "--prefetch-threads",
        type=int,
        default=0,
        help="OpenMP threads of the prefetch's processing (default 0: the engine's own count)",
    )
    parser.add_argument(
        "--prefetch-duty",
        type=float,
        default=1.0,
        help="share of the wall time the prefetch's processing works (default 1: no rests)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks, a worker process each (default 1; the fresh engine "
        "that verifies runs at the same TP)",
    )


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[max(math.ceil(p * len(s)) - 1, 0)]


@dataclass
class _Load:
    """Token arrival times per request, and how each request ended."""

    tokens: list[list[float]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    errors: int = 0

    def between(self, a: float, b: float) -> int:
        return sum(1 for req in self.tokens for t in req if a <= t < b)

    def gaps(self, a: float, b: float) -> list[float]:
        return [y - x for req in self.tokens for x, y in itertools.pairwise(req) if a <= y < b]


async def _streams(llm: Any, n: int, stop: asyncio.Event, load: _Load) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, detokenize=False)

    async def lane(i: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            times: list[float] = []
            load.tokens.append(times)
            seen = 0
            out: Any = None
            try:
                async for out in llm.generate(
                    TokensPrompt(prompt_token_ids=[5, 17 + i, 33 + k % 50]), params, f"s{i}-{k}"
                ):
                    now = time.perf_counter()
                    got = len(out.outputs[0].token_ids)
                    times += [now] * (got - seen)
                    seen = got
                load.ended.append(str(out.outputs[0].finish_reason))
            except Exception:  # counted: the bench reports requests that errored
                load.errors += 1

    await asyncio.gather(*(lane(i) for i in range(n)))


async def _greedy_logprobs(llm: Any) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    out = []
    for i, ids in enumerate(PROMPTS):
        last: Any = None
        async for o in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"v{i}"):
            last = o
        c = last.outputs[0]
        out.append(
            (
                list(c.token_ids),
                [sorted((t, lp.logprob) for t, lp in s.items()) for s in c.logprobs],
            )
        )
    return out


def engine_kwargs(tp: int) -> dict[str, Any]:
    """``LLM``/``AsyncEngineArgs`` settings at ``tp`` ranks; for ``tp > 1`` each rank's
    OpenMP team is bound to cores of its own (``VLLM_CPU_OMP_THREADS_BIND``, unless
    set), this process's cores dealt out in turn."""
    if tp == 1:
        return dict(LLM_CPU_KWARGS)
    cores = sorted(os.sched_getaffinity(0))
    per = [cores[r::tp] or [cores[r % len(cores)]] for r in range(tp)]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in per))
    return {**LLM_CPU_KWARGS, "tensor_parallel_size": tp, "distributed_executor_backend": "mp"}


def _phases(s: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """The pull's window and processing's, by rank 0's marks (the prefetch's start
    when the worker names none): a token gap is put down to the phase it ends in."""
    r = s.ranks[0]
    start = r.get("started_at", s.marks["start"])
    pulled = start + r["pulled_s"]
    return (s.marks["start"], pulled), (pulled, s.marks["ready"])


def run(args: argparse.Namespace) -> int:
    import torch

    with tempfile.TemporaryDirectory(prefix="refitd-bench-inflight-") as tmp:
        root = Path(tmp)
        offline(root)
        cfg = llama_config(*PRESETS[args.preset])
        state = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in _shapes(cfg).items()}
        for d in ("engine", "last"):
            (root / d).mkdir()
            (root / d / "config.json").write_text(json.dumps(cfg))
        _draw(state, 0)
        from safetensors.torch import save_file

        save_file(state, str(root / "engine" / "model.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        print(
            f"refitd bench inflight: Llama hidden {cfg['hidden_size']}, "
            f"{cfg['num_hidden_layers']} layers: {nbytes / 2**20:.1f} MiB bf16; AsyncLLM "
            f"TP{args.tp} on CPU; {args.streams} streams; {args.updates} in-flight updates",
            flush=True,
        )
        return beside_a_daemon(root, lambda url: asyncio.run(_bench(args, root, state, url)))


async def _bench(args: argparse.Namespace, root: Path, state: dict[str, Any], url: str) -> int:
    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from refitd.bench.vllm import served_digest
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.inflight import AsyncLLMControl, inflight_update
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    eargs = AsyncEngineArgs(
        model=str(root / "engine"),
        weight_transfer_config={"backend": "refitd"},
        **engine_kwargs(args.tp),
    )
    llm = AsyncLLM.from_engine_args(eargs)
    control = AsyncLLMControl(llm)
    info = RefitdTrainerInitInfo(rank=0, model="inflight", url=url)
    trainer = await asyncio.to_thread(
        RefitdTrainerEngine, info, client=None, source=TensorSource(state), is_sender=True
    )
    stop, load = asyncio.Event(), _Load()
    stats = []
    try:
        await control.init_weight_transfer_engine(
            {
                "model": "inflight",
                "mode": "swap",
                "prefetch_nice": args.prefetch_nice,
                "prefetch_threads": args.prefetch_threads,
                "prefetch_duty": args.prefetch_duty,
            }
        )
        streams = asyncio.create_task(_streams(llm, args.streams, stop, load))
        # One update before the clock: the first plans (captures the loaders on a meta
        # twin); every later one replays the compiled plan.
        await asyncio.to_thread(_draw, state, 1000)
        await inflight_update(control, await asyncio.to_thread(trainer.publish_ready))
        await asyncio.sleep(1.0)  # every stream under way
        q0 = time.perf_counter()
        await asyncio.sleep(args.quiet_s)
        q1 = time.perf_counter()
        for update in range(1, args.updates + 1):
            await asyncio.to_thread(_draw, state, update)
            version = await asyncio.to_thread(trainer.publish_ready)
            s = await inflight_update(control, version)
            stats.append(s)
            print(
                f"update {update}: prefetch {s.prefetch_s * 1e3:7.1f} ms (pull "
                f"{s.ranks[0]['pulled_s'] * 1e3:.1f}, prepare {s.ranks[0]['prepare_s'] * 1e3:.1f})"
                f"  pause {s.pause_s * 1e3:5.1f}  swap {s.swap_s * 1e3:5.1f}  pause+swap+resume "
                f"{s.pause_total_s * 1e3:6.1f} ms",
                flush=True,
            )
            pull, prep = _phases(s)
            around = max(load.gaps(s.marks["ready"], s.marks["resumed"] + 0.2), default=0.0)
            print(
                f"  longest token gap: while pulling {max(load.gaps(*pull), default=0.0) * 1e3:.1f}"
                f" ms, while preparing {max(load.gaps(*prep), default=0.0) * 1e3:.1f} ms, "
                f"around the pause {around * 1e3:.1f} ms",
                flush=True,
            )
            await asyncio.sleep(0.3)  # tokens after the resume, before the next publish
        stop.set()
        await streams
        digest = await llm.collective_rpc(served_digest)  # every rank's shard
        served = await _greedy_logprobs(llm)
    finally:
        stop.set()
        await asyncio.to_thread(trainer.shutdown)
        llm.shutdown()
        del llm
        gc.collect()
    save_file(state, str(root / "last" / "model.safetensors"))
    fresh = LLM(model=str(root / "last"), **engine_kwargs(args.tp))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    truth_tokens = []
    for ids in PROMPTS:  # one at a time, as asked of the refitted engine: same batch shape
        [o] = fresh.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        c = o.outputs[0]
        truth_tokens.append(
            (
                list(c.token_ids),
                [sorted((t, lp.logprob) for t, lp in s.items()) for s in c.logprobs],
            )
        )
    truth_digest = fresh.collective_rpc(served_digest)
    fresh.llm_engine.engine_core.shutdown()  # its worker processes end before the report
    del fresh
    gc.collect()
    verified = digest == truth_digest and served == truth_tokens
    if not verified:
        names = sorted(
            f"rank {r}: {n}"
            for r, (got, want) in enumerate(zip(digest, truth_digest, strict=True))
            for n in want
            if got.get(n) != want[n]
        )
        print(
            f"differ from a fresh load: parameters {names[:6]} ({len(names)}), tokens or "
            f"logprobs: {served != truth_tokens}",
            flush=True,
        )

    quiet_gap = statistics.median(load.gaps(q0, q1))
    quiet_rate = load.between(q0, q1) / (q1 - q0)
    during = sum(load.between(s.marks["start"], s.marks["ready"]) for s in stats)
    during_s = sum(s.marks["ready"] - s.marks["start"] for s in stats)
    stalls = [
        max(load.gaps(s.marks["start"], s.marks["resumed"] + 0.2), default=0.0) - quiet_gap
        for s in stats
    ]
    in_pull = [max(load.gaps(*_phases(s)[0]), default=0.0) - quiet_gap for s in stats]
    in_prep = [max(load.gaps(*_phases(s)[1]), default=0.0) - quiet_gap for s in stats]
    aborted = load.errors + sum(1 for e in load.ended if e != "length")
    swaps = [s.swap_s for s in stats]
    print(
        f"swap_p50_s={_pct(swaps, 0.5):.4f} swap_p99_s={_pct(swaps, 0.99):.4f} "
        f"pause_p99_s={_pct([s.pause_total_s for s in stats], 0.99):.4f} "
        f"stall_p99_s={_pct(stalls, 0.99):.4f} "
        f"refit_s={statistics.median(s.refit_s for s in stats):.4f} "
        f"tokens_ratio_during={during / during_s / quiet_rate:.3f} aborted={aborted} "
        f"prefetch_nice={args.prefetch_nice} prefetch_threads={args.prefetch_threads} "
        f"prefetch_duty={args.prefetch_duty} tp={args.tp} "
        f"verified={int(verified)} quiet_tokens_per_s={quiet_rate:.1f} "
        f"quiet_gap_s={quiet_gap:.4f} prefetch_p50_s="
        f"{statistics.median(s.prefetch_s for s in stats):.4f} requests={len(load.ended)} "
        f"stall_pull_p99_s={_pct(in_pull, 0.99):.4f} stall_prepare_p99_s={_pct(in_prep, 0.99):.4f} "
        f"quiet_gap_max_s={max(load.gaps(q0, q1)):.4f}"
    )
    return 0 if verified and not aborted else 1
