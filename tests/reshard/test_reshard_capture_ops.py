"""What a placeholder records for each movement op, and what it refuses.

Every recorded chain is replayed on the real source and compared with the same
loader code run eagerly on it, so a recording is checked by what it rebuilds,
not only by its spelling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from refitd.reshard.geometry import build_lazy_weights, capture_weights
from refitd.reshard.lazy_weight import LazyWeight
from refitd.reshard.replay import replay_ops
from refitd.reshard.types import OpChain, UnsupportedReshard

F32 = torch.float32
View = Callable[[Any], Any]


def _lazy(shape: tuple[int, ...], dtype: torch.dtype = F32) -> LazyWeight:
    return build_lazy_weights([("src", dtype, shape)])["src"]


def _real(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.Size(shape).numel()), dtype=F32).reshape(shape)


def _recorded(shape: tuple[int, ...], view: View) -> OpChain:
    """The chain ``view`` records, after checking it replays to the eager result."""
    lazy = view(_lazy(shape))
    assert isinstance(lazy, LazyWeight)
    real = _real(shape)
    want = view(real)
    assert tuple(lazy.shape) == tuple(want.shape)
    assert torch.equal(replay_ops(real, lazy._ops), want)
    return lazy._ops


# -- functional forms record under the method name --------------------------------


@pytest.mark.parametrize(
    ("view", "chain"),
    [
        (lambda x: torch.narrow(x, -1, 1, 2), (("narrow", (-1, 1, 2), ()),)),
        (lambda x: torch.select(x, 1, -1), (("select", (1, -1), ()),)),
        (lambda x: torch.transpose(x, 0, -1), (("transpose", (0, -1), ()),)),
        (lambda x: torch.permute(x, (2, 0, 1)), (("permute", ((2, 0, 1),), ()),)),
        (lambda x: torch.flatten(x, 1), (("flatten", (1,), ()),)),
        (lambda x: torch.reshape(x, (4, 6)), (("reshape", ((4, 6),), ()),)),
        (
            lambda x: torch.squeeze(torch.unsqueeze(x, 0), 0),
            (("unsqueeze", (0,), ()), ("squeeze", (0,), ())),
        ),
        (lambda x: torch.movedim(x, 0, 2), (("movedim", (0, 2), ()),)),
        (lambda x: torch.moveaxis(x, 0, 2), (("movedim", (0, 2), ()),)),
        (lambda x: torch.swapaxes(x, 0, 1), (("swapaxes", (0, 1), ()),)),
        (lambda x: torch.unflatten(x, -1, (2, 2)), (("unflatten", (-1, (2, 2)), ()),)),
        (lambda x: torch.chunk(x, 2, 0)[1], (("chunk", (2, 0), ()), ("__getitem__", (1,), ()))),
        (
            lambda x: torch.split(x, [1, 2], 1)[1],
            (("split", ((1, 2),), (("dim", 1),)), ("__getitem__", (1,), ())),
        ),
        (lambda x: torch.unbind(x, -1)[3], (("unbind", (-1,), ()), ("__getitem__", (3,), ()))),
    ],
    ids=[
        "narrow",
        "select",
        "transpose",
        "permute",
        "flatten",
        "reshape",
        "squeeze_unsqueeze",
        "movedim",
        "moveaxis_alias",
        "swapaxes",
        "unflatten",
        "chunk",
        "split",
        "unbind",
    ],
)
def test_functional_forms_record_the_method_name_and_replay_exactly(
    view: View, chain: OpChain
) -> None:
    assert _recorded((2, 3, 4), view) == chain


def test_keyword_arguments_are_recorded_sorted() -> None:
    chain = _recorded((4, 6), lambda x: x.narrow(dim=1, start=2, length=3))
    assert chain == (("narrow", (), (("dim", 1), ("length", 3), ("start", 2))),)


def test_list_arguments_are_recorded_as_tuples() -> None:
    assert _recorded((2, 3), lambda x: x.permute([1, 0])) == (("permute", ((1, 0),), ()),)


# -- views beyond ModelExpress's list ---------------------------------------------


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.select(-2, -1),
        lambda x: x.split(2, dim=-1)[1],
        lambda x: x.unsqueeze(0).unbind()[0],  # the fused-MoE expert path
        lambda x: x.unflatten(0, (1, 2)),
        lambda x: x.transpose(-1, -2).narrow(-2, 1, 2),
        lambda x: x[..., 1::2],
        lambda x: x[None, -1, :-1],
        lambda x: x[0].T,
        lambda x: x.mT,
        lambda x: x.swapdims(0, -1),
        lambda x: x.view(-1).view(4, 2, 3),
        lambda x: x.flatten().unflatten(0, (6, 4)),
    ],
)
def test_rank_changing_and_negative_dim_views_replay_exactly(view: View) -> None:
    assert _recorded((2, 3, 4), view)


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.t().contiguous(),
        lambda x: x.t().reshape(-1),  # reshape of a non-contiguous view copies
        lambda x: x[:, ::2].reshape(3, 2, 1),
        lambda x: x.t().contiguous().view(2, 6),
    ],
    ids=["contiguous", "reshape_copies", "step_then_reshape", "contiguous_then_view"],
)
def test_materializing_views_are_recorded_not_refused(view: View) -> None:
    assert _recorded((3, 4), view)[-1][0] in {"contiguous", "reshape", "view"}


def test_iterating_a_placeholder_records_unbind_and_the_pick() -> None:
    rows = list(_lazy((3, 2)))
    assert [r._ops for r in rows] == [
        (("unbind", (0,), ()), ("__getitem__", (i,), ())) for i in range(3)
    ]


def test_view_as_and_reshape_as_record_the_target_shape() -> None:
    like = torch.empty(6, 2)
    assert _recorded((3, 4), lambda x: x.view_as(like)) == (("view", ((6, 2),), ()),)
    assert _recorded((3, 4), lambda x: x.t().reshape_as(like)) == (
        ("t", (), ()),
        ("reshape", ((6, 2),), ()),
    )


def test_a_placeholder_view_reports_the_strides_a_real_view_would_have() -> None:
    lazy, real = _lazy((3, 4)).t().narrow(0, 1, 2), _real((3, 4)).t().narrow(0, 1, 2)
    assert lazy.stride() == real.stride() and lazy.is_contiguous() == real.is_contiguous()


# -- refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "cause"),
    [
        (lambda x: x * 2, "aten.mul"),
        (lambda x: x.to(torch.int32), "casts"),
        (lambda x: x.view(torch.int32), "reinterprets dtype"),
        (lambda x: x[torch.tensor([0, 2])], "advanced indexing"),
        (lambda x: x[[0, 2]], "advanced indexing"),
        (lambda x: x[x > 0], "aten.gt"),  # building the mask is already refused
        (lambda x: x.index_select(0, torch.tensor([1])), "aten.index_select"),
        (lambda x: x.expand(2, 3, 4), "aten.expand"),
        (lambda x: x.clone(), "aten.clone"),
        (lambda x: x.sum(), "aten.sum"),
    ],
    ids=[
        "mul",
        "cast",
        "dtype_view",
        "tensor_index",
        "list_index",
        "mask",
        "index_select",
        "expand",
        "clone",
        "sum",
    ],
)
def test_ops_outside_the_allow_list_are_refused_naming_the_op_and_source(
    view: View, cause: str
) -> None:
    with pytest.raises(UnsupportedReshard, match=cause) as info:
        view(_lazy((3, 4)))
    assert "'src'" in str(info.value)


def test_a_list_index_is_never_mistaken_for_a_tuple_index() -> None:
    # x[[0, 2]] gathers rows 0 and 2; x[0, 2] is one element. Recording one as the
    # other would pull the wrong bytes, so the list form must be refused.
    with pytest.raises(UnsupportedReshard):
        _lazy((3, 4))[[0, 2]]


@pytest.mark.parametrize(
    "same",
    [
        lambda x: x.detach(),
        lambda x: x.data,
        lambda x: x.to("cpu"),
        lambda x: x.to(device="meta", dtype=F32),
        lambda x: x.cpu(),
        lambda x: x.to(torch.empty(1)),
    ],
    ids=["detach", "data", "to_device", "to_same_dtype", "cpu", "to_like"],
)
def test_device_moves_and_detach_are_the_placeholder_itself(same: View) -> None:
    x = _lazy((3, 4)).narrow(0, 1, 2)
    assert same(x) is x


def test_an_integer_cast_spelled_as_to_is_refused_even_with_a_device() -> None:
    with pytest.raises(UnsupportedReshard, match=r"casts torch\.float32 to torch\.int32"):
        _lazy((3, 4)).to("cpu", torch.int32)


@pytest.mark.parametrize(
    "cast",
    [
        lambda x: x.to("cpu", torch.float16),
        lambda x: x.to(dtype=torch.float16),
        lambda x: x.half(),
        lambda x: x.type(torch.float16),
        lambda x: x.to(torch.empty(1, dtype=torch.float16)),
    ],
    ids=["to_device_dtype", "to_dtype_kw", "half", "type", "to_tensor"],
)
def test_a_floating_cast_in_any_spelling_is_carried_in_the_placeholders_cast_chain(
    cast: View,
) -> None:
    got = cast(_lazy((3, 4)).narrow(0, 1, 2))
    assert got.dtype == torch.float16 and tuple(got.shape) == (2, 4)
    assert got._casts == (torch.float16,) and got._ops == (("narrow", (0, 1, 2), ()),)
    assert got.float()._casts == (torch.float16, torch.float32)
    assert got.to(torch.float16) is got  # no conversion, nothing recorded


def test_item_is_refused_with_the_reason() -> None:
    with pytest.raises(UnsupportedReshard, match=r"item\(\) turns the weight into a Python number"):
        _lazy((1,)).item()


def test_a_placeholder_cannot_be_written_into() -> None:
    with pytest.raises(UnsupportedReshard, match="overwrites a source"):
        _lazy((2,)).copy_(torch.zeros(2))


# -- sinks ---------------------------------------------------------------------------


class OneParam(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], load: Callable[[torch.Tensor, Any], None]) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.empty(shape))
        self.p.weight_loader = load  # type: ignore[attr-defined]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.p.weight_loader(self.p, w)  # type: ignore[operator]


def _capture(
    shape: tuple[int, ...],
    src: tuple[int, ...],
    load: Callable[[torch.Tensor, Any], None],
    dtype: torch.dtype = F32,
) -> Any:
    with torch.device("meta"):
        model = OneParam(shape, load)
    return capture_weights(model, build_lazy_weights([("src", dtype, src)]))


def test_item_assignment_into_a_parameter_slice_is_recorded_as_a_copy() -> None:
    def load(p: torch.Tensor, w: Any) -> None:
        p.data[1:3, ::2] = w.narrow(0, 0, 2)

    result = _capture((4, 4), (3, 2), load)
    (copy,) = result.copies
    assert (copy.dest_offset, copy.dest_shape, copy.dest_stride) == (4, (2, 2), (4, 2))
    assert copy.op_chain == (("narrow", (0, 0, 2), ()),)


def test_item_assignment_through_an_advanced_index_is_refused() -> None:
    def load(p: torch.Tensor, w: Any) -> None:
        p.data[torch.tensor([0, 2])] = w

    result = _capture((4, 3), (2, 3), load)
    assert (
        result.unsupported == ["src"] and "assignment target" in result.unsupported_reasons["src"]
    )


def test_a_copy_that_would_broadcast_is_refused() -> None:
    result = _capture((4, 3), (1, 3), lambda p, w: p.data.copy_(w))
    assert result.copies == []
    assert "broadcasts shape (1, 3) into (4, 3)" in result.unsupported_reasons["src"]


def test_a_floating_copy_that_casts_is_recorded_with_its_destination_dtype() -> None:
    result = _capture((2, 3), (2, 3), lambda p, w: p.data.copy_(w), dtype=torch.bfloat16)
    (copy,) = result.copies
    assert result.unsupported == [] and copy.dest_dtype == F32


def test_a_copy_that_casts_an_integer_source_is_refused() -> None:
    result = _capture((2, 3), (2, 3), lambda p, w: p.data.copy_(w), dtype=torch.int32)
    assert "casts torch.int32 into a torch.float32" in result.unsupported_reasons["src"]


def test_a_copy_into_a_transposed_destination_records_its_strides() -> None:
    result = _capture((3, 2), (2, 3), lambda p, w: p.data.t().copy_(w))
    (copy,) = result.copies
    assert (copy.dest_shape, copy.dest_stride) == ((2, 3), (1, 2))


def test_copy_returns_the_destination_so_chained_loader_code_keeps_working() -> None:
    seen: list[Any] = []

    def load(p: torch.Tensor, w: Any) -> None:
        seen.append(p.data.copy_(w).shape)

    _capture((2, 3), (2, 3), load)
    assert seen == [torch.Size([2, 3])]


def test_type_without_a_dtype_answers_the_type_name_as_torch_does() -> None:
    assert _lazy((2,)).type() == torch.empty(2, device="meta").type()
