"""LoRA adapters as refitd models: the trainer's side (docs/vllm.md, "LoRA adapters").

A PEFT-format adapter (``...<module>.lora_A.weight`` ``[r, in]`` and
``...<module>.lora_B.weight`` ``[out, r]`` per target module, with its rank, alpha and
target modules) is published as versions of a refitd model of its own, one per
adapter, from a plain state dict (this rank's tensors, no gather). The adapter's
configuration travels with each update call (:func:`lora_update`), as PEFT's
``adapter_config.json`` does beside its tensors; the engine's worker plans the refit
from both (:mod:`refitd.integrations.vllm.lora`).

:func:`save_peft` writes the same adapter as PEFT does on disk (what vLLM's
``LoRARequest(path)`` loads), for the tests and ``refitd bench lora`` to compare with.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refitd.errors import PlanError
from refitd.integrations.sources import (
    LocalShard,
    NameMap,
    ShardPublisher,
    ShardSource,
    TensorSource,
)

__all__ = [
    "AdapterRefused",
    "LoraConfig",
    "LoraPublisher",
    "check_peft_shapes",
    "check_peft_state",
    "lora_update",
    "peft_names",
    "save_peft",
]

PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
"""A PEFT adapter tensor: ``<module>.lora_A.weight`` or ``<module>.lora_B.weight``."""


class AdapterRefused(PlanError):
    """An adapter that cannot be published or refitted exactly, refused before any byte
    moves; the message names the adapter and why."""


@dataclass(frozen=True)
class LoraConfig:
    """A PEFT LoRA configuration (the fields of ``adapter_config.json`` vLLM reads)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def peft(self) -> dict[str, Any]:
        """The ``adapter_config.json`` content."""
        return {
            "peft_type": "LORA",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "bias": "none",
        }


def check_peft_state(name: str, state: dict[str, torch.Tensor], config: LoraConfig) -> None:
    """Refuse (:class:`AdapterRefused`) a state dict that is not a whole PEFT LoRA
    adapter of ``config`` (:func:`check_peft_shapes`)."""
    check_peft_shapes(name, {k: tuple(t.shape) for k, t in state.items()}, config)


def check_peft_name(name: str, key: str) -> re.Match[str]:
    """``key``'s PEFT parts, or :class:`AdapterRefused` naming it."""
    m = PEFT_KEY.match(key)
    if m is None:
        raise AdapterRefused(
            f"adapter {name!r}: {key!r} is not a PEFT LoRA weight "
            "('<module>.lora_A.weight' or '<module>.lora_B.weight')"
        )
    return m


def check_peft_shapes(
    name: str, shapes: dict[str, tuple[int, ...]], config: LoraConfig | None = None
) -> None:
    """Refuse (:class:`AdapterRefused`) tensors (full name -> global shape) that are not
    a whole PEFT LoRA adapter: a key that is no ``lora_A``/``lora_B`` weight, a tensor
    that is not 2-D, a module with only one of the pair, a pair whose ranks disagree,
    or (with ``config`` and no rank pattern) a rank other than ``r``. The trainer checks
    a whole state dict; the engine checks every version's merged manifest."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = check_peft_name(name, key)
        if len(shape) != 2:
            raise AdapterRefused(f"adapter {name!r}: {key!r} has shape {shape}, not 2-D")
        pairs.setdefault(m["module"], {})[m["ab"]] = shape
    if not pairs:
        raise AdapterRefused(f"adapter {name!r}: no LoRA weights")
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterRefused(f"adapter {name!r}: {module!r} has lora_{''.join(ab)} only")
        if ab["A"][0] != ab["B"][1]:
            raise AdapterRefused(
                f"adapter {name!r}: {module!r} lora_A {ab['A']} and lora_B {ab['B']} "
                "disagree on the rank"
            )
    if config is not None and not config.rank_pattern:
        off = sorted(m for m, ab in pairs.items() if ab["A"][0] != config.r)
        if off:
            raise AdapterRefused(
                f"adapter {name!r}: rank r={config.r} but {off[0]!r} has rank "
                f"{pairs[off[0]]['A'][0]} ({len(off)} modules differ)"
            )


def peft_names(adapter: str = "default", prefix: str = "base_model.model.") -> NameMap:
    """A ``name_map`` from a PEFT model's parameter names to its saved names
    (``...q_proj.lora_A.default.weight`` -> ``base_model.model....q_proj.lora_A.weight``,
    the prefix added where missing), leaving out every parameter that is not a LoRA
    weight of ``adapter`` (the frozen base model's), for FSDP2-sharded adapters:
    ``LoraPublisher.publish(FSDPSource(peft_model, name_map=peft_names()), N)``."""
    part = f".{adapter}."

    def mapped(trainer_name: str) -> str | None:
        name = trainer_name.replace(part, ".")
        if name == trainer_name or PEFT_KEY.match(name) is None:
            return None
        return name if name.startswith(prefix) else prefix + name

    return mapped


def save_peft(path: Path, state: dict[str, torch.Tensor], config: LoraConfig) -> Path:
    """Write ``state`` and ``config`` as PEFT does: ``adapter_model.safetensors`` and
    ``adapter_config.json`` in ``path`` (created)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config.peft()))
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors")
    )
    return path


class LoraPublisher:
    """Publishes one adapter's PEFT state dict as versions of refitd model ``model``,
    this rank's part of each (``rank`` of ``world_size`` publishing ranks)."""

    def __init__(
        self,
        daemon: Any,
        model: str,
        config: LoraConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        adopt: bool = False,
    ) -> None:
        self.model = model
        self.config = config
        self.shards = ShardPublisher(daemon, model, rank, world_size, adopt=adopt)

    async def publish(self, source: dict[str, torch.Tensor] | ShardSource, version: int) -> int:
        """Publish this rank's part of the adapter as ``version``: a whole PEFT state
        dict (checked whole: :func:`check_peft_state`), or a shard source such as
        ``FSDPSource(peft_model, name_map=peft_names())`` for FSDP2-sharded adapter
        parameters, each rank publishing its own rows with no gather (the names are
        checked here; the pairs and ranks by the engine, on the merged manifest)."""
        if isinstance(source, dict):
            check_peft_state(self.model, source, self.config)
            source = TensorSource(source)
        else:
            shards = list(source.shards())
            for s in shards:
                check_peft_name(self.model, s.name)
            source = _Listed(shards)
        await self.shards.publish(source, version)
        return version

    async def close(self) -> None:
        await self.shards.close()


class _Listed:
    """Shards already listed (a source's ``shards()`` runs once per round)."""

    def __init__(self, shards: list[LocalShard]) -> None:
        self._shards = shards

    def shards(self) -> list[LocalShard]:
        return self._shards


def lora_update(
    name: str, adapter_id: int, model: str, version: int | None, config: LoraConfig
) -> dict[str, Any]:
    """The ``update_weights`` info that refits adapter ``name`` (vLLM's
    ``LoRARequest(name, adapter_id, ...)``) to ``version`` of refitd model ``model``."""
    return {
        "phase": "lora",
        "version": version,
        "lora": {"name": name, "id": adapter_id, "model": model, "config": config.peft()},
    }
