"""Which modules a refit processes again, found by storage, and which it refuses.

Plain torch modules stand in for vLLM layers here; their post-load processing is an
implementation of vLLM's own ``QuantizeMethodBase`` that packs a private copy of the
weight, as the CPU GEMM dispatch does. The engine-level behaviour (a tied
``lm_head`` on a real engine) is in ``test_vllm_families.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from refitd.integrations.vllm.postload import (
    Destination,
    UnrefittableModule,
    plan_reprocessing,
)


class PackedCopy(QuantizeMethodBase):
    """Processing that keeps a packed private copy of ``weight`` (``layer.packed``)
    and computes from it, never from ``weight``."""

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def apply(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return args[0] @ layer.packed.t()  # type: ignore[no-any-return]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()


def layer(weight: torch.nn.Parameter) -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_parameter("weight", weight)
    m.quant_method = PackedCopy()
    m.quant_method.process_weights_after_loading(m)
    return m


def tied_model() -> torch.nn.Module:
    model = torch.nn.Module()
    shared = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    model.embed = layer(shared)
    model.norm = torch.nn.Module()
    model.norm.register_parameter("weight", torch.nn.Parameter(torch.ones(3), requires_grad=False))
    model.head = layer(shared)  # tied: the same parameter, no name of its own
    return model


def test_a_module_tied_to_a_written_parameter_is_processed_again_from_the_new_bytes() -> None:
    model = tied_model()
    assert [n for n, _ in model.named_parameters()] == ["embed.weight", "norm.weight"]
    buf = torch.zeros(4, 3)
    plan = plan_reprocessing(
        model,
        [
            Destination("embed.weight", "embed", "weight", model.embed.weight, buf),
            Destination("norm.weight", "norm", "weight", model.norm.weight, model.norm.weight),
        ],
    )
    assert plan.modules == ["embed", "head"]
    buf.copy_(torch.arange(12.0).view(4, 3))  # the pull lands
    plan.run()
    x = torch.ones(1, 3)
    assert torch.equal(model.head.quant_method.apply(model.head, x), x @ buf.t())
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, buf)


def test_a_module_holding_another_view_of_a_written_tensor_is_refused_naming_it() -> None:
    model = tied_model()
    model.rows = layer(torch.nn.Parameter(model.embed.weight.data[:2], requires_grad=False))
    with pytest.raises(UnrefittableModule, match=r"module 'rows' computes from 'weight'") as e:
        plan_reprocessing(
            model,
            [Destination("embed.weight", "embed", "weight", model.embed.weight, torch.zeros(4, 3))],
        )
    assert e.value.module == "rows"


def test_a_module_aliasing_a_tensor_processing_changed_in_kind_is_refused_naming_it() -> None:
    model = tied_model()
    packed = torch.nn.Parameter(torch.zeros(12), requires_grad=False)  # processed: flat
    model.embed.register_parameter("weight", packed)
    model.head.register_parameter("weight", packed)
    with pytest.raises(UnrefittableModule, match=r"module 'head'.*another kind"):
        plan_reprocessing(
            model, [Destination("embed.weight", "embed", "weight", packed, torch.zeros(4, 3))]
        )
