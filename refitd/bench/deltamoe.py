"""``refitd bench delta --moe``: a delta refit of a MoE model with ten thousands of
expert tensors, into a vLLM-style fused expert layout.

The trainer's checkpoint has one tensor per expert and projection
(``layers.L.experts.E.{gate,up,down}``: ``--moe-layers`` × ``--experts`` × 3, 48 ×
128 × 3 = 18,432 by default, of small widths). The engine fuses them as vLLM's
``FusedMoE`` does: per layer ``w13`` ``(experts, 2 × inter, hidden)`` (gate then up)
and ``w2`` ``(experts, hidden, inter)``, loaded by a ``weight_loader(param, loaded,
shard_id, expert_id)``. Each version changes ``--frac`` of the values by one or two
ulps (what an AdamW step at a small learning rate does; the values are drawn, not
trained, so the run is quick), and is published double-buffered through one daemon
with deltas on.

A delta engine and a full engine refit every version; after each the two are
compared bit for bit. A delta's apply (placing, writes with their undo record, the
engine digest's update) costs O(changed bytes): it has no step per tensor, so it
stays a small share of the refit whatever the tensor count. The last line::

    experts=… tensors=… changed_fraction=… wire_ratio=… apply_share=… verified=1

``apply_share``: the deltas' apply seconds ÷ their refit seconds (target ≤ 0.2).
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

MODEL = "delta-moe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moe-layers", type=int, default=48, help="MoE layers (default 48)")
    parser.add_argument("--experts", type=int, default=128, help="experts per layer (128)")
    parser.add_argument("--moe-hidden", type=int, default=64, help="model width (64)")
    parser.add_argument("--moe-inter", type=int, default=32, help="expert width (32)")
    parser.add_argument(
        "--frac", type=float, default=0.02, help="values changed per version (0.02)"
    )


class FusedMoE(nn.Module):
    """The engine: per layer ``w13`` and ``w2`` of every expert, fused as vLLM does."""

    def __init__(self, layers: int, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        for i in range(layers):
            for name, shape in (
                ("w13", (experts, 2 * inter, hidden)),
                ("w2", (experts, hidden, inter)),
            ):
                p = nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)
                p.weight_loader = self._expert  # type: ignore[attr-defined]
                self.register_parameter(f"{name}_{i}", p)

    def _expert(self, p: torch.Tensor, w: torch.Tensor, shard: str, expert: int) -> None:
        e = p[expert]  # vLLM: expert_data = param.data[expert_id]
        if shard == "w2":
            e.copy_(w)
        else:
            e.narrow(0, 0 if shard == "w1" else self.inter, self.inter).copy_(w)

    def load_weights(self, weights: Any) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            _, layer, _, expert, proj = name.split(".")
            shard = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
            p = params[f"{'w2' if shard == 'w2' else 'w13'}_{layer}"]
            p.weight_loader(p, w, shard, int(expert))  # type: ignore[attr-defined]


def _checkpoint(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    h, f = args.moe_hidden, args.moe_inter
    out = {}
    for layer in range(args.moe_layers):
        for e in range(args.experts):
            for proj, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
                w = torch.randn(*shape, generator=gen) * 0.02
                out[f"layers.{layer}.experts.{e}.{proj}"] = w.to(torch.bfloat16)
    return out


def _step(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor with ``frac`` of its values moved by one or two ulps, one flat
    draw for the whole checkpoint (no Python step per value)."""
    gen = torch.Generator().manual_seed(seed)
    names = list(state)
    flat = torch.cat([state[n].reshape(-1) for n in names]).view(torch.int16)
    mask = torch.rand(flat.numel(), generator=gen) < frac
    step = torch.randint(1, 3, (int(mask.sum()),), generator=gen, dtype=torch.int16)
    flat[mask] += step
    flat = flat.view(torch.bfloat16)
    out, at = {}, 0
    for n in names:
        k = state[n].numel()
        out[n] = flat[at : at + k].view(state[n].shape)
        at += k
    return out


async def _publish(
    client: Any, pubs: list[Any] | None, state: dict[str, torch.Tensor], v: int
) -> list[Any]:
    from refitd.client.publisher import ALIGN, Publisher

    if pubs is None:
        pubs = [Publisher(client, MODEL, 0, 1)]
        room = sum(-(-t.nbytes // ALIGN) * ALIGN for t in state.values())
        await pubs[0].reserve(room, label=f"bench-delta-moe{v % 2}")
    for name, t in state.items():
        pubs[0].put(name, t)
    await pubs[0].publish(v)
    return pubs


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from refitd.client.deltarefit import DeltaReceiver
    from refitd.client.http import RefitClient
    from refitd.client.receiver import DaemonReceiver
    from refitd.config import load_config
    from refitd.daemon.app.node import Daemon
    from refitd.daemon.app.process import listening
    from refitd.reshard.geometry import capture_geometry

    shape = (args.moe_layers, args.experts, args.moe_hidden, args.moe_inter)
    state = _checkpoint(args)
    nbytes = sum(t.nbytes for t in state.values())
    print(
        f"model: {len(state):,} expert tensors ({args.moe_layers} layers x {args.experts} "
        f"experts x 3, {nbytes / 2**20:.0f} MiB bf16); engine: fused w13/w2 per layer"
    )
    config = load_config(None, {}, {"server.port": 0, "pulls.deltas": True})
    async with listening(Daemon(config)) as (_app, url), RefitClient(url) as client:

        def receiver(cls: Any, **kw: Any) -> Any:
            return cls(
                local=client,
                source=client,
                model=MODEL,
                engine=FusedMoE(*shape),
                twin=lambda: FusedMoE(*shape),
                capture=lambda twin, manifest: capture_geometry(twin, manifest),
                **kw,
            )

        delta, full = receiver(DeltaReceiver), receiver(DaemonReceiver)
        buffers: list[list[Any] | None] = [None, None]
        t = {
            "changed": 0.0,
            "units": 0.0,
            "dwire": 0.0,
            "fwire": 0.0,
            "dt": 0.0,
            "apply": 0.0,
            "plan": 0.0,
        }
        verified = True
        print(
            f"{'v':>3} {'changed':>9} {'delta_B':>11} {'full_B':>11} {'delta_s':>8} {'apply_s':>8} {'exact':>5}"
        )
        for v in range(1, args.steps + 2):
            if v > 1:
                state = _step(state, args.frac, v)
            if buffers[v % 2] is not None:
                await client.wait_drain(MODEL, v - 2, 60.0, retire=True)
            buffers[v % 2] = await _publish(client, buffers[v % 2], state, v)
            info = await client.delta_info(MODEL, v, wait_s=120.0)
            await full.refit(v)
            t0 = time.perf_counter()
            await delta.refit(v)
            dt = time.perf_counter() - t0
            d = delta.last
            assert d is not None
            exact = all(
                torch.equal(a.view(torch.int16), b.view(torch.int16))
                for a, b in zip(delta.engine.parameters(), full.engine.parameters(), strict=True)
            )
            verified &= exact
            if v == 1:
                continue
            if d.kind != "delta":
                print(f"  refitted in full: {d.reason}")
            units = info.compared_bytes // max(info.unit, 1)
            t["changed"] += info.changed
            t["units"] += units
            t["dwire"] += d.wire_bytes
            t["fwire"] += d.full_bytes
            t["dt"] += dt
            t["apply"] += d.apply_s
            t["plan"] += d.refit.plan_s
            print(
                f"{v:>3} {info.changed / max(units, 1):>9.4%} {d.wire_bytes:>11,} {d.full_bytes:>11,} "
                f"{dt:>8.3f} {d.apply_s:>8.3f} {int(exact):>5}"
            )
            print(
                f"      delta seconds: manifest {d.refit.manifest_s:.3f}, plan {d.refit.plan_s:.3f}, "
                f"check {d.check_s:.3f}, source staging {d.stage_s:.3f}, "
                f"pull {d.refit.pull_s:.3f}, place {d.place_s:.3f}, write+undo {d.write_s:.3f}, "
                f"digest {d.digest_s:.3f}"
            )
        for r in (delta, full):
            await r.close()
    cf = t["changed"] / t["units"] if t["units"] else math.nan
    wr = t["dwire"] / t["fwire"] if t["fwire"] else math.nan
    share = t["apply"] / t["dt"] if t["dt"] else math.nan
    per = t["dwire"] / t["changed"] if t["changed"] else math.nan
    print(
        f"delta_s={t['dt']:.3f} apply_s={t['apply']:.3f} plan_s={t['plan']:.3f} "
        f"wire_B_per_change={per:.2f}"
    )
    print(
        f"experts={args.moe_layers * args.experts} tensors={len(state)} changed_fraction={cf:.4f} "
        f"wire_ratio={wr:.4f} apply_share={share:.3f} verified={int(verified)}"
    )
    return 0 if verified else 1
