"""The synthetic model of ``refitd bench refit``: made on demand, checked bit for bit.

- :func:`synthetic_config`: a Llama-shaped bf16 model of a given size in GiB;
- :class:`SyntheticState`: its checkpoint for one version, each tensor made on first
  access from (name, version), so a layout walks it with bounded memory;
- :func:`verify_ranks`: every parameter of every engine rank equals what the engine's
  own loader makes of the full checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SyntheticState", "model_bytes", "same_bits", "synthetic_config", "verify_ranks"]


def synthetic_config(gib: float) -> Any:
    """A Llama-shaped bf16 model (hidden 4096, GQA 32/8, MLP 11008, vocab 32000) with
    as many layers as it takes to reach ``gib`` GiB (at least one). Below 0.05 GiB the
    shapes shrink 16-fold (hidden 256, MLP 688, vocab 2048): a model of a few MiB for
    tests of the flow itself."""
    import torch

    from refitd.testing.engines import ModelConfig

    scale = 16 if gib < 0.05 else 1

    def cfg(layers: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=32000 if scale == 1 else 2048,
            hidden_size=4096 // scale,
            num_layers=layers,
            intermediate_size=11008 // scale,
            num_heads=32 // min(scale, 4),
            num_kv_heads=8 // min(scale, 4),
            head_dim=128 // scale * min(scale, 4),
            dtype=torch.bfloat16,
        )

    layers = 1
    while model_bytes(cfg(layers)) < gib * 2**30:
        layers += 1
    return cfg(layers)


def model_bytes(cfg: Any) -> int:
    from refitd.testing.checkpoints import param_roles

    return sum(math.prod(shape) * cfg.dtype.itemsize for _, shape, _ in param_roles(cfg))


class SyntheticState(dict):  # type: ignore[type-arg]
    """A checkpoint whose tensors are made on first access from (name, version): a
    cheap position-dependent bf16 pattern, finite (no NaN), different per version.
    Accessed tensors are not kept, so a layout can walk it with bounded memory."""

    def __init__(self, cfg: Any, version: int) -> None:
        from refitd.testing.checkpoints import param_roles

        super().__init__()
        self.cfg = cfg
        self.version = version
        self.shapes = {name: shape for name, shape, _ in param_roles(cfg)}

    def __getitem__(self, name: str) -> Any:
        import zlib

        import torch

        shape = self.shapes[name]
        seed = (zlib.crc32(name.encode()) + 7919 * self.version) & 0x7FFF
        bits = torch.arange(math.prod(shape), dtype=torch.int32)
        bits.mul_(40503).add_(seed).bitwise_and_(0xBFFF)  # bit 14 clear: finite bf16
        return bits.to(torch.int16).view(torch.bfloat16).view(shape)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Any:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def keys(self) -> Any:
        return self.shapes.keys()

    def items(self) -> Any:
        return ((n, self[n]) for n in self.shapes)


def same_bits(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 2:
        return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
    return bool(torch.equal(a, b))


def verify_ranks(cfg: Any, version: int, ranks: list[Any]) -> bool:
    """Every parameter equals the engine's own loader run on the full checkpoint."""
    from refitd.testing.engines import ToyEngine

    state = SyntheticState(cfg, version)
    for par, engine, _ in ranks:
        truth = ToyEngine(cfg, par)
        truth.load_weights(state.items())
        want = dict(truth.named_parameters())
        if not all(same_bits(p, want[n]) for n, p in engine.named_parameters()):
            return False
        del truth, want
    return True
