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
import math
import time
from typing import Any

import torch
from torch import nn

__all__ = ["add_arguments", "run"]

MODEL = "delta-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--layers", type=int, default=8, help="MLP blocks (default 8)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")


# ---------------------------------------------------------------- the trained model


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, 4 * hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out: torch.Tensor = x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return out


class TinyLM(nn.Module):
    """The trainer's model (checkpoint names are its parameter names)."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


# ---------------------------------------------------------------- the engine


class TPEngine(nn.Module):
    """One TP rank of the engine: the trainer's tensors, resharded and fused."""

    def __init__(self, vocab: int, hidden: int, layers: int, tp: int, rank: int) -> None:
        super().__init__()
        self.tp, self.rank, self.layers = tp, rank, layers
        v, f = vocab // tp, 4 * hidden // tp
        bf = torch.bfloat16

        def param(*shape: int, loader: Any) -> nn.Parameter:
            p = nn.Parameter(torch.zeros(*shape, dtype=bf), requires_grad=False)
            p.weight_loader = loader  # type: ignore[attr-defined]
            return p

        self.embed = param(v, hidden, loader=self._rows)
        self.head = param(v, hidden, loader=self._rows)
        self.norm = param(hidden, loader=self._whole)
        for i in range(layers):
            self.register_parameter(f"norm{i}", param(hidden, loader=self._whole))
            self.register_parameter(f"gate_up{i}", param(2 * f, hidden, loader=self._fused))
            self.register_parameter(f"down{i}", param(hidden, f, loader=self._cols))

    def _rows(self, p: torch.Tensor, w: torch.Tensor) -> None:
        n = p.shape[0]
        p.copy_(w.narrow(0, self.rank * n, n))

    def _cols(self, p: torch.Tensor, w: torch.Tensor) -> None:
        n = p.shape[1]
        p.copy_(w.narrow(1, self.rank * n, n))

    @staticmethod
    def _whole(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w)

    def _fused(self, p: torch.Tensor, w: torch.Tensor, shard: int) -> None:
        n = p.shape[0] // 2
        p.narrow(0, shard * n, n).copy_(w.narrow(0, self.rank * n, n))

    def load_weights(self, weights: Any) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            parts = name.split(".")
            if parts[0] == "blocks":
                i, kind = parts[1], parts[2]
                if kind in ("gate", "up"):
                    p = params[f"gate_up{i}"]
                    p.weight_loader(p, w, 0 if kind == "gate" else 1)  # type: ignore[attr-defined]
                    continue
                p = params[{"norm": f"norm{i}", "down": f"down{i}"}[kind]]
            else:
                p = params[parts[0]]
            p.weight_loader(p, w)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


async def _publish(client: Any, pubs: list[Any] | None, model: TinyLM, version: int) -> list[Any]:
    """Every parameter as two dim-0 blocks, slot ``r`` holding block ``r``."""
    from refitd.client.publisher import ALIGN, Publisher

    params = [(n, p.detach()) for n, p in model.named_parameters()]
    blocks = []
    for n, t in params:
        half = t.shape[0] // 2
        blocks += [(0, n, t, (0,), t[:half]), (1, n, t, (half,), t[half:])]
    if pubs is None:
        pubs = [Publisher(client, MODEL, slot, 2) for slot in range(2)]
        for slot, pub in enumerate(pubs):
            mine = [b[4].nbytes for b in blocks if b[0] == slot]
            room = sum(-(-n // ALIGN) * ALIGN for n in mine)
            await pub.reserve(room, label=f"bench-delta{version % 2}")
    for slot, name, t, at, part in blocks:
        offset = at + (0,) * (t.dim() - 1)
        pubs[slot].put(name, part, tuple(t.shape), offset)
    for pub in pubs:
        await pub.publish(version)
    return pubs


async def _main(args: argparse.Namespace) -> int:
    from refitd.client.deltarefit import DeltaReceiver
    from refitd.client.http import RefitClient
    from refitd.client.receiver import DaemonReceiver
    from refitd.daemon.node import DaemonOptions
    from refitd.daemon.process import listening
    from refitd.reshard.geometry import capture_geometry

    torch.manual_seed(0)
    vocab, hidden, layers, tp = args.vocab, args.hidden, args.layers, 2
    lm = TinyLM(vocab, hidden, layers).to(torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    print(
        f"model: {sum(p.numel() for p in lm.parameters()) / 1e6:.1f} M bf16 parameters "
        f"({nbytes / 2**20:.0f} MiB); trainer: 2 dim-0 ranks; engines: TP {tp}, fused gate_up"
    )
    opt = torch.optim.AdamW(lm.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)

    def step() -> float:
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
        logits = lm(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return float(loss.detach())

    async with (
        listening(DaemonOptions(port=0, deltas=True)) as (_app, url),
        RefitClient(url) as client,
    ):
        buffers: list[list[Any] | None] = [None, None]

        async def publish(version: int) -> None:
            held = buffers[version % 2]
            if held is not None:
                await client.wait_drain(MODEL, version - 2, 60.0, retire=True)
            buffers[version % 2] = await _publish(client, held, lm, version)

        def receivers(cls: Any, **kw: Any) -> list[Any]:
            out = []
            for rank in range(tp):
                out.append(
                    cls(
                        local=client,
                        source=client,
                        model=MODEL,
                        engine=TPEngine(vocab, hidden, layers, tp, rank),
                        twin=lambda rank=rank: TPEngine(vocab, hidden, layers, tp, rank),
                        capture=lambda twin, manifest: capture_geometry(twin, manifest),
                        **kw,
                    )
                )
            return out

        delta = receivers(DeltaReceiver)
        full = receivers(DaemonReceiver)
        await publish(1)
        for r in delta + full:
            await r.refit(1)
        totals = dict(changed=0, units=0, dwire=0, fwire=0, dt=0.0, ft=0.0)
        verified = True
        print(
            f"{'v':>3} {'loss':>7} {'changed':>9} {'compare_s':>9} {'delta_B':>11} "
            f"{'full_B':>11} {'delta_s':>8} {'full_s':>8} {'exact':>5}"
        )
        for v in range(2, args.steps + 2):
            loss = step()
            await publish(v)
            info = await client.delta_info(MODEL, v, wait_s=60.0)
            dwire = fwire = 0
            dt = ft = 0.0
            for r in full:
                t0 = time.perf_counter()
                stats = await r.refit(v)
                ft += time.perf_counter() - t0
                fwire += stats.pull.bytes_total
            parts = [0.0] * 9
            for r in delta:
                t0 = time.perf_counter()
                await r.refit(v)
                dt += time.perf_counter() - t0
                assert r.last is not None
                if r.last.kind != "delta":
                    print(f"  rank refitted in full: {r.last.reason}")
                dwire += r.last.wire_bytes
                st = r.last.refit
                d = r.last
                split = [st.manifest_s, st.plan_s, d.check_s, d.stage_s, st.pull_s]
                split += [d.place_s, d.write_s, d.digest_s, d.post_s]
                for i, x in enumerate(split):
                    parts[i] += x
            exact = all(
                torch.equal(a.view(torch.int16), b.view(torch.int16))
                for d, f in zip(delta, full, strict=True)
                for a, b in zip(d.engine.parameters(), f.engine.parameters(), strict=True)
            )
            verified &= exact
            units = info.compared_bytes // max(info.unit, 1)
            totals["changed"] += info.changed
            totals["units"] += units
            totals["dwire"] += dwire
            totals["fwire"] += fwire
            totals["dt"] += dt
            totals["ft"] += ft
            frac = info.changed / units if units else math.nan
            print(
                f"{v:>3} {loss:>7.3f} {frac:>9.4%} {info.seconds:>9.3f} {dwire:>11,} "
                f"{fwire:>11,} {dt:>8.3f} {ft:>8.3f} {int(exact):>5}"
            )
            for i, x in enumerate(parts):
                totals[f"p{i}"] = totals.get(f"p{i}", 0.0) + x
            print(
                "      delta seconds: lease+manifest {:.3f}, plan {:.3f}, engine check {:.3f}, "
                "source staging {:.3f}, pull {:.3f}, place {:.3f}, write+undo {:.3f}, "
                "digest {:.3f}, post-load {:.3f}".format(*parts)
            )
        for r in delta + full:
            await r.close()
    cf = totals["changed"] / totals["units"] if totals["units"] else math.nan
    wr = totals["dwire"] / totals["fwire"] if totals["fwire"] else math.nan
    tr = totals["dt"] / totals["ft"] if totals["ft"] else math.nan
    keys = ("manifest", "plan", "check", "stage", "pull", "place", "write", "digest", "post")
    shares = " ".join(f"{k}_s={totals.get(f'p{i}', 0.0):.3f}" for i, k in enumerate(keys))
    print(f"delta_s={totals['dt']:.3f} full_s={totals['ft']:.3f} {shares}")
    print(
        f"changed_fraction={cf:.4f} wire_ratio={wr:.4f} delta_time_ratio={tr:.3f} "
        f"verified={int(verified)}"
    )
    return 0 if verified else 1
