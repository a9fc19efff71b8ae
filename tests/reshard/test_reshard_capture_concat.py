"""``torch.cat``/``torch.stack`` of placeholders decompose into per-piece copies.

Every accepted case is checked the same way: the recorded copies, replayed onto
zeroed parameters, must equal what the loader produces from real tensors. A case
may instead be refused with :class:`UnsupportedReshard`; it may never record a
copy that rebuilds something else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from refitd.reshard.geometry import capture_weights, convert_source_weights
from refitd.reshard.lazy_concat import LazyConcat
from refitd.reshard.replay import replay_ops
from refitd.reshard.types import RecordedCopy, UnsupportedReshard

F32 = torch.float32
Build = Callable[[dict[str, Any]], Any]


def sources_for(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, base = {}, 0
    for name, shape in shapes.items():
        t = torch.arange(base, base + int(torch.Size(shape).numel()), dtype=F32).reshape(shape)
        out[name], base = t, base + t.numel()
    return out


class SinkEngine(torch.nn.Module):
    """One parameter; its loader copies the (already converted) weight into it.

    With ``transposed`` the parameter is stored transposed, so the copy lands in a
    non-contiguous destination view.
    """

    def __init__(self, shape: tuple[int, ...], transposed: bool, in_loader: Build | None) -> None:
        super().__init__()
        self.transposed = transposed and len(shape) >= 2
        stored = (*shape[:-2], shape[-1], shape[-2]) if self.transposed else shape
        self.p = torch.nn.Parameter(torch.empty(stored))
        self.p.weight_loader = self._load  # type: ignore[attr-defined]
        self.in_loader = in_loader

    def _load(self, param: torch.Tensor, w: torch.Tensor) -> None:
        if self.in_loader is not None:
            w = self.in_loader({"w": w})
        dest = param.data.transpose(-1, -2) if self.transposed else param.data
        dest.copy_(w)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.p.weight_loader(self.p, w)  # type: ignore[operator]


def rebuild(
    copies: list[RecordedCopy], sources: dict[str, torch.Tensor], like: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros(like.shape, dtype=like.dtype)
    for c in copies:
        assert c.param_name == "p"
        out.view(-1).as_strided(c.dest_shape, c.dest_stride, c.dest_offset).copy_(
            replay_ops(sources[c.src_name], c.op_chain)
        )
    return out


def capture_and_check(
    shapes: dict[str, tuple[int, ...]], build: Build, *, transposed: bool = False
) -> list[RecordedCopy]:
    """Capture ``build`` as a conversion, rebuild from the records, compare with eager."""
    sources = sources_for(shapes)
    want = build(dict(sources))
    real = SinkEngine(tuple(want.shape), transposed, None)
    with torch.no_grad():
        real.load_weights([("x", want)])
    entries = [(n, F32, s) for n, s in shapes.items()]
    weights = convert_source_weights(lambda sd: {"x": build(sd)}, entries)
    with torch.device("meta"):
        model = SinkEngine(tuple(want.shape), transposed, None)
    result = capture_weights(model, weights)
    if result.unsupported:
        raise UnsupportedReshard(next(iter(result.unsupported_reasons.values())))
    assert result.unattributed == 0
    assert torch.equal(rebuild(result.copies, sources, real.p.detach()), real.p.detach())
    return result.copies


# -- decomposition -----------------------------------------------------------------


def test_a_cat_of_two_sources_records_one_copy_per_piece_into_its_rows() -> None:
    copies = capture_and_check({"a": (2, 3), "b": (4, 3)}, lambda sd: torch.cat([sd["a"], sd["b"]]))
    assert [(c.src_name, c.op_chain, c.dest_offset, c.dest_shape) for c in copies] == [
        ("a", (), 0, (2, 3)),
        ("b", (), 6, (4, 3)),
    ]


def test_a_cat_along_columns_records_strided_destination_slices() -> None:
    copies = capture_and_check(
        {"a": (2, 1), "b": (2, 3)}, lambda sd: torch.cat([sd["a"], sd["b"]], dim=-1)
    )
    assert [(c.dest_offset, c.dest_shape, c.dest_stride) for c in copies] == [
        (0, (2, 1), (4, 1)),
        (1, (2, 3), (4, 1)),
    ]


def test_a_stack_records_each_piece_into_its_own_index() -> None:
    copies = capture_and_check(
        {"a": (2, 3), "b": (2, 3), "c": (2, 3)},
        lambda sd: torch.stack([sd["a"], sd["b"], sd["c"]], 1),
    )
    assert [c.dest_offset for c in copies] == [0, 3, 6]
    assert all(c.dest_stride == (9, 3, 1) for c in copies)


def test_a_cat_of_views_keeps_each_pieces_own_chain() -> None:
    copies = capture_and_check(
        {"qkv": (6, 2), "o": (2, 4)},
        lambda sd: torch.cat([sd["qkv"].narrow(0, 2, 2), sd["o"].t().contiguous()], dim=0),
    )
    assert copies[0].op_chain == (("narrow", (0, 2, 2), ()),)
    assert (
        copies[1].op_chain == (("t", (), ()), ("contiguous", (), ())) and copies[1].dest_offset == 4
    )


def test_a_cat_inside_a_loader_reorders_one_source() -> None:
    # e.g. a loader swapping the gate and up halves of a merged projection
    sources = sources_for({"w": (4, 2)})
    want = torch.cat([sources["w"][2:], sources["w"][:2]])
    with torch.device("meta"):
        model = SinkEngine((4, 2), False, lambda d: torch.cat([d["w"][2:], d["w"][:2]]))
    result = capture_weights(model, convert_source_weights(None, [("w", F32, (4, 2))]))
    assert torch.equal(rebuild(result.copies, sources, want), want)
    assert [c.dest_offset for c in result.copies] == [0, 4]


def test_nested_cats_flatten_into_their_pieces() -> None:
    shapes = {"a": (1, 2), "b": (1, 2), "c": (2, 2)}
    copies = capture_and_check(
        shapes, lambda sd: torch.cat([torch.cat([sd["a"], sd["b"]]), sd["c"]])
    )
    assert [c.src_name for c in copies] == ["a", "b", "c"]


def test_ops_after_a_cat_resolve_to_the_pieces_they_touch() -> None:
    shapes = {"a": (2, 3), "b": (4, 3)}
    cases: list[Build] = [
        lambda sd: torch.cat([sd["a"], sd["b"]]).narrow(0, 1, 3),  # crosses the seam
        lambda sd: torch.cat([sd["a"], sd["b"]])[1:6:2],
        lambda sd: torch.cat([sd["a"], sd["b"]]).select(0, 4),
        lambda sd: torch.cat([sd["a"], sd["b"]])[:, 1:],
        lambda sd: torch.cat([sd["a"], sd["b"]]).chunk(3)[1],
        lambda sd: torch.cat([sd["a"], sd["b"]]).split([1, 5])[1],
        lambda sd: torch.cat([sd["a"], sd["b"]]).unbind()[2],
        lambda sd: torch.cat([sd["a"], sd["b"]]).t(),
        lambda sd: torch.cat([sd["a"], sd["b"]]).T,
        lambda sd: torch.cat([sd["a"], sd["b"]]).unsqueeze(1).movedim(0, -1),
        lambda sd: torch.cat([sd["a"], sd["b"]]).reshape(18),
        lambda sd: torch.cat([sd["a"], sd["b"]]).flatten(),
        lambda sd: torch.cat([sd["a"], sd["b"]]).t().reshape(3, 3, 2),
        lambda sd: torch.cat([sd["a"], sd["b"]]).unflatten(0, (3, 2)),
        lambda sd: torch.cat([sd["a"], sd["b"]])[..., None, 0].squeeze(),
    ]
    for build in cases:
        capture_and_check(shapes, build)
        capture_and_check(shapes, build, transposed=True)


def test_a_view_of_a_cat_reports_the_layout_eager_torch_would() -> None:
    weights = convert_source_weights(
        lambda sd: {"x": torch.cat([sd["a"], sd["b"]]).t()},
        [("a", F32, (2, 3)), ("b", F32, (4, 3))],
    )
    real = torch.cat([torch.zeros(2, 3), torch.zeros(4, 3)]).t()
    assert weights["x"].stride() == real.stride() and not weights["x"].is_contiguous()


def test_a_select_inside_one_piece_records_only_that_source() -> None:
    copies = capture_and_check(
        {"a": (2, 3), "b": (4, 3)}, lambda sd: torch.cat([sd["a"], sd["b"]])[3]
    )
    assert [(c.src_name, c.op_chain) for c in copies] == [("b", (("select", (0, 1), ()),))]


@pytest.mark.parametrize(
    ("build", "cause"),
    [
        (
            lambda sd: torch.cat([sd["a"], sd["b"]]).t().reshape(3, 2, 2),
            "splits a concatenated piece",
        ),
        (lambda sd: torch.cat([sd["a"].t(), sd["b"]], 1).reshape(-1), "pieces interleave"),
        (lambda sd: torch.cat([sd["a"], sd["b"]]) + 1, "aten.add"),
    ],
    ids=["reshape_splits_a_piece", "flatten_interleaves_pieces", "arithmetic"],
)
def test_ops_after_a_cat_that_pieces_cannot_express_are_refused(build: Build, cause: str) -> None:
    shapes = {"a": (1, 3), "b": (3, 3)}
    with pytest.raises(UnsupportedReshard, match=cause):
        capture_and_check(shapes, build)


def test_a_cat_mixing_a_source_with_a_real_tensor_is_refused_as_synthesized() -> None:
    with pytest.raises(UnsupportedReshard, match="synthesized"):
        capture_and_check({"a": (2, 3)}, lambda sd: torch.cat([sd["a"], torch.zeros(1, 3)]))


def test_a_cat_that_would_promote_dtypes_is_refused() -> None:
    entries = [("a", F32, (2,)), ("b", torch.bfloat16, (2,))]
    with pytest.raises(UnsupportedReshard, match="casts"):
        convert_source_weights(lambda sd: {"x": torch.cat([sd["a"], sd["b"]])}, entries)


def test_a_broadcasting_copy_of_a_cat_is_refused() -> None:
    weights = convert_source_weights(
        lambda sd: {"x": torch.cat([sd["a"], sd["b"]])}, [("a", F32, (1, 3)), ("b", F32, (1, 3))]
    )
    with torch.device("meta"):
        model = SinkEngine((2, 3), False, lambda d: d["w"][:1])
    result = capture_weights(model, weights)
    # the refused weight is the concatenation, so both of its sources are refused
    assert result.unsupported == ["a", "b"]
    assert "broadcasts" in result.unsupported_reasons["a"]


def test_a_cat_of_one_nonempty_piece_is_that_piece() -> None:
    weights = convert_source_weights(
        lambda sd: {"x": torch.cat([sd["a"], sd["b"].narrow(0, 0, 0)])},
        [("a", F32, (2,)), ("b", F32, (3,))],
    )
    assert not isinstance(weights["x"], LazyConcat) and weights["x"]._name == "a"  # type: ignore[attr-defined]


# -- random composites -------------------------------------------------------------


Op = Callable[[Any], Any]


def _post_op(draw: st.DrawFn, t: torch.Tensor) -> Op | None:
    nd, shape = t.dim(), tuple(t.shape)
    if nd == 0:
        return None
    d = draw(st.integers(-nd, nd - 1))
    size = shape[d]
    kind = draw(
        st.sampled_from(
            [
                "narrow",
                "select",
                "step",
                "transpose",
                "permute",
                "unsqueeze",
                "squeeze",
                "flatten",
                "reshape",
                "unflatten",
                "chunk",
                "split",
                "unbind",
                "contiguous",
                "movedim",
            ]
        )
    )
    if kind == "narrow":
        start = draw(st.integers(0, size))
        n = draw(st.integers(0, size - start))
        return lambda x: x.narrow(d, start, n)
    if kind in ("select", "unbind") and size > 0:
        i = draw(st.integers(-size, size - 1))
        return (lambda x: x.select(d, i)) if kind == "select" else (lambda x: x.unbind(d)[i])
    if kind == "step":
        s = slice(
            draw(st.integers(-size - 1, size)),
            draw(st.none() | st.integers(-size, size)),
            draw(st.integers(1, 3)),
        )
        index = (Ellipsis, s, *([slice(None)] * (-d - 1))) if d < 0 else (*([slice(None)] * d), s)
        return lambda x: x[index]
    if kind == "transpose":
        e = draw(st.integers(-nd, nd - 1))
        return lambda x: x.transpose(d, e)
    if kind == "permute":
        perm = draw(st.permutations(range(nd)))
        return lambda x: x.permute(*perm)
    if kind == "movedim":
        e = draw(st.integers(-nd, nd - 1))
        return lambda x: torch.movedim(x, d, e)
    if kind == "unsqueeze":
        e = draw(st.integers(-nd - 1, nd))
        return lambda x: x.unsqueeze(e)
    if kind == "squeeze":
        every = draw(st.booleans())
        return lambda x: x.squeeze() if every else x.squeeze(d)
    if kind == "flatten":
        a, b = sorted((draw(st.integers(0, nd - 1)), draw(st.integers(0, nd - 1))))
        return lambda x: torch.flatten(x, a, b)
    if kind == "reshape" and t.numel() > 0:
        n = t.numel()
        k = draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0]))
        return lambda x: x.reshape(k, -1)
    if kind == "unflatten" and size > 0:
        k = draw(st.sampled_from([k for k in range(1, size + 1) if size % k == 0]))
        return lambda x: x.unflatten(d, (k, -1))
    if kind == "chunk":
        chunks = draw(st.integers(1, 3))
        pieces = len(t.chunk(chunks, d))
        if pieces == 0:
            return None
        i = draw(st.integers(0, pieces - 1))
        return lambda x: torch.chunk(x, chunks, d)[i]
    if kind == "split" and size > 0:
        n = draw(st.integers(1, size))
        i = draw(st.integers(0, len(t.split(n, d)) - 1))
        return lambda x: torch.split(x, n, d)[i]
    if kind == "contiguous":
        return lambda x: x.contiguous()
    return None


def _post_ops(draw: st.DrawFn, probe: torch.Tensor, least: int, most: int) -> list[Op]:
    """Draw ``least``..``most`` attempts at a view op, each drawn for the shape the
    previous ones left (an attempt on a 0-d tensor draws nothing)."""
    ops: list[Op] = []
    for _ in range(draw(st.integers(least, most))):
        op = _post_op(draw, probe)
        if op is not None:
            ops.append(op)
            probe = op(probe)
    return ops


def _apply(ops: list[Op], t: Any) -> Any:
    for op in ops:
        t = op(t)
    return t


@st.composite
def composites(draw: st.DrawFn) -> tuple[dict[str, tuple[int, ...]], Build, bool]:
    rank = draw(st.integers(1, 3))
    base = [draw(st.integers(1, 3)) for _ in range(rank)]
    stack = draw(st.booleans())
    dim = draw(st.integers(-rank, rank - 1)) if not stack else draw(st.integers(-rank - 1, rank))
    shapes: dict[str, tuple[int, ...]] = {}
    transposed_piece: dict[str, bool] = {}
    for i in range(draw(st.integers(2, 4))):
        shape = list(base)
        if not stack:
            shape[dim] = draw(st.integers(1, 3))
        name = f"s{i}"
        # a piece may itself be a view (transpose of a transposed source)
        flip = rank >= 2 and draw(st.booleans())
        shapes[name] = (*shape[:-2], shape[-1], shape[-2]) if flip else tuple(shape)
        transposed_piece[name] = flip

    def piece(sd: dict[str, Any], name: str) -> Any:
        return sd[name].transpose(-1, -2) if transposed_piece[name] else sd[name]

    join = torch.stack if stack else torch.cat
    ops = _post_ops(draw, join([piece(sources_for(shapes), n) for n in shapes], dim), 0, 3)

    def build(sd: dict[str, Any]) -> Any:
        return _apply(ops, join([piece(sd, n) for n in shapes], dim))

    return shapes, build, draw(st.booleans())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(composites())
def test_random_cat_and_stack_chains_record_exact_copies_or_are_refused(
    case: tuple[dict[str, tuple[int, ...]], Build, bool],
) -> None:
    shapes, build, transposed = case
    try:
        capture_and_check(shapes, build, transposed=transposed)
        event("recorded")
    except UnsupportedReshard as exc:
        event("refused")
        # the only refusals expected here are rank changes the pieces cannot follow
        assert "piece" in str(exc) or "interleave" in str(exc) or "empty" in str(exc), str(exc)


@st.composite
def single_source_chains(draw: st.DrawFn) -> tuple[dict[str, tuple[int, ...]], Build, bool]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    probe = sources_for({"w": shape})["w"]
    ops = _post_ops(draw, probe, 1, 5)

    def build(sd: dict[str, Any]) -> Any:
        return _apply(ops, sd["w"])

    return {"w": shape}, build, draw(st.booleans())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(single_source_chains())
def test_random_view_chains_of_one_source_record_exact_copies(
    case: tuple[dict[str, tuple[int, ...]], Build, bool],
) -> None:
    shapes, build, transposed = case
    (copy,) = capture_and_check(shapes, build, transposed=transposed)
    assert copy.src_name == "w"


# -- composition with the slice planner ---------------------------------------------


def _rebuild_through_plan_pull(
    copies: list[RecordedCopy], sources: dict[str, torch.Tensor], like: torch.Tensor
) -> torch.Tensor:
    """Rebuild from reads planned against one full shard per source."""
    from refitd.reshard.slice_plan import Shard, plan_pull

    out = torch.zeros(like.numel(), dtype=like.dtype)
    for c in copies:
        src = sources[c.src_name]
        shard = Shard((0,) * src.dim(), tuple(src.shape), "trainer", 0, 4)
        flat = src.reshape(-1)
        for read in plan_pull(c, tuple(src.shape), F32, 4, [shard]):
            d, s, n = read.dst_byte // 4, read.src_addr // 4, read.nbytes // 4
            out[d : d + n] = flat[s : s + n]
    return out.view(like.shape)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(composites(), single_source_chains()))
def test_captured_chains_plan_into_reads_that_rebuild_the_loader_result(
    case: tuple[dict[str, tuple[int, ...]], Build, bool],
) -> None:
    shapes, build, transposed = case
    sources = sources_for(shapes)
    want = build(dict(sources))
    real = SinkEngine(tuple(want.shape), transposed, None)
    with torch.no_grad():
        real.load_weights([("x", want)])
    try:
        weights = convert_source_weights(
            lambda sd: {"x": build(sd)}, [(n, F32, s) for n, s in shapes.items()]
        )
    except UnsupportedReshard:
        return  # refusals are covered above
    with torch.device("meta"):
        model = SinkEngine(tuple(want.shape), transposed, None)
    result = capture_weights(model, weights)
    if result.unsupported:
        return
    rebuilt = _rebuild_through_plan_pull(result.copies, sources, real.p.detach())
    assert torch.equal(rebuilt, real.p.detach())
