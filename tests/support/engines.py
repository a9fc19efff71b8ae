"""Toy-engine helpers shared by the refit tests: a zeroed engine and a bit-exact check."""

from __future__ import annotations

import torch

from refitd.testing.engines import EngineParallel, ModelConfig, ToyEngine


def zeroed_engine(cfg: ModelConfig, par: EngineParallel) -> ToyEngine:
    """An engine rank whose every parameter is zero (so a missed write shows)."""
    eng = ToyEngine(cfg, par)
    with torch.no_grad():
        for p in eng.parameters():
            p.zero_()
    return eng


def mismatched(
    engine: torch.nn.Module, cfg: ModelConfig, par: EngineParallel, state: dict[str, torch.Tensor]
) -> list[str]:
    """Names of ``engine``'s parameters that differ, bit for bit, from what the
    engine's own loader makes of the full checkpoint ``state`` (empty: all equal)."""
    truth = ToyEngine(cfg, par)
    truth.load_weights(state.items())
    want = dict(truth.named_parameters())
    return [n for n, p in engine.named_parameters() if not torch.equal(p, want[n])]
