"""``convert_source_weights``: trainer→engine conversions traced on placeholders."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refitd.reshard.geometry import convert_source_weights
from refitd.reshard.lazy import LazyBase
from refitd.reshard.lazy_concat import LazyConcat
from refitd.reshard.lazy_weight import LazyWeight
from refitd.reshard.types import UnsupportedReshard

BF16 = torch.bfloat16
ENTRIES = [
    ("router.weight", BF16, (2, 4)),
    ("experts.w13", BF16, (3, 2, 4)),
]


def test_no_conversion_yields_one_untouched_placeholder_per_source() -> None:
    weights = convert_source_weights(None, ENTRIES)

    assert list(weights) == ["router.weight", "experts.w13"]
    for name, lazy in weights.items():
        assert isinstance(lazy, LazyWeight)
        assert lazy._name == name and lazy._ops == ()
        assert lazy.dtype == BF16


def test_a_rename_keeps_the_source_name_and_drops_unused_sources() -> None:
    weights = convert_source_weights(lambda sd: {"mlp.gate.weight": sd["router.weight"]}, ENTRIES)

    assert list(weights) == ["mlp.gate.weight"]
    renamed = weights["mlp.gate.weight"]
    assert isinstance(renamed, LazyWeight)
    assert renamed._name == "router.weight" and renamed._ops == ()


def test_every_converted_placeholder_shares_one_recorder() -> None:
    weights = convert_source_weights(
        lambda sd: {
            "a": sd["router.weight"],
            "b": sd["experts.w13"].select(0, 1),
            "c": torch.cat([sd["experts.w13"][0], sd["router.weight"]]),
        },
        ENTRIES,
    )
    assert len({id(w._recorder) for w in weights.values()}) == 1


def test_a_conversion_may_return_pairs_instead_of_a_mapping() -> None:
    weights = convert_source_weights(lambda sd: [("x", sd["router.weight"].t())], ENTRIES)
    assert weights["x"].shape == (4, 2)


def test_an_expert_unstack_records_a_select_per_expert() -> None:
    def convert(sd: dict[str, Any]) -> dict[str, Any]:
        stacked = sd["experts.w13"]
        return {f"experts.{e}.weight": stacked.select(0, e) for e in range(stacked.shape[0])}

    weights = convert_source_weights(convert, ENTRIES)

    expert = weights["experts.2.weight"]
    assert isinstance(expert, LazyWeight)
    assert expert._name == "experts.w13" and expert._ops == (("select", (0, 2), ()),)
    assert tuple(expert.shape) == (2, 4)


def test_an_unbind_unstack_records_unbind_then_the_pick() -> None:
    weights = convert_source_weights(
        lambda sd: dict(zip(("e0", "e1", "e2"), sd["experts.w13"].unbind(0), strict=True)), ENTRIES
    )
    e1 = weights["e1"]
    assert isinstance(e1, LazyWeight)
    assert e1._ops == (("unbind", (0,), ()), ("__getitem__", (1,), ()))


def test_a_synthesized_tensor_is_refused() -> None:
    def convert(sd: dict[str, Any]) -> dict[str, Any]:
        return {"a": sd["router.weight"], "bias": torch.zeros(2, dtype=BF16)}

    with pytest.raises(UnsupportedReshard, match="'bias' is a synthesized Tensor"):
        convert_source_weights(convert, ENTRIES)


def test_an_integer_cast_is_refused() -> None:
    with pytest.raises(UnsupportedReshard, match="casts"):
        convert_source_weights(lambda sd: {"a": sd["router.weight"].to(torch.int32)}, ENTRIES)


def test_a_floating_cast_is_carried_to_the_loader_as_a_cast_chain() -> None:
    weights = convert_source_weights(lambda sd: {"a": sd["router.weight"].float()}, ENTRIES)
    assert isinstance(weights["a"], LazyWeight) and weights["a"]._casts == (torch.float32,)


def test_a_same_dtype_to_is_a_no_op_and_accepted() -> None:
    weights = convert_source_weights(lambda sd: {"a": sd["router.weight"].to(BF16)}, ENTRIES)
    assert isinstance(weights["a"], LazyWeight) and weights["a"]._ops == ()


def test_a_placeholder_from_another_build_is_refused() -> None:
    stranger = convert_source_weights(None, [("other", BF16, (2,))])["other"]
    with pytest.raises(UnsupportedReshard, match="another capture"):
        convert_source_weights(lambda sd: {"a": sd["router.weight"], "b": stranger}, ENTRIES)


def test_a_stack_of_unstacked_experts_becomes_a_concatenation_of_sources() -> None:
    # e.g. a trainer publishing per-expert tensors and an engine that wants one stack
    entries = [(f"e{i}", BF16, (2, 4)) for i in range(3)]
    weights = convert_source_weights(
        lambda sd: {"w": torch.stack([sd[f"e{i}"] for i in range(3)])}, entries
    )
    stacked = weights["w"]
    assert isinstance(stacked, LazyConcat) and isinstance(stacked, LazyBase)
    assert tuple(stacked.shape) == (3, 2, 4)
    assert stacked.source_names() == ["e0", "e1", "e2"]


def test_a_cat_with_a_real_tensor_is_refused_as_synthesized() -> None:
    with pytest.raises(UnsupportedReshard, match="synthesized"):
        convert_source_weights(
            lambda sd: {"w": torch.cat([sd["router.weight"], torch.zeros(1, 4, dtype=BF16)])},
            ENTRIES,
        )
