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
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from refitd.integrations.vllm.postload import (
    Destination,
    UnrefittableModule,
    plan_reprocessing,
    storage_key,
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


class Absorbing(AttentionLayerBase, torch.nn.Module):
    """An attention-like layer that derives its kernels' weights from a child
    projection when processed, as MLA derives ``W_UK``/``W_UV`` from ``kv_b_proj``:
    on CPU they are views of the child's weight, re-derived into their own storage
    (``prefer_copy``) when processed again."""

    def __init__(self, weight: torch.nn.Parameter, amx: bool = False) -> None:
        torch.nn.Module.__init__(self)
        self.kv_b_proj = layer(weight)
        self.is_amx_bmm_enabled = amx
        self.processed_with: list[torch.dtype] = []

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self.processed_with.append(act_dtype)
        w_uk, w_uv = self.kv_b_proj.weight.split([2, 2], dim=0)
        for name, t in (("W_UK_T", w_uk.t()), ("W_UV", w_uv)):
            old = getattr(self, name, None)
            if old is None:
                self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
            else:
                old.data.copy_(t)

    def get_attn_backend(self) -> Any:
        raise NotImplementedError

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        raise NotImplementedError


def mla_model(amx: bool = False) -> torch.nn.Module:
    model = torch.nn.Module()
    model.attn = Absorbing(torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False), amx)
    model.attn.process_weights_after_loading(torch.bfloat16)  # vLLM's load
    return model


def test_an_attention_layer_deriving_from_a_written_weight_is_processed_again_last() -> None:
    model = mla_model()
    uk, uv = model.attn.W_UK_T, model.attn.W_UV
    assert storage_key(uk) == storage_key(model.attn.kv_b_proj.weight)  # views, as on CPU
    buf = torch.zeros(4, 3)
    plan = plan_reprocessing(
        model,
        [
            Destination(
                "attn.kv_b_proj.weight",
                "attn.kv_b_proj",
                "weight",
                model.attn.kv_b_proj.weight,
                buf,
            )
        ],
        torch.float16,
    )
    assert plan.modules == ["attn.kv_b_proj", "attn"]  # the projection first, then the layer
    buf.copy_(torch.arange(12.0).view(4, 3))  # the pull lands
    plan.run()
    assert model.attn.processed_with == [torch.bfloat16, torch.float16]
    assert model.attn.W_UK_T is uk and model.attn.W_UV is uv  # the kernels' storage kept
    assert torch.equal(uk, buf[:2].t()) and torch.equal(uv, buf[2:])


def test_an_attention_layer_whose_amx_kernels_pack_their_own_weights_is_refused_naming_it() -> None:
    model = mla_model(amx=True)
    w = model.attn.kv_b_proj.weight
    with pytest.raises(UnrefittableModule, match=r"attention layer 'attn'.*AMX") as e:
        plan_reprocessing(
            model,
            [
                Destination(
                    "attn.kv_b_proj.weight", "attn.kv_b_proj", "weight", w, torch.zeros(4, 3)
                )
            ],
        )
    assert e.value.module == "attn"
