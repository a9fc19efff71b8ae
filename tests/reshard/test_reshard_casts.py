"""A loader's ``copy_`` that converts dtype is replayed exactly, at install.

vLLM holds some state in fp32 while a bf16 trainer publishes it in bf16 (DeepSeek-V3's
``e_score_correction_bias``, routers a config keeps in fp32); its loader converts with
``param.data.copy_(loaded)``. Such a copy is planned as a full read of the source in
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
    assert (plan.reads == [] and len(plan.full_reads) == 2) if cast else plan.full_reads == []
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
    assert plan.reads == [] and plan.full_reads == []
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


# -- casts a loader makes itself: .to(), .float(), .bfloat16() ------------------------

CASTS = {
    "to": lambda x, d: x.to(d),
    "to_kw": lambda x, d: x.to(dtype=d),
    "method": lambda x, d: {
        torch.float32: x.float,
        torch.bfloat16: x.bfloat16,
        torch.float16: x.half,
        torch.float64: x.double,
    }[d](),
}
MOVES = {
    "narrow": lambda x: x.narrow(0, x.shape[0] // 2, x.shape[0] - x.shape[0] // 2),
    "t": lambda x: x.t(),
    "flip_rows": lambda x: x[:, ::2],
    "contiguous": lambda x: x.contiguous(),
}


class ChainLoader(torch.nn.Module):
    """One parameter of ``dtype`` loaded by ``param.data.copy_(chain(w))``, where the
    chain interleaves movement ops with casts (MiniMax-M2's gate bias loader is the
    shortest: ``copy_(w.to(torch.float32))``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, chain: list[Any]) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        self.chain = chain

    def load_weights(self, weights: Any) -> None:
        for _, w in weights:
            for step in self.chain:
                w = step(w)
            self.p.data.copy_(w)


def _chain_shape(shape: tuple[int, int], names: list[str]) -> tuple[int, ...]:
    x = torch.empty(shape, device="meta")
    for n in names:
        x = MOVES[n](x)
    return tuple(x.shape)


@settings(max_examples=60, deadline=None)
@given(
    src_dtype=st.sampled_from(FLOATS),
    dest_dtype=st.sampled_from(FLOATS),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("cast"), st.sampled_from(sorted(CASTS)), st.sampled_from(FLOATS)),
            st.tuples(st.just("move"), st.sampled_from(sorted(MOVES)), st.just(None)),
        ),
        min_size=1,
        max_size=5,
    ),
    rows=st.integers(2, 6),
    cols=st.integers(2, 5),
    cuts=st.lists(st.integers(0, 6), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_a_loader_chain_with_casts_is_replayed_bit_for_bit_as_the_loader_leaves_it(
    src_dtype: torch.dtype,
    dest_dtype: torch.dtype,
    steps: list[tuple[str, str, Any]],
    rows: int,
    cols: int,
    cuts: list[int],
    seed: int,
) -> None:
    chain = [
        (lambda x, f=CASTS[name], d=dt: f(x, d)) if kind == "cast" else MOVES[name]
        for kind, name, dt in steps
    ]
    shape = _chain_shape((rows, cols), [name for kind, name, _ in steps if kind == "move"])
    w = _values((rows, cols), src_dtype, seed)
    truth = ChainLoader(shape, dest_dtype, chain)
    truth.load_weights([("w", w)])

    with torch.device("meta"):
        twin = ChainLoader(shape, dest_dtype, chain)
    captured = capture_geometry(twin, [("w", src_dtype, (rows, cols))])
    assert captured.unsupported == [] and captured.unattributed == 0
    (copy,) = captured.copies
    keep: list[torch.Tensor] = []
    plan = plan_transfer(captured, {"w": _publish(w, [c for c in cuts if c < rows], keep)})
    converts = copy.casts != () or src_dtype != dest_dtype
    assert (plan.reads == [] and len(plan.full_reads) == 1) if converts else plan.full_reads == []
    got = ChainLoader(shape, dest_dtype, chain)
    execute_transfer(plan, lambda n: got.p.data_ptr(), InMemoryReadExecutor())
    assert torch.equal(got.p.view(-1).view(torch.uint8), truth.p.view(-1).view(torch.uint8))


def test_a_cast_of_a_concatenation_casts_every_piece() -> None:
    a, b = _values((2, 3), torch.bfloat16, 1), _values((3, 3), torch.bfloat16, 2)

    class CatLoader(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(5, 3), requires_grad=False)

        def load_weights(self, weights: Any) -> None:
            ws = dict(weights)
            self.p.data.copy_(torch.cat([ws["a"], ws["b"]]).float().t().t())

    truth = CatLoader()
    truth.load_weights([("a", a), ("b", b)])
    with torch.device("meta"):
        twin = CatLoader()
    captured = capture_geometry(
        twin, [("a", torch.bfloat16, (2, 3)), ("b", torch.bfloat16, (3, 3))]
    )
    assert [c.casts for c in captured.copies] == [(torch.float32,)] * 2
    keep: list[torch.Tensor] = []
    plan = plan_transfer(captured, {"a": _publish(a, [], keep), "b": _publish(b, [1], keep)})
    got = CatLoader()
    execute_transfer(plan, lambda n: got.p.data_ptr(), InMemoryReadExecutor())
    assert torch.equal(got.p, truth.p)


def test_an_integer_cast_in_a_loader_chain_is_refused_naming_it() -> None:
    with torch.device("meta"):
        twin = ChainLoader((2, 3), torch.float32, [lambda x: x.to(torch.int32)])
    captured = capture_geometry(twin, [("w", torch.bfloat16, (2, 3))])
    assert captured.unsupported == ["w"]
    assert "casts torch.bfloat16 to torch.int32" in captured.unsupported_reasons["w"]


def test_a_one_element_view_with_a_stride_is_written_as_its_value() -> None:
    """A replayed value of one element may keep any stride (it counts as contiguous);
    its bytes are written all the same. Found by Hypothesis in CI: 'self.stride(-1)
    must be 1 to view Short as Byte'."""
    from refitd.reshard.slice_plan import write_through_pointer

    dest = torch.zeros(4, dtype=torch.int16)
    copy = RecordedCopy("w", (), "p", 2, (1,), (1,), torch.int16)
    value = torch.tensor([7, 9], dtype=torch.int16)[::2]  # one element, stride 2
    assert value.stride() == (2,) and value.is_contiguous()
    write_through_pointer(dest.data_ptr(), copy, value)
    assert dest.tolist() == [0, 0, 7, 0]
