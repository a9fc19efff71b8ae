"""``refitd bench delta``: refit by delta vs full refit, version by version, in one run.

A small language model (embeddings, ``--layers`` SwiGLU MLP blocks with RMSNorm, an
untied head; ``--hidden`` wide) is trained for ``--steps`` real steps on random
token sequences, next-token cross-entropy, with AdamW at ``--lr`` (3e-6) on bf16
parameters, so the fraction of values each step changes is what training makes it.
After each step a trainer of two FSDP-style ranks (dim-0 blocks) publishes the
parameters as the next version through one daemon, double-buffered (odd versions in
one pair of regions, even ones in another), and the daemon compares each version
with the one before.

Two TP 2 engines (vLLM-style: vocabulary-parallel embeddings and head, fused
``gate_up`` column-parallel, ``down`` row-parallel, replicated norms) refit every
version through the same daemon: one by delta (:class:`~refitd.client.deltarefit.
DeltaReceiver`), one by full refit (:class:`~refitd.client.receiver.DaemonReceiver`),
each rank timed over its whole refit (lease to install). After every version the
delta engine's parameters are compared, bit for bit, with the full one's.

The last line::

    changed_fraction=… wire_ratio=… delta_time_ratio=… verified=1

``changed_fraction``: changed units ÷ compared units over every delta (as the source
daemon counted them); ``wire_ratio``: bytes the delta refits pulled ÷ bytes the full
refits pulled (target ≤ 0.03); ``delta_time_ratio``: delta refit seconds ÷ full
refit seconds (target ≤ 0.25); ``verified``: 1 when every version matched.
The source's comparison runs when a version is published, before either engine
refits; its seconds are printed apart (``compare_s``).
"""

from __future__ import annotations

import argparse
import asyncio

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--layers", type=int, default=8, help="MLP blocks (default 8)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument(
        "--chunk-mib",
        type=float,
        default=16.0,
        help="stream bytes per chunk of a streamed delta, MiB (DeltaReceiver(chunk_bytes=))",
    )
    parser.add_argument(
        "--prefer",
        choices=("delta", "auto"),
        default="delta",
        help="the delta engines' policy (DeltaReceiver(prefer=)); default delta",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a MoE model of 10,000s of expert tensors into fused experts "
        "(refitd.bench.deltamoe): prints apply_share",
    )
    from refitd.bench.deltamoe import add_arguments as moe_arguments

    moe_arguments(parser)
    parser.add_argument(
        "--link-gbit",
        type=float,
        default=0.0,
        help="trainer and engines on two simulated hosts, links shaped to this many Gbit/s",
    )
    parser.add_argument(
        "--mirror",
        action="store_true",
        help="with --link-gbit: the engines' daemon keeps a host mirror of every version "
        '([mirrors] policy = "always"): full refits read it, deltas still stream from the '
        "source",
    )


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    if args.moe:
        from refitd.bench.deltamoe import run as moe

        return moe(args)
    if args.link_gbit:
        from refitd.bench.deltahosts import across

        return across(args)
    if args.mirror:
        print("refitd bench delta --mirror: a host mirror needs another host: add --link-gbit")
        return 2
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from refitd.bench.deltamodel import Engines, Report, Trainer
    from refitd.client.http import RefitClient
    from refitd.config import load_config
    from refitd.daemon.app.node import Daemon
    from refitd.daemon.app.process import listening

    config = load_config(None, {}, {"server.port": 0, "pulls.deltas": True})
    async with (
        listening(Daemon(config)) as (_app, url),
        RefitClient(url) as client,
    ):
        trainer = Trainer(args, client)
        print(trainer.describe())
        engines = Engines(args, client, client, args.prefer)
        await trainer.version(1)
        await engines.refit(1)
        report = Report()
        for v in range(2, args.steps + 2):
            src = await trainer.version(v)
            report.version(v, src, await engines.refit(v))
        await engines.close()
    return report.end()
