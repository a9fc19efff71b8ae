"""Delta-refit helpers shared by the delta tests: versions that change in chosen
patterns, and a trainer that double-buffers its versions as a real one would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.bench.refit import publish_layout
from refitd.client.http import RefitClient
from refitd.testing.layouts import Published

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Change:
    """How a version differs from the one before: ``"none"``, ``"all"``, ``"some"``
    (a fraction ``frac`` of elements, drawn with ``seed``), or ``"tensor"`` (every
    element of the ``seed``-th tensor, the rest unchanged)."""

    kind: str
    frac: float = 0.0
    seed: int = 0


def changed(state: dict[str, torch.Tensor], change: Change) -> dict[str, torch.Tensor]:
    """``state`` with ``change`` applied: a changed element's bytes always differ."""
    gen = torch.Generator().manual_seed(change.seed)
    out: dict[str, torch.Tensor] = {}
    names = sorted(state)
    for i, name in enumerate(names):
        t = state[name].clone()
        bits = t.view(_INT[t.element_size()]).reshape(-1)
        if change.kind == "all" or (change.kind == "tensor" and i == change.seed % len(names)):
            bits += 1
        elif change.kind == "some":
            mask = torch.rand(bits.numel(), generator=gen) < change.frac
            bits[mask] += 1
        out[name] = t
    return out


@dataclass
class DoubleBuffered:
    """A trainer that publishes odd versions into one set of regions and even ones
    into another, retiring the version a buffer held before rewriting it: the
    version before the newest stays READY, the base its daemon compares with."""

    client: RefitClient
    model: str
    layout: Callable[[dict[str, torch.Tensor]], Published]
    buffers: list[list[Any] | None] = field(default_factory=lambda: [None, None])

    async def publish(self, version: int, state: dict[str, torch.Tensor]) -> Published:
        pub = self.layout(state)
        held = self.buffers[version % 2]
        if held is not None:
            await self.client.wait_drain(self.model, version - 2, 30.0, retire=True)
        self.buffers[version % 2] = await publish_layout(
            self.client, self.model, pub, version, held
        )
        return pub


class ColumnSwap(torch.nn.Module):
    """An engine whose loader puts columns 4..7 of the checkpoint's ``w`` into columns
    0..3 of its parameter: strided on both sides, so its pack spec lands scattered."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16), requires_grad=False)
        self.w.weight_loader = self._columns  # type: ignore[attr-defined]

    @staticmethod
    def _columns(param: torch.Tensor, loaded: torch.Tensor) -> None:
        param[:, 0:4].copy_(loaded[:, 4:8])

    def load_weights(self, weights: Any) -> None:
        for _, loaded in weights:
            self.w.weight_loader(self.w, loaded)  # type: ignore[attr-defined]


@dataclass
class ColumnTrainer:
    """Two ranks publishing ``w`` (16, 8) as column blocks, double-buffered as
    :class:`DoubleBuffered` does (no dim-0 rows, so nothing is a full read)."""

    client: RefitClient
    model: str
    buffers: list[list[Any] | None] = field(default_factory=lambda: [None, None])

    async def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        from refitd.client.publisher import Publisher

        held = self.buffers[version % 2]
        if held is not None:
            await self.client.wait_drain(self.model, version - 2, 30.0, retire=True)
        else:
            held = []
            for part in (0, 1):
                pub = Publisher(self.client, self.model, part, 2)
                await pub.reserve(1024)
                held.append(pub)
            self.buffers[version % 2] = held
        for part, pub in enumerate(held):
            block = state["w"][:, part * 4 : part * 4 + 4].contiguous()
            pub.put("w", block, (16, 8), (0, part * 4))
            await pub.publish(version)
