"""Quantized refit: a trainer publishes the engine's quantized checkpoint format.

:class:`QuantizingSource` wraps any trainer source (:class:`~refitd.integrations.sources.
TensorSource`, :class:`~refitd.integrations.sources.FSDPSource`,
:class:`~refitd.integrations.sources.MegatronSource`). For every weight the engine's
``quantization_config`` quantizes, it publishes, in place of the trainer's bf16 block,
the quantized block (``<module>.weight``: int8 or float8_e4m3fn) and its scales
(``<module>.weight_scale``) under the checkpoint's names; every other tensor passes
through as it is. The engine's own loaders then read exactly what they read from a
quantized checkpoint on disk.

The format is the `compressed-tensors` library's (the one vLLM loads): its
``QuantizationArgs`` say what a scheme is, its ``calculate_qparams`` turns observed
ranges into scales, and its compressor (``int-quantized``, ``float-quantized``) turns
a weight and its scales into the stored bytes. The only step written here is the
observation the library leaves to its callers: the min and max of each output
channel, or of each ``block_structure`` block (zero-padded at the tensor's edge, as
the library pads).

Which weights are quantized follows the config's groups (``targets``) and ``ignore``,
matched with the library's ``is_match`` against a module tree named as the checkpoint
is (the trainer's own model, or one built on the meta device from the engine's
Hugging Face config: :func:`checkpoint_modules`).

Each rank quantizes only its own block, with no collective:

- **per output channel** (``strategy: channel``): a channel's scale depends on its whole
  row, so a block of whole rows (FSDP2 ``Shard(0)``, a TP row split) quantizes exactly
  on its own, and its scales are rows ``[r0, r1)`` of the ``[out, 1]`` scale tensor. A
  block that holds only some columns of a row is refused, naming the parameter.
- **per block** (``strategy: block``, e.g. 128x128): a block of the weight whose edges
  fall on block boundaries (or on the tensor's own edge) quantizes exactly on its own.
  A block layout whose quantization blocks straddle a shard boundary is **refused**,
  naming the parameter and the boundary (an exact answer would need the other rank's
  maxima: a collective this source does not make).

Other strategies (per tensor, per group) and asymmetric schemes are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refitd.errors import ConfigError, PlanError
from refitd.integrations.sources import LocalShard, ShardSource

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

__all__ = [
    "SCALE_DTYPE",
    "QuantizedWeight",
    "QuantizingSource",
    "checkpoint_modules",
    "config_dict",
    "load_quantization_config",
    "quantization_config",
    "quantize_weight",
    "quantized_state_dict",
    "save_quantized_model",
    "scale_block",
    "weight_schemes",
]

SCALE = "weight_scale"
"""The scale's leaf name next to a quantized ``weight`` (compressed-tensors' name)."""

SCALE_DTYPE = torch.float32
"""The dtype scales are published and saved in. compressed-tensors computes them in
the weight's dtype (bf16); vLLM's loaders hold them in float32 and cast on load. A
refit moves bytes and never casts, so the source widens them first; bf16 -> float32
is exact, so the engine holds the same values either way."""

_PRESETS = {
    "int8": ("W8A8", "int-quantized"),
    "fp8": ("FP8_DYNAMIC", "float-quantized"),
    "fp8-block": ("FP8_BLOCK", "float-quantized"),
}


def quantization_config(kind: str = "int8", ignore: tuple[str, ...] = ("lm_head",)) -> Any:
    """A compressed-tensors ``QuantizationConfig`` of every ``Linear`` but ``ignore``:
    ``int8`` (W8A8: int8 weights per output channel, dynamic per-token int8 activations),
    ``fp8`` (float8 e4m3 weights per output channel, dynamic activations) or
    ``fp8-block`` (float8 e4m3 weights per 128x128 block), as a compressed checkpoint."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    if kind not in _PRESETS:
        raise ConfigError(f"quantization {kind!r} is not one of {sorted(_PRESETS)}")
    preset, fmt = _PRESETS[kind]
    return QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        format=fmt,
        quantization_status="compressed",
        ignore=list(ignore),
    )


def load_quantization_config(config: Any) -> QuantizationConfig:
    """The compressed-tensors ``QuantizationConfig`` of ``config``: one already, a
    ``quantization_config`` dict, a whole Hugging Face ``config.json`` dict holding one,
    or the path of such a file or of the model directory holding it."""
    from compressed_tensors.quantization import QuantizationConfig

    if isinstance(config, QuantizationConfig):
        return config
    if isinstance(config, str | Path):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text())
    if not isinstance(config, Mapping):
        raise ConfigError(f"not a quantization config: {type(config).__name__}")
    if "config_groups" not in config:
        if "quantization_config" not in config:
            raise ConfigError("the model config has no quantization_config: nothing to quantize")
        config = config["quantization_config"]
    method = config.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise ConfigError(
            f"quant_method {method!r}: the quantizing source writes compressed-tensors "
            "checkpoints only"
        )
    return QuantizationConfig.model_validate(dict(config))


def config_dict(qc: QuantizationConfig) -> dict[str, Any]:
    """``qc`` as the ``quantization_config`` entry of a ``config.json``."""
    out: dict[str, Any] = qc.model_dump(mode="json", exclude_none=True)
    out["quant_method"] = "compressed-tensors"
    return out


def checkpoint_modules(hf_config: Mapping[str, Any]) -> torch.nn.Module:
    """The Hugging Face model of ``hf_config`` (a ``config.json`` dict) built on the
    meta device: module names and classes as the checkpoint's, no storage."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config.items() if k not in ("architectures", "quantization_config")}
    )
    cls = getattr(transformers, hf_config["architectures"][0])
    with torch.device("meta"):
        model: torch.nn.Module = cls(cfg)
    return model


def weight_schemes(modules: torch.nn.Module, config: Any) -> dict[str, QuantizationArgs]:
    """Checkpoint name of each weight ``config`` quantizes -> its weights'
    ``QuantizationArgs``: modules matched by a group's ``targets`` (names or classes,
    the library's ``is_match``) and by no ``ignore`` entry; the first group wins."""
    from compressed_tensors.utils.match import is_match

    qc = load_quantization_config(config)
    ignore = list(qc.ignore or [])
    out: dict[str, QuantizationArgs] = {}
    for name, module in modules.named_modules():
        if not name or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        for scheme in qc.config_groups.values():
            assert not isinstance(scheme, list)  # presets are expanded on validation
            if scheme.weights is not None and is_match(name, module, scheme.targets, ignore):
                out[f"{name}.weight"] = scheme.weights
                break
    return out


# ---------------------------------------------------------------- one tensor


def _check_args(name: str, args: QuantizationArgs) -> None:
    from compressed_tensors.quantization import QuantizationStrategy

    if args.strategy not in (QuantizationStrategy.CHANNEL, QuantizationStrategy.BLOCK):
        raise PlanError(
            f"{name!r}: weight strategy {args.strategy!s} is not supported (per output "
            "channel or per block only: their scales are local to a rank's block)"
        )
    if not args.symmetric or args.dynamic:
        raise PlanError(f"{name!r}: only static symmetric weight quantization is supported")
    if args.num_bits != 8:
        raise PlanError(f"{name!r}: {args.num_bits}-bit weights are not supported (8 only)")


def _observe(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each output channel (``[out, 1]``) or of each block
    (``[ceil(out / bh), ceil(in / bw)]``, the padding zeros included as the library
    pads): the observation compressed-tensors leaves to its callers."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    assert args.block_structure is not None
    bh, bw = args.block_structure
    padded = maybe_pad_tensor_for_block_quant(weight, tuple(args.block_structure))
    blocks = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight (or a block of one) in the checkpoint's quantized format."""

    weight: torch.Tensor
    scale: torch.Tensor


def quantize_weight(
    weight: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """``weight`` (2-D, float) quantized as compressed-tensors stores it under ``args``:
    scales from the library's ``calculate_qparams`` over the observed ranges (in the
    weight's dtype, as the library initializes them), bytes from its compressor. The
    scales are then widened to ``scale_dtype`` when given (exactly: see
    :data:`SCALE_DTYPE`)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    if weight.dim() != 2:
        raise PlanError(f"a quantized weight is 2-D; this one is {tuple(weight.shape)}")
    lo, hi = _observe(weight, args)
    scale, zero = calculate_qparams(lo, hi, args)
    if scale.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        scale = scale.to(torch.float16)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = NaiveQuantizationCompressor.compress(
        {"weight": weight, SCALE: scale, "weight_zero_point": zero}, scheme
    )
    scale = out[SCALE] if scale_dtype is None else out[SCALE].to(scale_dtype)
    return QuantizedWeight(out["weight"].contiguous(), scale.contiguous())


def scale_block(
    name: str,
    args: QuantizationArgs,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    global_shape: tuple[int, ...],
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Where a rank's block ``shape`` at ``offset`` of weight ``name`` puts its scales:
    ``(scale offset, scale block shape, scale global shape)``. Refuses, naming ``name``,
    a block whose scales would depend on values another rank holds (see the module
    docstring)."""
    from compressed_tensors.quantization import QuantizationStrategy

    _check_args(name, args)
    if len(global_shape) != 2:
        raise PlanError(f"{name!r}: a quantized weight is 2-D; this one is {global_shape}")
    (r0, c0), (rows, cols), (out_n, in_n) = offset, shape, global_shape
    if args.strategy == QuantizationStrategy.CHANNEL:
        if c0 != 0 or cols != in_n:
            raise PlanError(
                f"{name!r}: this rank holds columns {c0}..{c0 + cols} of {in_n}; a "
                "per-channel scale needs its whole row (publish whole rows, or quantize "
                "per block with block-aligned columns)"
            )
        return (r0, 0), (rows, 1), (out_n, 1)
    assert args.block_structure is not None
    bh, bw = args.block_structure
    for axis, start, n, size, b in (("row", r0, rows, out_n, bh), ("column", c0, cols, in_n, bw)):
        end = start + n
        if start % b or (end % b and end != size):
            edge = start if start % b else end
            raise PlanError(
                f"{name!r}: {axis} {edge} of this rank's block {start}..{end} is inside a "
                f"{bh}x{bw} quantization block, so its scale depends on another rank's "
                "values; refused (shard on block boundaries)"
            )
    return (
        (r0 // bh, c0 // bw),
        (-(-rows // bh), -(-cols // bw)),
        (-(-out_n // bh), -(-in_n // bw)),
    )


# ---------------------------------------------------------------- sources


class QuantizingSource:
    """A trainer source publishing the engine's quantized format (see the module
    docstring).

    ``config`` is the engine's ``quantization_config`` (anything
    :func:`load_quantization_config` reads: the engine's model directory will do).
    ``modules`` is a module tree named as the checkpoint is, to match ``targets``
    against; by default the wrapped source's own module when it publishes one under
    its own names. ``source_bytes`` and ``wire_bytes`` count, for the last pass, the
    trainer's bytes of the tensors listed and the bytes published for them.
    """

    def __init__(
        self,
        source: ShardSource,
        config: Any,
        modules: torch.nn.Module | None = None,
        scale_dtype: torch.dtype = SCALE_DTYPE,
    ) -> None:
        self.source = source
        self.scale_dtype = scale_dtype
        self.config = load_quantization_config(config)
        if modules is None:
            modules = _own_modules(source)
        self.schemes = weight_schemes(modules, self.config)
        if not self.schemes:
            raise ConfigError("the quantization config matches no weight of the model")
        for name, args in self.schemes.items():
            _check_args(name, args)
        self.source_bytes = 0
        self.wire_bytes = 0

    def shards(self) -> Iterator[LocalShard]:
        self.source_bytes = self.wire_bytes = 0
        for shard in self.source.shards():
            self.source_bytes += shard.nbytes
            args = self.schemes.get(shard.name)
            if args is None:
                self.wire_bytes += shard.nbytes
                yield shard  # as the trainer publishes it (adoptable)
                continue
            where = scale_block(
                shard.name, args, shard.offset, tuple(shard.tensor.shape), shard.global_shape
            )
            q = quantize_weight(shard.tensor, args, self.scale_dtype)
            module = shard.name.removesuffix(".weight")
            self.wire_bytes += _nbytes(q.weight) + _nbytes(q.scale)
            yield LocalShard(shard.name, q.weight, shard.offset, shard.global_shape)
            yield LocalShard(f"{module}.{SCALE}", q.scale, where[0], where[2])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own_modules(source: Any) -> torch.nn.Module:
    """The module a source publishes under its own names (no ``name_map``)."""
    module = getattr(source, "module", None)
    if module is None and isinstance(getattr(source, "tensors", None), torch.nn.Module):
        module = source.tensors
    if module is None or getattr(source, "name_map", None) is not None:
        raise ConfigError(
            "the quantizing source needs the checkpoint's module tree to match the "
            "config's targets: pass modules= (e.g. checkpoint_modules(hf_config))"
        )
    assert isinstance(module, torch.nn.Module)
    return module


# ---------------------------------------------------------------- checkpoints


def quantized_state_dict(
    state: Mapping[str, torch.Tensor],
    config: Any,
    modules: torch.nn.Module,
    scale_dtype: torch.dtype = SCALE_DTYPE,
) -> dict[str, torch.Tensor]:
    """``state`` (checkpoint names, whole tensors) as the quantized checkpoint: what a
    :class:`QuantizingSource` publishes, whole."""
    schemes = weight_schemes(modules, config)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        args = schemes.get(name)
        if args is None:
            out[name] = t
            continue
        _check_args(name, args)
        q = quantize_weight(t, args, scale_dtype)
        out[name] = q.weight
        out[f"{name.removesuffix('.weight')}.{SCALE}"] = q.scale
    return out


def save_quantized_model(
    path: Path,
    hf_config: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    config: Any,
    modules: torch.nn.Module | None = None,
) -> Path:
    """Write the quantized checkpoint of ``state`` into ``path``: ``config.json``
    (``hf_config`` with ``config``'s ``quantization_config``) and ``model.safetensors``."""
    from safetensors.torch import save_file

    qc = load_quantization_config(config)
    modules = modules if modules is not None else checkpoint_modules(hf_config)
    tensors = quantized_state_dict(state, qc, modules)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({**hf_config, "quantization_config": config_dict(qc)})
    )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
