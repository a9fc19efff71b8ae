"""A loader's ``copy_`` that converts dtype is replayed exactly, at install.

vLLM holds some state in fp32 while a bf16 trainer publishes it in bf16 (DeepSeek-V3's
``e_score_correction_bias``, routers a config keeps in fp32); its loader converts with
``param.data.copy_(loaded)``. Such a copy is planned as a full pull of the source in
its own dtype and converted at install by the same ``copy_``: the parameter must hold,
bit for bit, what the loader run on the full tensor leaves, for every pair of
floating dtypes, through any sharding of the source. Anything else that casts stays
refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.reshard.geometry import capture_geometry
from refitd.reshard.reads import InMemoryReadExecutor
from refitd.reshard.slice_plan import Shard
from refitd.reshard.transfer_plan import SourceInfo, execute_transfer, plan_transfer
from refitd.reshard.types import CaptureResult, RecordedCopy, UnsupportedReshard

FLOATS = [torch.bfloat16, torch.float16, torch.float32]


class Router(torch.nn.Module):
    """A gate held in ``dtype`` whatever the checkpoint's, loaded through ``copy_``
    (vLLM's default loader), plus a bias the loader reads a slice of."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(cols, dtype=dtype), requires_grad=False)
        self.gate.weight_loader = _load_whole  # type: ignore[attr-defined]
        self.bias.weight_loader = _load_slice  # type: ignore[attr-defined]

    def load_weights(self, weights: Any) -> None:
        for name, w in weights:
            p = getattr(self, name)
            p.weight_loader(p, w)


def _load_whole(p: torch.Tensor, w: torch.Tensor) -> None:
    p.data.copy_(w)  # vLLM's default loader: converts to the parameter's dtype


def _load_slice(p: torch.Tensor, w: torch.Tensor) -> None:
    p.data.copy_(w.narrow(0, 1, p.shape[0]))


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Wide range, so narrowing casts round, overflow fp16 and meet subnormals.
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, shape, generator=g).double())
    return x.to(dtype)


def _publish(t: torch.Tensor, cuts: list[int], keep: list[torch.Tensor]) -> SourceInfo:
    """``t`` as dim-0 blocks cut at ``cuts``, each its own buffer as trainer ranks hold
    them (kept alive in ``keep``)."""
    el = t.element_size()
    bounds = [0, *sorted(set(cuts)), t.shape[0]]
    shards = []
    for a, b in itertools.pairwise(bounds):
        if b <= a:
            continue
        block = t[a:b].contiguous()
        keep.append(block)
        rest = (0,) * (t.dim() - 1)
        shards.append(Shard((a, *rest), tuple(block.shape), f"rank{a}", block.data_ptr(), el))
    return SourceInfo(tuple(t.shape), t.dtype, el, shards)


@settings(max_examples=40, deadline=None)
@given(
    src_dtype=st.sampled_from(FLOATS),
    dest_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    rows=st.integers(1, 6),
    cols=st.integers(2, 5),
    cuts=st.lists(st.integers(0, 6), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_a_casting_loader_is_replayed_bit_for_bit_as_the_loader_casts(
    src_dtype: torch.dtype,
    dest_dtype: torch.dtype,
    rows: int,
    cols: int,
    cuts: list[int],
    seed: int,
) -> None:
    gate = _values((rows, cols), src_dtype, seed)
    bias = _values((cols + 2,), src_dtype, seed + 1)
    truth = Router(rows, cols, dest_dtype)
    truth.load_weights([("gate", gate), ("bias", bias)])

    with torch.device("meta"):
        twin = Router(rows, cols, dest_dtype)
    manifest = [("gate", src_dtype, (rows, cols)), ("bias", src_dtype, (cols + 2,))]
    captured = capture_geometry(twin, manifest)
    assert captured.unsupported == []
    keep: list[torch.Tensor] = []
    sources = {
        "gate": _publish(gate, [c for c in cuts if c < rows], keep),
        "bias": _publish(bias, [], keep),
    }
    plan = plan_transfer(captured, sources)
    cast = src_dtype != dest_dtype
    # A conversion never rides a byte copy: it is staged in the source's dtype.
    assert (plan.segments == [] and len(plan.full_pulls) == 2) if cast else plan.full_pulls == []
    got = Router(rows, cols, dest_dtype)
    params = dict(got.named_parameters())
    execute_transfer(plan, lambda n: params[n].data_ptr(), InMemoryReadExecutor())
    for name, want in truth.named_parameters():
        have = params[name].detach()
        assert have.dtype == want.dtype
        assert torch.equal(
            have.view(-1).view(torch.uint8), want.detach().view(-1).view(torch.uint8)
        )


def test_a_casting_copy_whose_source_is_not_in_row_blocks_is_refused_naming_it() -> None:
    full = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8)
    left, right = full[:, :4].contiguous(), full[:, 4:].contiguous()
    copy = RecordedCopy("w", (), "gate", 0, (4, 8), (8, 1), torch.float32)
    source = SourceInfo(
        (4, 8),
        torch.bfloat16,
        2,
        [
            Shard((0, 0), (4, 4), "left", left.data_ptr(), 2),
            Shard((0, 4), (4, 4), "right", right.data_ptr(), 2),
        ],
    )
    plan = plan_transfer(CaptureResult(copies=[copy]), {"w": source})
    assert plan.segments == [] and plan.full_pulls == []
    (reason,) = [r for n, r in plan.fallback_reasons.items() if n == "w"]
    assert "converts dtype" in reason and "'gate'" in reason


def test_a_cast_the_loader_does_not_make_replayably_is_refused() -> None:
    with torch.device("meta"):
        twin = Router(2, 3, torch.float32)
    captured = capture_geometry(
        twin, [("gate", torch.int32, (2, 3)), ("bias", torch.float32, (5,))]
    )
    assert captured.unsupported == ["gate"]
    assert "casts torch.int32" in captured.unsupported_reasons["gate"]


def test_a_cast_copy_is_refused_by_a_byte_plan() -> None:
    from refitd.reshard.slice_plan import plan_pull

    copy = RecordedCopy("w", (), "p", 0, (4,), (1,), torch.float32)
    with pytest.raises(UnsupportedReshard, match="converts dtype"):
        plan_pull(copy, (4,), torch.bfloat16, 2, [Shard((0,), (4,), "s", 0, 2)])
