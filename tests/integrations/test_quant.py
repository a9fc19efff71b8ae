"""The quantizing source: per-rank quantization equals compressed-tensors' own, bit for bit.

The reference is built from the library's pieces independently of the source's code
path: each channel's or block's scale from ``calculate_qparams`` over that channel or
block alone (a Python loop), and the bytes from the library's ``quantize`` of the whole
tensor. The source quantizes each rank's block on its own; the blocks, put back at
their offsets, must equal the reference byte for byte. CPU only: FP8 (e4m3) is tested
here too, as torch has ``float8_e4m3fn`` on CPU.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refitd.errors import ConfigError, PlanError
from refitd.integrations.quant import (
    QuantizingSource,
    load_quantization_config,
    quantization_config,
    quantize_weight,
    save_quantized_model,
    scale_block,
    weight_schemes,
)
from refitd.integrations.sources import MegatronSource, TensorSource

KINDS = ["int8", "fp8", "fp8-block"]


def args_of(kind: str) -> Any:
    (scheme,) = quantization_config(kind).config_groups.values()
    return scheme.weights


def reference(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' bytes and scales of ``weight``, one scale at a time."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = weight.shape
    if args.strategy == QuantizationStrategy.CHANNEL:
        bh, bw = 1, cols
    else:
        bh, bw = args.block_structure
    grid = [[None] * -(-cols // bw) for _ in range(-(-rows // bh))]
    for i in range(len(grid)):
        for j in range(len(grid[0])):
            block = weight[i * bh : (i + 1) * bh, j * bw : (j + 1) * bw]
            scale, _ = calculate_qparams(block.min(), block.max(), args)
            grid[i][j] = scale.reshape(())
    scales = torch.stack([torch.stack(row) for row in grid])
    q = quantize(weight, scales, torch.zeros_like(scales), args, dtype=args.pytorch_dtype())
    return q, scales


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def weight_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 4
    w[rows // 2] = 0  # an all-zero channel: the library's eps scale
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_weight_quantizes_to_compressed_tensors_bytes_and_scales(kind: str) -> None:
    args = args_of(kind)
    w = weight_like(300, 260, seed=1)  # neither dimension a multiple of 128
    got = quantize_weight(w, args)
    want_q, want_scale = reference(w, args)
    assert got.weight.dtype == args.pytorch_dtype() and got.weight.shape == w.shape
    assert torch.equal(as_bytes(got.weight), as_bytes(want_q))
    assert got.scale.dtype == torch.bfloat16  # the weight's dtype, as the library keeps it
    assert torch.equal(got.scale, want_scale.reshape(got.scale.shape))


def assemble(shards: list[Any], name: str) -> torch.Tensor:
    (shape,) = {s.global_shape for s in shards if s.name == name}
    dtype = next(s.tensor.dtype for s in shards if s.name == name)
    out = torch.full(shape, 0, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else None
    out = torch.empty(shape, dtype=dtype) if out is None else out
    seen = torch.zeros(shape, dtype=torch.bool)
    for s in shards:
        if s.name == name:
            idx = tuple(slice(o, o + n) for o, n in zip(s.offset, s.tensor.shape))
            assert not seen[idx].any(), f"{name}: blocks overlap"
            out[idx], seen[idx] = s.tensor, True
    assert seen.all(), f"{name}: blocks leave a gap"
    return out


def row_blocks(name: str, w: torch.Tensor, cuts: list[int]) -> list[Any]:
    edges = [0, *sorted(set(cuts)), w.shape[0]]
    return [(name, w[a:b].clone(), (a, 0), tuple(w.shape)) for a, b in pairwise(edges) if b > a]


class Linear2(torch.nn.Module):
    """A checkpoint module tree: ``proj`` (quantized), ``lm_head`` (ignored), ``norm``."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        with torch.device("meta"):
            self.proj = torch.nn.Linear(cols, rows, bias=False)
            self.lm_head = torch.nn.Linear(cols, rows, bias=False)
            self.norm = torch.nn.LayerNorm(cols)


def quantized_blocks(kind: str, w: torch.Tensor, cuts: list[int]) -> dict[str, torch.Tensor]:
    """Each rank (a row block of ``proj``) through its own quantizing source; the
    published blocks of every rank put back together."""
    rows, cols = w.shape
    shards: list[Any] = []
    for block in row_blocks("proj.weight", w, cuts):
        src = QuantizingSource(
            MegatronSource([block]), quantization_config(kind), Linear2(rows, cols)
        )
        shards += list(src.shards())
    return {n: assemble(shards, n) for n in {s.name for s in shards}}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["int8", "fp8"]),
    rows=st.integers(1, 70),
    cols=st.integers(1, 90),
    cuts=st.lists(st.integers(0, 70), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_per_channel_row_blocks_cut_anywhere_quantize_exactly_with_no_collective(
    kind: str, rows: int, cols: int, cuts: list[int], seed: int
) -> None:
    w = weight_like(rows, cols, seed)
    got = quantized_blocks(kind, w, [c for c in cuts if c < rows])
    want_q, want_scale = reference(w, args_of(kind))
    assert sorted(got) == ["proj.weight", "proj.weight_scale"]
    assert torch.equal(as_bytes(got["proj.weight"]), as_bytes(want_q))
    assert got["proj.weight_scale"].dtype == torch.float32  # as vLLM holds scales
    assert torch.equal(got["proj.weight_scale"], want_scale.float())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 400),
    cols=st.integers(1, 300),
    cuts=st.lists(st.integers(1, 3), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_per_block_row_blocks_cut_on_block_edges_quantize_exactly_including_a_short_last_block(
    rows: int, cols: int, cuts: list[int], seed: int
) -> None:
    w = weight_like(rows, cols, seed)
    got = quantized_blocks("fp8-block", w, [128 * c for c in cuts if 128 * c < rows])
    want_q, want_scale = reference(w, args_of("fp8-block"))
    assert got["proj.weight_scale"].shape == (-(-rows // 128), -(-cols // 128))
    assert torch.equal(as_bytes(got["proj.weight"]), as_bytes(want_q))
    assert got["proj.weight_scale"].dtype == torch.float32  # as vLLM holds scales
    assert torch.equal(got["proj.weight_scale"], want_scale.float())


def test_column_blocks_on_block_edges_quantize_exactly_per_block() -> None:
    w = weight_like(256, 384, seed=4)
    blocks = [("proj.weight", w[:, c : c + 128].clone(), (0, c), (256, 384)) for c in (0, 128, 256)]
    shards = []
    for b in blocks:
        src = QuantizingSource(
            MegatronSource([b]), quantization_config("fp8-block"), Linear2(256, 384)
        )
        shards += list(src.shards())
    want_q, want_scale = reference(w, args_of("fp8-block"))
    assert torch.equal(as_bytes(assemble(shards, "proj.weight")), as_bytes(want_q))
    assert torch.equal(assemble(shards, "proj.weight_scale"), want_scale.float())


def test_a_block_straddling_a_shard_boundary_is_refused_naming_the_parameter() -> None:
    args = args_of("fp8-block")
    with pytest.raises(PlanError, match=r"'layers\.3\.proj\.weight': row 100 .*128x128"):
        scale_block("layers.3.proj.weight", args, (100, 0), (156, 256), (256, 256))
    with pytest.raises(PlanError, match=r"'p\.weight': row 200 of this rank's block 0\.\.200"):
        scale_block("p.weight", args, (0, 0), (200, 256), (300, 256))
    with pytest.raises(PlanError, match=r"'p\.weight': column 64"):
        scale_block("p.weight", args, (0, 0), (256, 64), (256, 256))
    # the tensor's own edge may end a block anywhere
    assert scale_block("p.weight", args, (256, 0), (44, 256), (300, 256)) == (
        (2, 0),
        (1, 2),
        (3, 2),
    )
    w = weight_like(200, 128, seed=5)
    src = QuantizingSource(
        MegatronSource([("proj.weight", w[:100], (0, 0), (200, 128))]),
        quantization_config("fp8-block"),
        Linear2(200, 128),
    )
    with pytest.raises(PlanError, match=r"'proj\.weight': row 100"):
        list(src.shards())


def test_a_per_channel_scale_refuses_a_block_holding_only_some_columns_of_its_rows() -> None:
    with pytest.raises(PlanError, match=r"'p\.weight': this rank holds columns 0\.\.64 of 128"):
        scale_block("p.weight", args_of("int8"), (0, 0), (10, 64), (10, 128))


def test_what_is_quantized_follows_the_configs_targets_and_ignore_not_names() -> None:
    from refitd.bench.vllm import llama_config
    from refitd.integrations.quant import checkpoint_modules

    modules = checkpoint_modules(llama_config(layers=1))
    names = sorted(weight_schemes(modules, quantization_config("int8")))
    layer = "model.layers.0."
    assert names == sorted(
        layer + n + ".weight"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    )  # not the embedding, the norms, nor the ignored lm_head
    qc = quantization_config("int8", ignore=("lm_head", "re:.*mlp\\..*"))
    assert all("mlp" not in n for n in weight_schemes(modules, qc))


def test_unquantized_tensors_pass_through_and_wire_bytes_are_counted() -> None:
    state = {
        "proj.weight": weight_like(64, 32, seed=6),
        "lm_head.weight": weight_like(64, 32, seed=7),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
    }
    src = QuantizingSource(TensorSource(state), quantization_config("int8"), Linear2(64, 32))
    out = {s.name: s for s in src.shards()}
    assert sorted(out) == ["lm_head.weight", "norm.weight", "proj.weight", "proj.weight_scale"]
    assert out["proj.weight"].tensor.dtype == torch.int8
    assert out["lm_head.weight"].tensor.data_ptr() == state["lm_head.weight"].data_ptr()
    assert src.source_bytes == (64 * 32 * 2) * 2 + 32 * 2
    assert src.wire_bytes == 64 * 32 + 64 * 4 + 64 * 32 * 2 + 32 * 2  # float32 scales


def test_the_source_needs_a_module_tree_named_as_the_checkpoint() -> None:
    with pytest.raises(ConfigError, match="pass modules="):
        QuantizingSource(TensorSource({"proj.weight": torch.ones(2, 2)}), quantization_config())
    model = Linear2(4, 4)  # its own names are the checkpoint's
    assert QuantizingSource(TensorSource(model), quantization_config()).schemes.keys() == {
        "proj.weight"
    }


def test_unsupported_schemes_and_configs_are_refused_by_name(tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    per_tensor = QuantizationConfig(config_groups={"g": preset_name_to_scheme("FP8", ["Linear"])})
    with pytest.raises(PlanError, match=r"'proj\.weight': weight strategy tensor"):
        QuantizingSource(TensorSource({}), per_tensor, Linear2(4, 4))
    with pytest.raises(ConfigError, match="no quantization_config"):
        load_quantization_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="quant_method 'fp8'"):
        load_quantization_config({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ConfigError, match="'int4' is not one of"):
        quantization_config("int4")


def test_a_saved_quantized_model_is_read_back_by_the_library_and_by_the_source(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    hf = {"architectures": ["X"], "hidden_size": 32}
    state = {"proj.weight": weight_like(64, 32, seed=8), "norm.weight": torch.ones(32)}
    qc = quantization_config("fp8-block")
    save_quantized_model(tmp_path, hf, state, qc, Linear2(64, 32))
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["hidden_size"] == 32
    assert written["quantization_config"]["quant_method"] == "compressed-tensors"
    assert written["quantization_config"]["format"] == "float-quantized"
    assert load_quantization_config(tmp_path) == load_quantization_config(qc.model_dump())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    want_q, want_scale = reference(state["proj.weight"], args_of("fp8-block"))
    assert torch.equal(as_bytes(tensors["proj.weight"]), as_bytes(want_q))
    assert torch.equal(tensors["proj.weight_scale"], want_scale.float())
    assert torch.equal(tensors["norm.weight"], state["norm.weight"])


def test_the_documented_quantized_refit_snippet_saves_the_engine_checkpoint_and_publishes_int8(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file
    from vllm_models import hf_model, readme_blocks

    from refitd.bench.vllm import llama_config

    hf_config = llama_config(layers=1)
    weights = {k: v.detach().clone() for k, v in hf_model(hf_config, 1).state_dict().items()}
    (block,) = readme_blocks("## Quantized refit (`refitd.integrations.quant`)", "docs/vllm.md")
    ns: dict[str, Any] = {"engine_dir": tmp_path, "hf_config": hf_config, "weights": weights}
    exec(block, ns)
    published = {s.name: s.tensor for s in ns["source"].shards()}
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(published) == sorted(on_disk)
    assert [n for n in on_disk if not torch.equal(published[n], on_disk[n])] == []
    assert published["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert published["lm_head.weight"].dtype == torch.bfloat16  # ignored by the config
