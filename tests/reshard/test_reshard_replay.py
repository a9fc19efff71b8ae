"""Replay of recorded movement-op chains, checked bit for bit against eager torch.

Each case builds a source whose every element is distinct, applies an op eagerly
(often through its functional form, so the two sides do not share a code path),
replays the recorded ``(name, args, kwargs)`` encoding, and compares the raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refitd.reshard.replay import REPLAYABLE_OPS, replay_ops
from refitd.reshard.types import OpChain, OpSpec, UnsupportedReshard


def _source(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64).to(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()  # C order whatever the strides


def _assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert _bits(got) == _bits(want)


def _op(name: str, *args: Any, **kwargs: Any) -> OpSpec:
    return (name, args, tuple(sorted(kwargs.items())))


CASES: list[tuple[str, tuple[int, ...], OpChain, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("narrow", (6, 4), (_op("narrow", 0, 2, 3),), lambda x: torch.narrow(x, 0, 2, 3)),
    ("narrow_negative_dim", (3, 8), (_op("narrow", -1, 1, 5),), lambda x: x[:, 1:6]),
    ("select", (3, 4, 5), (_op("select", 1, 2),), lambda x: x[:, 2]),
    ("select_negative", (3, 4, 5), (_op("select", -1, -2),), lambda x: x[:, :, 3]),
    ("getitem_int", (4, 3), (_op("__getitem__", 2),), lambda x: torch.select(x, 0, 2)),
    ("getitem_negative_int", (4, 3), (_op("__getitem__", -1),), lambda x: torch.select(x, 0, 3)),
    (
        "getitem_step_slice",
        (10, 3),
        (_op("__getitem__", (slice(1, 9, 3),)),),
        lambda x: torch.stack([x[1], x[4], x[7]]),
    ),
    (
        "getitem_negative_bounds",
        (2, 3, 4),
        (_op("__getitem__", (slice(None), slice(-2, None), slice(-3, -1))),),
        lambda x: torch.narrow(torch.narrow(x, 1, 1, 2), 2, 1, 2),
    ),
    (
        "getitem_ellipsis_and_none",
        (2, 3, 4),
        (_op("__getitem__", (Ellipsis, None, slice(0, 4, 2))),),
        lambda x: torch.unsqueeze(x, 2)[..., 0::2],
    ),
    (
        "getitem_multi_axis_negative_axis_and_step",
        (2, 3, 4),
        # the onnx seed's Slice case, as torch can express it: rows 1.., step-2 columns
        (_op("__getitem__", (slice(None), slice(1, None), slice(None, None, 2))),),
        lambda x: torch.tensor([[[4.0, 6.0], [8.0, 10.0]], [[16.0, 18.0], [20.0, 22.0]]]),
    ),
    ("transpose", (2, 3, 4), (_op("transpose", 0, 2),), lambda x: torch.transpose(x, 0, 2)),
    ("transpose_negative", (2, 3, 4), (_op("transpose", -1, -3),), lambda x: x.permute(2, 1, 0)),
    ("t", (3, 5), (_op("t"),), lambda x: torch.transpose(x, 0, 1)),
    ("permute", (2, 1, 3), (_op("permute", 2, 0, 1),), lambda x: torch.permute(x, (2, 0, 1))),
    (
        "permute_negative",
        (2, 3, 4),
        (_op("permute", (-1, 0, -2)),),
        lambda x: torch.permute(x, (2, 0, 1)),
    ),
    ("movedim", (2, 3, 4), (_op("movedim", 0, -1),), lambda x: x.permute(1, 2, 0)),
    ("swapaxes", (2, 3, 4), (_op("swapaxes", 0, 1),), lambda x: x.transpose(0, 1)),
    ("swapdims", (2, 3), (_op("swapdims", -1, 0),), lambda x: x.t()),
    ("view", (4, 6), (_op("view", 2, 12),), lambda x: torch.reshape(x, (2, 12))),
    ("view_inferred", (4, 6), (_op("view", (-1, 3)),), lambda x: torch.reshape(x, (8, 3))),
    ("reshape", (4, 6), (_op("reshape", 3, 2, 4),), lambda x: x.view(3, 2, 4)),
    (
        "reshape_of_transpose_copies",
        (4, 6),
        (_op("t"), _op("reshape", 3, 8)),
        lambda x: x.t().contiguous().view(3, 8),
    ),
    ("flatten", (2, 3, 4), (_op("flatten"),), lambda x: x.reshape(24)),
    ("flatten_range", (2, 3, 4), (_op("flatten", 1, -1),), lambda x: torch.flatten(x, 1)),
    ("unflatten", (2, 12), (_op("unflatten", -1, (3, 4)),), lambda x: x.view(2, 3, 4)),
    ("squeeze_all", (1, 3, 1), (_op("squeeze"),), lambda x: x.view(3)),
    ("squeeze_dim", (1, 3, 1), (_op("squeeze", -1),), lambda x: x.view(1, 3)),
    ("squeeze_dims", (1, 3, 1), (_op("squeeze", (0, 2)),), lambda x: x.view(3)),
    ("unsqueeze", (2, 3), (_op("unsqueeze", 1),), lambda x: x.view(2, 1, 3)),
    ("unsqueeze_negative", (2, 3), (_op("unsqueeze", -1),), lambda x: x.view(2, 3, 1)),
    ("contiguous", (3, 4), (_op("t"), _op("contiguous")), lambda x: x.t().clone()),
    (
        "chunk",
        (6, 4),
        (_op("chunk", 3, 0), _op("__getitem__", 1)),
        lambda x: torch.chunk(x, 3)[1],
    ),
    (
        "chunk_negative_dim",
        (2, 6),
        (_op("chunk", 2, dim=-1), _op("__getitem__", 1)),
        lambda x: x[:, 3:],
    ),
    (
        "split_sizes_negative_axis",
        (2, 4),
        # the onnx seed's Split case: sizes (1, 3) along axis -1, second output
        (_op("split", (1, 3), -1), _op("__getitem__", 1)),
        lambda x: torch.tensor([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]),
    ),
    (
        "split_int",
        (7, 2),
        (_op("split", 3), _op("__getitem__", 2)),
        lambda x: torch.split(x, 3)[2],
    ),
    (
        "unbind",
        (3, 2, 4),
        (_op("unbind", 1), _op("__getitem__", 1)),
        lambda x: torch.unbind(x, 1)[1],
    ),
    (
        "unsqueeze_unbind_expert_path",
        (2, 4),
        (_op("unsqueeze", 0), _op("unbind"), _op("__getitem__", 0)),
        lambda x: x,
    ),
]


def test_every_replayable_op_has_a_conformance_case() -> None:
    covered = {name for _, _, chain, _ in CASES for name, _, _ in chain}
    assert covered == set(REPLAYABLE_OPS)


@pytest.mark.parametrize(
    ("shape", "chain", "eager"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_replay_matches_eager_torch_bit_for_bit(
    shape: tuple[int, ...], chain: OpChain, eager: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    x = _source(*shape)
    _assert_bit_exact(replay_ops(x, chain), eager(x))


def test_replay_preserves_every_dtype_bit_pattern() -> None:
    # NaN payloads and signed zeros survive a movement op only if no arithmetic ran.
    raw = torch.randint(-(2**31), 2**31 - 1, (4, 6), dtype=torch.int32)
    x = raw.view(torch.float32)
    got = replay_ops(x, (_op("t"), _op("contiguous"), _op("narrow", 0, 1, 3)))
    assert _bits(got) == _bits(raw.t().contiguous()[1:4])


def test_replay_returns_a_view_sharing_the_source_storage() -> None:
    x = _source(4, 4)
    got = replay_ops(x, (_op("narrow", 1, 1, 2), _op("select", 0, 3)))
    assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert got.storage_offset() == 13


def test_replay_of_an_empty_chain_is_the_source_itself() -> None:
    x = _source(2, 3)
    assert replay_ops(x, ()) is x


def test_replay_works_on_meta_tensors_for_shape_resolution() -> None:
    x = torch.empty(8, 6, device="meta")
    got = replay_ops(x, (_op("view", 4, 2, 6), _op("permute", 2, 0, 1), _op("select", -1, 1)))
    assert got.shape == (6, 4) and got.stride() == (1, 12)


@pytest.mark.parametrize("name", ["mul", "to", "index_select", "__setitem__", "clone", "expand"])
def test_unknown_op_is_refused_naming_the_op(name: str) -> None:
    with pytest.raises(UnsupportedReshard, match=name):
        replay_ops(_source(2, 2), ((name, (2,), ()),))


@pytest.mark.parametrize(
    "index",
    [torch.tensor([0, 1]), [0, 1], True, (slice(0, 1), torch.tensor([1])), slice(0, 2.5)],
    ids=["tensor", "list", "bool", "tuple_with_tensor", "float_bound"],
)
def test_advanced_indexing_is_refused(index: Any) -> None:
    with pytest.raises(UnsupportedReshard, match="__getitem__"):
        replay_ops(_source(3, 3), (("__getitem__", (index,), ()),))


def test_a_chain_ending_on_a_multi_output_result_is_refused() -> None:
    with pytest.raises(UnsupportedReshard, match="ends on a tuple"):
        replay_ops(_source(4, 2), (_op("chunk", 2),))


def test_an_op_other_than_getitem_after_a_multi_output_op_is_refused() -> None:
    with pytest.raises(UnsupportedReshard, match="multi-output"):
        replay_ops(_source(4, 2), (_op("unbind"), _op("narrow", 0, 0, 1)))


def test_a_malformed_op_is_refused() -> None:
    with pytest.raises(UnsupportedReshard, match="malformed"):
        replay_ops(_source(2), (("narrow", [0, 0, 1], ()),))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Random chains: each step draws an op valid for the current shape, records it in
# the chain encoding, and applies it eagerly through the functional form.


@st.composite
def _step(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[list[OpSpec], Any]:
    nd = len(shape)
    kinds = ["unsqueeze", "flatten_or_view"]
    if nd >= 1:
        kinds += ["narrow", "getitem", "chunk", "split", "movedim"]
        if any(s > 0 for s in shape):
            kinds += ["select", "unbind"]
    if nd >= 2:
        kinds += ["transpose", "permute", "t_contiguous"]
    if 1 in shape:
        kinds.append("squeeze")
    kind = draw(st.sampled_from(kinds))

    def dim() -> int:
        d = draw(st.integers(0, nd - 1))
        return d - nd if draw(st.booleans()) else d

    if kind == "narrow":
        d = dim()
        start = draw(st.integers(0, shape[d]))
        length = draw(st.integers(0, shape[d] - start))
        return [_op("narrow", d, start, length)], lambda x: torch.narrow(x, d, start, length)
    if kind == "select":
        d = draw(st.sampled_from([i for i in range(nd) if shape[i] > 0]))
        i = draw(st.integers(-shape[d], shape[d] - 1))
        return [_op("select", d, i)], lambda x: torch.select(x, d, i)
    if kind == "getitem":
        items: list[Any] = []
        for size in shape[: draw(st.integers(1, nd))]:
            if draw(st.booleans()):
                start = draw(st.integers(-size - 1, size + 1))
                stop = draw(st.none() | st.integers(-size - 1, size + 1))
                step = draw(st.integers(1, 3))
                items.append(slice(start, stop, step))
            elif size > 0:
                items.append(draw(st.integers(-size, size - 1)))
            else:
                items.append(slice(None))
        if draw(st.booleans()):
            items.insert(draw(st.integers(0, len(items))), None)
        index = tuple(items)

        def by_ints(x: torch.Tensor) -> torch.Tensor:
            # Eager reference built from narrow/select/unsqueeze steps, not getitem.
            out, d = x, 0
            for item in index:
                if item is None:
                    out, d = out.unsqueeze(d), d + 1
                elif isinstance(item, int):
                    out = out.select(d, item)
                else:
                    picks = list(range(out.shape[d]))[item]
                    out = torch.index_select(out, d, torch.tensor(picks, dtype=torch.int64))
                    d += 1
            return out

        return [_op("__getitem__", index)], by_ints
    if kind == "chunk":
        d = dim()
        n = draw(st.integers(1, 4))
        pieces = len(torch.empty(shape, device="meta").chunk(n, d))
        if pieces == 0:
            return [], lambda x: x
        i = draw(st.integers(0, pieces - 1))
        return [_op("chunk", n, d), _op("__getitem__", i)], lambda x: torch.chunk(x, n, d)[i]
    if kind == "split":
        d = dim()
        if draw(st.booleans()):
            size: Any = draw(st.integers(1, max(1, shape[d])))
        else:
            cuts = sorted(draw(st.lists(st.integers(0, shape[d]), max_size=3)))
            size = tuple(b - a for a, b in zip([0, *cuts], [*cuts, shape[d]], strict=True))
        pieces = len(torch.empty(shape, device="meta").split(size, d))
        i = draw(st.integers(0, pieces - 1))
        return [_op("split", size, dim=d), _op("__getitem__", i)], lambda x: torch.split(
            x, size, d
        )[i]
    if kind == "unbind":
        d = draw(st.sampled_from([i for i in range(nd) if shape[i] > 0]))
        i = draw(st.integers(0, shape[d] - 1))
        return [_op("unbind", d), _op("__getitem__", i)], lambda x: torch.unbind(x, d)[i]
    if kind == "movedim":
        a, b = dim(), dim()
        return [_op("movedim", a, b)], lambda x: torch.movedim(x, a, b)
    if kind == "transpose":
        a, b = dim(), dim()
        return [_op("transpose", a, b)], lambda x: torch.transpose(x, a, b)
    if kind == "permute":
        perm = tuple(draw(st.permutations(range(nd))))
        signed = tuple(p - nd if draw(st.booleans()) else p for p in perm)
        return [_op("permute", signed)], lambda x: torch.permute(x, perm)
    if kind == "t_contiguous":
        a, b = dim(), dim()
        return (
            [_op("transpose", a, b), _op("contiguous")],
            lambda x: torch.transpose(x, a, b).clone(memory_format=torch.contiguous_format),
        )
    if kind == "squeeze":
        d = draw(st.sampled_from([i for i in range(nd) if shape[i] == 1]))
        return [_op("squeeze", d - nd)], lambda x: torch.squeeze(x, d)
    if kind == "unsqueeze":
        d = draw(st.integers(-nd - 1, nd))
        return [_op("unsqueeze", d)], lambda x: torch.unsqueeze(x, d)
    # flatten_or_view: a rank change that always keeps the element order
    numel = 1
    for s in shape:
        numel *= s
    if nd >= 2 and draw(st.booleans()):
        a = draw(st.integers(0, nd - 2))
        b = draw(st.integers(a, nd - 1))
        return [_op("flatten", a, b - nd)], lambda x: torch.flatten(x, a, b)
    divisors = [k for k in range(1, numel + 1) if numel % k == 0] or [1]
    k = draw(st.sampled_from(divisors))
    name = draw(st.sampled_from(["reshape", "view"]))
    # `view` of a non-contiguous input may be impossible; reshape copies in that case
    return [_op("reshape" if name == "view" else name, k, -1)], lambda x: torch.reshape(
        x, (k, numel // k if k else 0)
    )


@st.composite
def _chains(draw: st.DrawFn) -> tuple[tuple[int, ...], OpChain, list[Any]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    chain: list[OpSpec] = []
    eagers: list[Any] = []
    current = _source(*shape)
    for _ in range(draw(st.integers(1, 6))):
        ops, eager = draw(_step(tuple(current.shape)))
        chain.extend(ops)
        eagers.append(eager)
        current = eager(current)
    return shape, tuple(chain), eagers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_chains())
def test_random_chains_replay_bit_exact_against_eager(
    case: tuple[tuple[int, ...], OpChain, list[Any]],
) -> None:
    shape, chain, eagers = case
    x = _source(*shape) + 0.5
    want = x
    for eager in eagers:
        want = eager(want)
    _assert_bit_exact(replay_ops(x, chain), want)
