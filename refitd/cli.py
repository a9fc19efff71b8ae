"""The ``refitd`` command line.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)``
and ``run(args) -> int``. Command modules keep heavy imports (torch, ucxx) inside
``run`` so that building the parser, and so ``refitd --help``, stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Add a line here to add a subcommand.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("refitd.demo", "run the main job end to end on loopback and verify it"),
    "serve": ("refitd.daemon.app.process", "run the refitd daemon: HTTP API v1 and the data plane"),
    "status": ("refitd.ops.status", "show whether the daemon is up and ready, and what it holds"),
    "regions": ("refitd.ops.regions", "list the daemon's memory regions"),
    "sources": ("refitd.ops.sources", "list published model versions, their state and leases"),
    "pulls": ("refitd.ops.pulls", "list pulls, or follow one with a progress bar"),
    "pull": ("refitd.ops.pull", "submit a pull from a descriptor file; progress bar to the end"),
    "experts": ("refitd.ops.experts", "list the daemon's MoE expert slot pools"),
    "gc": (
        "refitd.ops.gc",
        "show what the daemon can free (exited clients' regions, stale segments) and free it",
    ),
    "config": ("refitd.ops.config_cmd", "check a configuration file (refitd config check FILE)"),
}

# Examples shown under `refitd bench NAME --help`.
BENCH_EXAMPLES: dict[str, tuple[str, ...]] = {
    "delta": (
        "refitd bench delta                         # a 1024-wide, 8-block model, 4 steps",
        "refitd bench delta --layers 2 --hidden 256 --vocab 4000   # a quick run",
        "refitd bench delta --link-gbit 1           # engines on another simulated host",
        "refitd bench delta --moe                   # 18,432 expert tensors into fused experts",
    ),
    "experts": (
        "refitd bench experts                       # three presets, 1x/2x/4x pools",
        "refitd bench experts --presets qwen3-30b-a3b --tokens 512",
        "refitd bench experts --trace routes.jsonl --experts 128   # your own traffic",
        "refitd bench experts --bound               # headroom: model-knowing oracles",
        "refitd bench experts --prefetch            # lookahead prefetch vs Belady on demand",
    ),
    "fanout": (
        "refitd bench fanout                        # 64 MiB, 1 Gbit/s, N = 1, 2, 4 (+ straggler, kill)",
        "refitd bench fanout --mib 16 --hosts 2     # a quick run (no straggler, no kill)",
        "refitd bench fanout --hosts 8              # N = 8 too",
    ),
    "gpu": (
        "refitd bench gpu                           # 2 GiB TP2 -> TP4 on the GPU, 3 versions",
        "refitd bench gpu --gib 0.5 --versions 2    # a quick run",
    ),
    "hosts": (
        "refitd bench hosts                         # 1 GiB across simulated hosts, 1000 sources",
        "refitd bench hosts --gib 0.25 --repeat 2   # a quick run",
        "refitd bench hosts --link-gbit 1           # links shaped to 1 Gbit/s with tc",
    ),
    "offload": (
        "refitd bench offload                       # Qwen3-MoE-shaped decode: pools 50/25 %, resident, on demand",
        "refitd bench offload --device cuda         # slots in GPU memory: the issue's targets",
        "refitd bench offload --layers 8 --tokens 256",
    ),
    "plan": (
        "refitd bench plan                          # full DeepSeek-V3 shapes, both layouts",
        "refitd bench plan --layers 8 --layout fsdp # a quick run",
        "refitd bench plan --unfuse view            # Megatron fused weights split by views",
    ),
    "refit": (
        "refitd bench refit                         # 2 GiB, 3 versions, data path chosen per peer",
        "refitd bench refit --transport ucx         # force every read through UCX",
        "refitd bench refit --gib 4 --versions 5",
    ),
    "inflight": (
        "refitd bench inflight                      # a 608 MB Llama, 8 streams, 10 updates",
        "refitd bench inflight --preset tiny --updates 3   # a quick run",
        "refitd bench inflight --prefetch-nice 0    # the prefetch at the engine's priority",
        "refitd bench inflight --preset tiny --tp 2 --updates 3   # two TP ranks, toy size",
    ),
    "lora": (
        "refitd bench lora                          # a rank-16 adapter on the 608 MB Llama, K = 5",
        "refitd bench lora --tiny                   # the tests' 2.8 MiB Llama (CI)",
        "refitd bench lora --rank 64 --updates 8",
        "refitd bench lora --tiny --tp 2            # two TP ranks, each pulling its part",
    ),
    "vllm": (
        "refitd bench vllm                          # a 608 MB Llama, 4 updates",
        "refitd bench vllm --tiny                   # the tests' 2.8 MiB Llama (CI)",
        "refitd bench vllm --hidden 1024 --layers 8 # another size",
    ),
    "transport": (
        "refitd bench transport                     # every transport, 4 KiB ... 256 MiB",
        "refitd bench transport --schemes ucx --pieces 4KiB,1MiB --lanes 1",
    ),
}

# `refitd bench NAME`: name -> (module, one-line help).
BENCHES: dict[str, tuple[str, str]] = {
    "delta": (
        "refitd.bench.delta",
        "train a small model with AdamW at lr 3e-6 in bf16; refit each version by delta "
        "and by full refit, side by side",
    ),
    "experts": (
        "refitd.bench.experts",
        "expert-cache policies vs Belady's optimum on MoE routing traces",
    ),
    "fanout": (
        "refitd.bench.fanout",
        "replicas on many simulated hosts over shaped links: direct pulls vs host mirrors, "
        "with a slow host and a killed one",
    ),
    "gpu": (
        "refitd.bench.gpu",
        "GPU memory through the daemon: refits from GPU and host memory into GPU "
        "parameters, 4 KiB pieces, vs device copies (exits 2 without CUDA)",
    ),
    "hosts": (
        "refitd.bench.hosts",
        "pull across simulated hosts over tcp and ucx vs the link, quiet and busy; "
        "discover 1,000 sources on etcd",
    ),
    "offload": (
        "refitd.bench.offload",
        "a Qwen3-MoE-shaped model decoding with offloaded experts vs all resident and on demand",
    ),
    "plan": ("refitd.bench.plan", "plan a DeepSeek-V3-shaped refit for two trainer layouts"),
    "refit": (
        "refitd.bench.refit",
        "refit a ≥ 2 GiB model TP2 → TP4 through two daemons, vs memcpy",
    ),
    "inflight": (
        "refitd.bench.inflight",
        "refit a serving vLLM engine in flight under streaming load: the pause is the swap",
    ),
    "lora": (
        "refitd.bench.lora",
        "refit a LoRA adapter in a serving vLLM engine vs a full refit and vs vLLM loading "
        "it from disk (CPU)",
    ),
    "vllm": (
        "refitd.bench.vllm",
        "refit a vLLM engine through refitd vs reloading it from disk (CPU)",
    ),
    "transport": (
        "refitd.bench.transport",
        "pull 256 MiB through each transport (4 KiB…256 MiB pieces) vs memcpy",
    ),
}


def _build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line. Each command's options come from its module; given ``argv``,
    only the commands it names are imported for theirs (``refitd serve`` loads no
    benchmark and no other command: a daemon's start pays for none of them)."""
    named = None if argv is None else set(argv)

    def wanted(*names: str) -> bool:
        return named is None or named.issuperset(names)

    parser = argparse.ArgumentParser(
        prog="refitd",
        description="refitd: planned, validated, zero-copy weight transfer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if wanted(name):
            importlib.import_module(module).add_arguments(p)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (prints ratios measured in one run)",
        description="Run a benchmark. Each measures its baseline in the same run, prints "
        "ratios, and ends with one line of key=value pairs for scripts.",
        epilog="examples:\n  refitd bench plan\n  refitd bench refit --transport ucx",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        examples = "\n".join(f"  {line}" for line in BENCH_EXAMPLES.get(name, ()))
        p = bench_sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=f"examples:\n{examples}" if examples else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(_module=module)
        if wanted("bench", name):
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _build_parser(argv).parse_args(argv)
    code: int = importlib.import_module(args._module).run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
