"""The parts of ``refitd bench delta`` (:mod:`refitd.bench.delta`) that run on either
layout, one host or two (:mod:`refitd.bench.deltahosts`): the trained model, the TP 2
engines, the trainer that publishes each step, the two engines' refits and the report."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from torch import nn

from refitd.client.deltarefit import OVERLAPPED
from refitd.client.deltarefit import WHERE as DELTA_WHERE

MODEL = "delta-bench"


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


async def _publish(client: Any, pubs: list[Any] | None, model: TinyLM, version: int) -> list[Any]:
    """Every parameter as two dim-0 blocks, part ``r`` holding block ``r``."""
    from refitd.client.publisher import ALIGN, Publisher

    params = [(n, p.detach()) for n, p in model.named_parameters()]
    blocks = []
    for n, t in params:
        half = t.shape[0] // 2
        blocks += [(0, n, t, (0,), t[:half]), (1, n, t, (half,), t[half:])]
    if pubs is None:
        pubs = [Publisher(client, MODEL, part, 2) for part in range(2)]
        for part, pub in enumerate(pubs):
            mine = [b[4].nbytes for b in blocks if b[0] == part]
            room = sum(-(-n // ALIGN) * ALIGN for n in mine)
            await pub.reserve(room, label=f"bench-delta{version % 2}")
    for part, name, t, at, block in blocks:
        offset = at + (0,) * (t.dim() - 1)
        pubs[part].put(name, block, tuple(t.shape), offset)
    for pub in pubs:
        await pub.publish(version)
    return pubs


class Trainer:
    """The trained model and its double-buffered publication through ``client``."""

    def __init__(self, args: argparse.Namespace, client: Any) -> None:
        torch.manual_seed(0)
        self.args, self.client = args, client
        self.lm = TinyLM(args.vocab, args.hidden, args.layers).to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.lm.parameters(), lr=args.lr)
        self.gen = torch.Generator().manual_seed(1)
        self.buffers: list[list[Any] | None] = [None, None]

    def describe(self) -> str:
        ps = list(self.lm.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in ps)
        return (
            f"model: {sum(p.numel() for p in ps) / 1e6:.1f} M bf16 parameters "
            f"({nbytes / 2**20:.0f} MiB); trainer: 2 dim-0 ranks; engines: TP 2, fused gate_up"
        )

    def _step(self) -> float:
        vocab, a = self.args.vocab, self.args
        tokens = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=self.gen)
        logits = self.lm(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)
        )
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        return float(loss.detach())

    async def version(self, v: int) -> dict[str, Any]:
        """Train a step (none for v1), publish version ``v``; the source's delta record."""
        loss = self._step() if v > 1 else math.nan
        held = self.buffers[v % 2]
        if held is not None:
            await self.client.wait_drain(MODEL, v - 2, 60.0, retire=True)
        self.buffers[v % 2] = await _publish(self.client, held, self.lm, v)
        if v == 1:
            return {"loss": loss}
        info = await self.client.delta_info(MODEL, v, wait_s=60.0)
        units = info.compared_bytes // max(info.unit, 1)
        return {"loss": loss, "changed": info.changed, "units": units, "compare_s": info.seconds}


class Engines:
    """Two TP 2 engines refitting every version: one by delta (``prefer``), one in full.
    ``local`` is the engines' daemon, ``source`` the trainer's."""

    def __init__(self, args: argparse.Namespace, local: Any, source: Any, prefer: str) -> None:
        from refitd.client.deltarefit import DeltaReceiver
        from refitd.client.receiver import DaemonReceiver
        from refitd.reshard.geometry import capture_geometry

        vocab, hidden, layers, tp = args.vocab, args.hidden, args.layers, 2

        def receivers(cls: Any, **kw: Any) -> list[Any]:
            return [
                cls(
                    local=local,
                    source=source,
                    model=MODEL,
                    engine=TPEngine(vocab, hidden, layers, tp, rank),
                    twin=lambda rank=rank: TPEngine(vocab, hidden, layers, tp, rank),
                    capture=lambda twin, manifest: capture_geometry(twin, manifest),
                    **kw,
                )
                for rank in range(tp)
            ]

        chunk = int(getattr(args, "chunk_mib", 16) * 2**20)
        self.delta = receivers(DeltaReceiver, prefer=prefer, chunk_bytes=chunk)
        self.full = receivers(DaemonReceiver)

    async def refit(self, v: int) -> dict[str, Any]:
        """Refit every engine rank to ``v``, the full ranks first on even versions and
        the delta ranks first on odd ones: neither kind always finds the source's
        memory warm from the other."""
        dwire = fwire = 0
        dt = ft = 0.0
        paths = set()
        parts = [0.0] * len(PARTS)
        where = dict.fromkeys(WHERE, 0.0)
        notes: list[str] = []
        deltas: list[int] = []  # wire bytes of the ranks that refitted by delta

        async def full() -> None:
            nonlocal fwire, ft
            for r in self.full:
                t0 = time.perf_counter()
                stats = await r.refit(v)
                ft += time.perf_counter() - t0
                fwire += stats.pull.bytes_total
                paths.add(stats.pull.path)

        async def delta() -> None:
            nonlocal dwire, dt
            for r in self.delta:
                t0 = time.perf_counter()
                await r.refit(v)
                wall = time.perf_counter() - t0
                dt += wall
                d = r.last
                assert d is not None
                if d.kind != "delta":
                    notes.append(f"rank refitted in full: {d.reason}")
                else:
                    deltas.append(d.wire_bytes)
                    for k, x in d.where.items():
                        where[k] += x
                    where["release"] += wall - sum(d.where[k] for k in DELTA_WHERE)
                dwire += d.wire_bytes
                st = d.refit
                split = [st.manifest_s, st.plan_s, d.check_s, d.stage_s, st.pull_s]
                split += [d.place_s, d.write_s, d.digest_s, d.post_s]
                for i, x in enumerate(split):
                    parts[i] += x

        for kind in (full, delta) if v % 2 == 0 else (delta, full):
            await kind()
        exact = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for d, f in zip(self.delta, self.full, strict=True)
            for a, b in zip(d.engine.parameters(), f.engine.parameters(), strict=True)
        )
        return {
            "dwire": dwire,
            "fwire": fwire,
            "dt": dt,
            "ft": ft,
            "parts": parts,
            "where": where,
            "exact": exact,
            "notes": notes,
            "delta_wire": sum(deltas),
            "all_delta": len(deltas) == len(self.delta),
            "path": ",".join(sorted(paths)),
        }

    async def close(self) -> None:
        for r in self.delta + self.full:
            await r.close()


WHERE = (*DELTA_WHERE, "release", *OVERLAPPED)
"""A delta's wall time cut finer (:attr:`~refitd.client.deltarefit.DeltaStats.where`):
the lease, the manifest, the plan, the engine's check, ``first`` (the stream's request
until its first chunk has come: the upload, the source's selection and its first
chunk's encoding and crossing), ``stream`` (the first chunk until the last has come,
each placed while the next crossed), ``tail`` (placing the last chunk),
``post`` (``after_apply``), and ``release`` (what is left of the bench's clock: the
lease's release). These add up to the delta's seconds; ``src_wait`` (the source's
wait for its comparison) and ``src_encode`` (its encoding of every chunk) are spent
inside ``first`` and ``stream``."""

PARTS = ("manifest", "plan", "check", "stage", "pull", "place", "write", "digest", "post")
"""A delta's seconds, in order (:class:`~refitd.client.deltarefit.DeltaStats`)."""


STAGES = ("check", "stage", "place", "write", "digest")
"""The delta's own stages, each printed as GB/s of model bytes."""


class Report:
    """The table, a line per version, and the totals' last lines."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {k: 0.0 for k in ("changed", "units", "dwire", "fwire")}
        self.t.update(dt=0.0, ft=0.0, delta_wire=0.0, delta_changed=0.0)
        self.parts = [0.0] * len(PARTS)
        self.where = dict.fromkeys(WHERE, 0.0)
        self.verified = True
        self.paths: set[str] = set()
        print(
            f"{'v':>3} {'loss':>7} {'changed':>9} {'compare_s':>9} {'delta_B':>11} "
            f"{'full_B':>11} {'delta_s':>8} {'full_s':>8} {'exact':>5}"
        )

    def version(self, v: int, src: dict[str, Any], eng: dict[str, Any]) -> None:
        for note in eng["notes"]:
            print(f"  {note}")
        self.verified &= bool(eng["exact"])
        self.paths.add(eng["path"])
        for k in ("changed", "units"):
            self.t[k] += src[k]
        for k in ("dwire", "fwire", "dt", "ft"):
            self.t[k] += eng[k]
        if eng["all_delta"]:  # bytes per changed value: versions every rank took by delta
            self.t["delta_wire"] += eng["delta_wire"]
            self.t["delta_changed"] += src["changed"]
        for i, x in enumerate(eng["parts"]):
            self.parts[i] += x
        for k, x in eng["where"].items():
            self.where[k] += x
        frac = src["changed"] / src["units"] if src["units"] else math.nan
        print(
            f"{v:>3} {src['loss']:>7.3f} {frac:>9.4%} {src['compare_s']:>9.3f} "
            f"{eng['dwire']:>11,} {eng['fwire']:>11,} {eng['dt']:>8.3f} {eng['ft']:>8.3f} "
            f"{int(eng['exact']):>5}"
        )
        print(
            "      delta seconds: lease+manifest {:.3f}, plan {:.3f}, engine check {:.3f}, "
            "source staging {:.3f}, pull {:.3f}, place {:.3f}, write+undo {:.3f}, "
            "digest {:.3f}, post-load {:.3f}".format(*eng["parts"])
        )
        print(f"      where: {_where(eng['where'])}")

    def end(self, link: str = "") -> int:
        t = self.t
        cf = t["changed"] / t["units"] if t["units"] else math.nan
        wr = t["dwire"] / t["fwire"] if t["fwire"] else math.nan
        tr = t["dt"] / t["ft"] if t["ft"] else math.nan
        shares = " ".join(f"{k}_s={x:.3f}" for k, x in zip(PARTS, self.parts, strict=True))
        print(f"where: {_where(self.where)}")
        print(f"delta_s={t['dt']:.3f} full_s={t['ft']:.3f} {shares}")
        # Each stage's speed in model bytes: what a full refit of the same versions
        # moved, over the stage's seconds (target: >= 2 GB/s each).
        speeds = " ".join(
            f"{k}_GBps={t['fwire'] / x / 1e9:.1f}" if x > 0 else f"{k}_GBps=n/a"
            for k, x in zip(PARTS, self.parts, strict=True)
            if k in STAGES
        )
        # Wire bytes per changed value: what the deltas pulled over the units the
        # source found changed (positions, differences, exceptions and page counts).
        per = t["delta_wire"] / t["delta_changed"] if t["delta_changed"] else math.nan
        shown = f"{per:.2f}" if per == per else "n/a"  # nan: no version went by delta
        print(f"{speeds} wire_B_per_change={shown}")
        path = ",".join(sorted(self.paths))
        print(
            f"changed_fraction={cf:.4f} wire_ratio={wr:.4f} delta_time_ratio={tr:.3f} "
            f"{link}path={path} verified={int(self.verified)}"
        )
        return 0 if self.verified else 1


def _where(where: dict[str, float]) -> str:
    """A delta's wall time by :data:`WHERE` key, seconds summed over its ranks."""
    return " ".join(f"{k}_s={x:.3f}" for k, x in where.items())
