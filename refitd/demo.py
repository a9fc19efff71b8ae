"""``refitd demo``: one refit end to end, in process, verified bit for bit.

Until the daemon exists this is refitd's main job in miniature. A toy trainer holds a
DeepSeek-shaped MoE model (MLA attention, routed and shared experts, bf16) as
Megatron TP 2 × EP 4 shards in real per-rank buffers. An engine in a different layout
(vLLM-style TP 4 with EP 2) refits every one of its ranks: capture on a meta twin →
plan against the published shards → pull through the reference transport into zeroed
parameters → compare each parameter with the engine's own loader run on the full
checkpoint. The exit code is 0 only if every rank matched exactly.

The report prints the plan's bytes and descriptors, and the pull's throughput next to
a plain numpy copy of the same number of bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size",
        choices=("small", "medium"),
        default="medium",
        help="model size: small (a few MB, for tests) or medium (tens of MB, the default)",
    )
    parser.add_argument("--trainer-tp", type=int, default=2, help="trainer tensor parallelism")
    parser.add_argument("--trainer-ep", type=int, default=4, help="trainer expert parallelism")
    parser.add_argument("--engine-tp", type=int, default=4, help="engine tensor parallelism")
    parser.add_argument("--engine-ep", type=int, default=2, help="engine expert parallelism")


@dataclass(frozen=True)
class RankResult:
    """One engine rank's refit: sizes in bytes, times in seconds."""

    rank: int
    params: int
    exact_bytes: int
    wire_bytes: int
    descriptors: int
    plan_s: float
    pull_s: float
    mismatched: tuple[str, ...]


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from rich.console import Console
    from rich.table import Table

    from refitd.bench.engines import EngineParallel, ModelConfig, ToyEngine
    from refitd.bench.layouts import capture_published, full_state, megatron_tp_ep
    from refitd.reshard.transfer_plan import execute_transfer, plan_transfer
    from refitd.reshard.transport import InMemoryReferenceTransport

    console = Console(width=max(Console().width, 100))
    small = args.size == "small"
    cfg = ModelConfig(
        vocab_size=1000,
        hidden_size=128 if small else 512,
        num_layers=3,
        intermediate_size=256 if small else 1024,
        num_heads=8,
        attention="mla",
        q_lora_rank=64 if small else 192,
        kv_lora_rank=32 if small else 128,
        qk_nope_head_dim=16 if small else 32,
        qk_rope_head_dim=8 if small else 16,
        v_head_dim=16 if small else 32,
        num_experts=8 if small else 16,
        moe_intermediate_size=64 if small else 256,
        num_shared_experts=1,
        first_k_dense=1,
        dtype=torch.bfloat16,
    )
    state = full_state(cfg, seed=0)
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in state.values())
    published = megatron_tp_ep(cfg, args.trainer_tp, args.trainer_ep, state)
    console.print(
        f"[bold]refitd demo[/bold]: trainer Megatron TP{args.trainer_tp}×EP{args.trainer_ep} "
        f"({len(published.buffers)} ranks, {len(published.sources)} tensors, "
        f"{checkpoint_bytes / 2**20:.1f} MiB checkpoint) → engine TP{args.engine_tp}"
        f"×EP{args.engine_ep}"
    )

    results: list[RankResult] = []
    for rank in range(args.engine_tp):
        par = EngineParallel(args.engine_tp, rank, args.engine_ep)
        started = time.perf_counter()
        with torch.device("meta"):
            twin = ToyEngine(cfg, par)
        capture = capture_published(twin, published)
        plan = plan_transfer(capture, published.sources)
        plan_s = time.perf_counter() - started
        if capture.unsupported or plan.fallback:
            console.print(f"[red]rank {rank}: unsupported sources {plan.fallback}[/red]")
            return 1

        engine = ToyEngine(cfg, par)
        params = dict(engine.named_parameters())
        pointers = {name: p.data_ptr() for name, p in params.items()}
        # A refit repeats every step into the same parameters: the first pull also
        # faults in their pages, so the second one is timed (and then verified).
        for _attempt in range(2):
            started = time.perf_counter()
            stats = execute_transfer(
                plan,
                resolve_param_ptr=pointers.__getitem__,
                transport=InMemoryReferenceTransport(),
            )
            pull_s = time.perf_counter() - started

        truth = ToyEngine(cfg, par)
        truth.load_weights(state.items())
        expected = dict(truth.named_parameters())
        bad = tuple(n for n, p in params.items() if not torch.equal(p, expected[n]))
        results.append(
            RankResult(
                rank=rank,
                params=len(params),
                exact_bytes=plan.exact_bytes,
                wire_bytes=int(stats["bytes"]),
                descriptors=plan.descriptor_count(),
                plan_s=plan_s,
                pull_s=pull_s,
                mismatched=bad,
            )
        )

    # The baseline: one numpy copy of as many bytes as all ranks pulled, same run.
    total_wire = sum(r.wire_bytes for r in results)
    src = np.random.default_rng(0).integers(0, 255, size=total_wire, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm the pages
    started = time.perf_counter()
    np.copyto(dst, src)
    memcpy_s = time.perf_counter() - started

    table = Table(title="per engine rank")
    for col in ("rank", "exact MiB", "wire MiB", "wire÷exact", "reads", "plan s",
                "pull s", "GB/s", "bit-exact"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.rank),
            f"{r.exact_bytes / 2**20:.2f}",
            f"{r.wire_bytes / 2**20:.2f}",
            f"{r.wire_bytes / max(r.exact_bytes, 1):.3f}",
            str(r.descriptors),
            f"{r.plan_s:.3f}",
            f"{r.pull_s:.4f}",
            f"{r.wire_bytes / max(r.pull_s, 1e-9) / 1e9:.2f}",
            "[green]yes[/green]" if not r.mismatched else f"[red]{len(r.mismatched)} differ[/red]",
        )
    console.print(table)

    pull_s = sum(r.pull_s for r in results)
    exact = sum(r.exact_bytes for r in results)
    pull_gbs = total_wire / max(pull_s, 1e-9) / 1e9
    memcpy_gbs = total_wire / max(memcpy_s, 1e-9) / 1e9
    ok = all(not r.mismatched for r in results)
    console.print(
        f"{sum(r.params for r in results)} parameters over {len(results)} ranks: "
        f"pulled {total_wire / 2**20:.1f} MiB for {exact / 2**20:.1f} MiB needed "
        f"(wire÷exact {total_wire / max(exact, 1):.3f}) in "
        f"{sum(r.descriptors for r in results)} descriptors: {pull_gbs:.2f} GB/s vs numpy "
        f"memcpy {memcpy_gbs:.2f} GB/s ({pull_gbs / memcpy_gbs:.2f}× memcpy)"
    )
    for r in results:
        for name in r.mismatched[:5]:
            console.print(f"[red]rank {r.rank}: {name} differs from the loader's result[/red]")
    console.print(
        "[bold green]verified: every parameter of every rank is bit-exact[/bold green]"
        if ok
        else "[bold red]NOT verified[/bold red]"
    )
    print(
        f"verified={int(ok)} ranks={len(results)} exact_bytes={exact} wire_bytes={total_wire} "
        f"descriptors={sum(r.descriptors for r in results)} pull_gbs={pull_gbs:.3f} "
        f"memcpy_gbs={memcpy_gbs:.3f}"
    )
    return 0 if ok else 1
