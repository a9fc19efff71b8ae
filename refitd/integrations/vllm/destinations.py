"""The worker's destinations, in the *loader* format: what the model's
``weight_loader``\\ s write, before ``process_weights_after_loading``.

:class:`LoaderDestinations` is mixed into
:class:`~refitd.integrations.vllm.worker.RefitdWeightTransferEngine`; at
``init_transfer_engine`` it builds the model afresh on the meta device (the *twin*:
the loaders' geometry without any weights) and, for each of its parameters:

- a parameter that processing left as the loader wrote it (same shape and dtype
  as on a freshly built model, in a module without a quantization method, its
  memory shared with no other tensor) is its own destination: it is moved once
  into shared memory the daemon can write, and every later pull lands in it in
  place;
- any other (a CPU linear weight that processing packed away, a bias it widened,
  an embedding a tied ``lm_head`` shares) gets a loader-format buffer in that
  shared memory.

Two tensors the loaders write apart but vLLM shares (an ``lm_head`` it re-tied to
equal embeddings) are untied first. KV-cache scales vLLM computes itself and an
unquantized checkpoint never holds are no destination. Then the plan of what to
process again after each update is made, found by storage
(:mod:`refitd.integrations.vllm.postload`): a module that cannot be brought up to
date is refused here, naming it, before any byte moves.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import torch

from refitd.integrations.vllm.postload import (
    Destination,
    Reprocessing,
    plan_reprocessing,
    storage_key,
)
from refitd.integrations.vllm.prepared import place_parameter

__all__ = ["Destinations", "LoaderDestinations"]

logger = logging.getLogger(__name__)

_KV_SCALE = re.compile(r"^(_(k|v|q|prob)_scale|(k|v|q|prob)_(scale|zero_point))$")
"""An attention layer's KV-cache quantization state: the buffers every engine has
(``_k_scale``) and the parameters a quantized checkpoint's config adds (``k_scale``,
``k_zero_point``), loaded only when the KV cache itself is quantized."""


class Destinations(torch.nn.Module):
    """A module tree whose parameters are the refit's destinations, by full name."""

    def place(self, name: str, param: torch.nn.Parameter) -> None:
        place_parameter(self, name, param)


def _fresh_config(vllm_config: Any) -> Any:
    """A copy of ``vllm_config`` whose compilation registries are empty, so building
    another model (the meta twin) does not collide with the live one's layer names."""
    vc = copy.copy(vllm_config)
    cc = copy.copy(vllm_config.compilation_config)
    for key, value in list(vars(cc).items()):
        if key.startswith("static_") and isinstance(value, dict | list):
            setattr(cc, key, type(value)())
    vc.compilation_config = cc
    return vc


class LoaderDestinations:
    """The destinations' set-up of the refitd worker engine (module docstring). The
    engine sets the attributes below; :meth:`_destinations` sets the rest."""

    vllm_config: Any
    model: torch.nn.Module
    device: Any
    _untied: list[str]
    _computed: list[str]
    _reprocess: Reprocessing
    _dest_names: dict[int, str]

    def _twin(self) -> torch.nn.Module:
        """The model class built afresh from ``vllm_config`` (the caller puts it on
        the meta device): the loaders' geometry without any weights."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import get_model_architecture
        from vllm.utils.torch_utils import set_default_torch_dtype

        vc = _fresh_config(self.vllm_config)
        model_class, _ = get_model_architecture(vc.model_config)
        with set_default_torch_dtype(vc.model_config.dtype), set_current_vllm_config(vc):
            twin: torch.nn.Module = model_class(vllm_config=vc, prefix="")
        return twin

    @staticmethod
    def _capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        from refitd.reshard.geometry import capture_geometry

        return capture_geometry(twin, manifest, default_weight_loader)

    def _destinations(self) -> Destinations:
        """Loader-format destinations: live parameters in place where processing
        left them as loaded and nothing else shares their memory, loader-format
        buffers for the rest (see the module docstring); then the plan of what to
        process again after each update, found by storage (refused here, before any
        byte moves, if a module cannot be brought up to date)."""
        with torch.device("meta"):
            twin = self._twin()
        owners = dict(self.model.named_modules())
        sharing: dict[tuple[str, int], list[torch.Tensor]] = {}
        for module in owners.values():
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if t is not None and t.numel():
                    sharing.setdefault(storage_key(t), []).append(t)
        dest = Destinations()
        claimed: dict[tuple[str, int], str] = {}
        planned: list[Destination] = []
        self._untied = []
        self._computed = self._computed_buffers(twin)
        for name, meta in twin.named_parameters():
            if name in self._computed:
                # A KV-cache scale the checkpoint does not hold (the KV cache is not
                # quantized): processing consumed it at load, and a refit that bound
                # a blank buffer in its place would re-derive the attention's scales
                # from that blank. It is no destination: the engine keeps its own.
                continue
            prefix, _, leaf = name.rpartition(".")
            module = owners.get(prefix)
            if module is None:
                raise RuntimeError(f"refitd: the live model has no module {prefix!r} for {name!r}")
            if (
                leaf not in module._parameters
                and leaf not in module._buffers
                and isinstance(module._modules.get("base_layer"), torch.nn.Module)
            ):
                # With enable_lora vLLM wraps the layer (``weight`` is then a property
                # of the wrapper): the parameter, and its processing, are the base layer's.
                prefix = f"{prefix}.base_layer"
                module = owners[prefix]
            p = module._parameters.get(leaf)
            if p is not None and p.numel() and storage_key(p) in claimed:
                p = self._untie(module, prefix, leaf, p, claimed[storage_key(p)])
                sharing.setdefault(storage_key(p), []).append(p)
            if p is not None and p.numel():
                claimed[storage_key(p)] = name
            in_place = (
                p is not None
                and tuple(p.shape) == tuple(meta.shape)
                and p.dtype == meta.dtype
                and p.is_contiguous()
                and getattr(module, "quant_method", None) is None
                # moving it into shared memory would leave another tensor of its
                # storage behind; a loader-format buffer copies into that storage
                and all(t is p for t in sharing.get(storage_key(p), []))
            )
            if in_place:
                assert p is not None
                dest.place(name, p)
                planned.append(Destination(name, prefix, leaf, p, p))
            else:
                buf = torch.nn.Parameter(
                    torch.zeros(meta.shape, dtype=meta.dtype, device=self.device),
                    requires_grad=False,
                )
                dest.place(name, buf)
                planned.append(Destination(name, prefix, leaf, p, buf))
        self._reprocess = plan_reprocessing(
            self.model, planned, self.vllm_config.model_config.dtype
        )
        self._dest_names = {id(p): n for n, p in dest.named_parameters()}
        return dest

    def _untie(
        self, module: torch.nn.Module, prefix: str, leaf: str, p: torch.nn.Parameter, first: str
    ) -> torch.nn.Parameter:
        """Give ``prefix.leaf`` memory of its own: vLLM shares it with ``first``
        (it re-ties an ``lm_head`` that equals the embeddings after loading), but
        the loaders write the two separately, so a trainer may make them differ; a
        fresh load of such weights serves them untied too."""
        own = torch.nn.Parameter(p.data.clone(), requires_grad=False)
        own.__dict__.update(p.__dict__)  # weight_loader & co: vLLM's own reload uses them
        module.register_parameter(leaf, own)
        name = f"{prefix}.{leaf}" if prefix else leaf
        self._untied.append(name)
        logger.info("refitd: %s shared %s's memory; untied so each is refitted", name, first)
        return own

    def _computed_buffers(self, twin: torch.nn.Module) -> list[str]:
        """Persistent buffers vLLM sets itself and an unquantized checkpoint never
        holds: the attention layers' KV-cache scales, unused (1.0) unless the KV
        cache is quantized; and the KV-cache scale parameters a quantized config
        adds, which no checkpoint holds for an unquantized KV cache. With a
        quantized KV cache they must be published."""
        cache_dtype = str(getattr(self.vllm_config.cache_config, "cache_dtype", "auto"))
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            return []
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        # Found by the layer that owns them (``attn``, MLA's ``mla_attn``, ...).
        return [
            f"{prefix}.{leaf}" if prefix else leaf
            for prefix, module in twin.named_modules()
            if is_deferred_attention_layer(module)
            for leaf, _ in [
                *module.named_buffers(recurse=False),
                *module.named_parameters(recurse=False),
            ]
            if _KV_SCALE.match(leaf)
        ]
