"""vLLM's post-load processing, re-run after a refit on every module that computes
from a tensor the refit wrote.

vLLM processes weights once after loading (``process_weights_after_loading``): on
CPU it packs linear and embedding weights into kernels of their own (a oneDNN
handle or a prepacked copy), MLA attention derives ``W_UK``/``W_UV`` from
``kv_b_proj``, quantized layers repack. A refit that writes a tensor leaves every
kernel built from the old bytes computing with them, silently, unless the module
holding that kernel is processed again. Modules are found **by storage**, never by
name: a tied ``lm_head`` shares the embedding's parameter and appears under no name
of its own in ``named_parameters()``; a view of another module's weight has a name
nobody would guess.

The plan (:func:`plan_reprocessing`) is built once, before any byte moves:

- an **owner** is a module one of whose destinations is a loader-format buffer
  (processing packed its live tensor away, or others share it): it is processed
  from those buffers;
- a **reader** is any other module holding a tensor of a written storage (its own
  parameters and buffers). A reader with processing is processed again after the
  owners, from the same loader-format bytes; a reader without any reads the bytes
  in place.

An **attention layer** with processing of its own whose subtree holds a written
tensor (MLA derives ``W_UK``/``W_UV`` from ``kv_b_proj``; on CPU they are views of
its weight) is processed again last, as vLLM's loader does after every quant
method: its own ``process_weights_after_loading(act_dtype)``, which copies what it
derives into the storage the kernels hold.

A module that cannot be brought up to date this way is refused with
:class:`UnrefittableModule`, naming it: a reader whose tensor is a different view
of a written storage (its loader format is unknown), one that aliases a tensor
processing turned into another kind (the alias keeps the old bytes), and an MLA
layer whose AMX kernels pack their own weights and free ``kv_b_proj``'s (a path
not verified here).

:func:`reprocess_module` is the one step for one module, also usable on its own
(quantized modules: bind the loader-format tensors, re-run the quant method, copy
the result into the storage the running kernels hold).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.errors import PlanError

__all__ = [
    "Destination",
    "Reprocessing",
    "UnrefittableModule",
    "has_post_load",
    "plan_reprocessing",
    "reprocess_module",
    "storage_key",
]

logger = logging.getLogger(__name__)


class UnrefittableModule(PlanError):
    """A module computes from a tensor the refit writes, and the worker cannot bring
    it up to date; ``module`` is its name in the model."""

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Which memory ``t`` lives in: its device and its storage's base address (two
    views of one storage, or two parameters sharing one, have the same key)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        storage_key(a) == storage_key(b)
        and a.storage_offset() == b.storage_offset()
        and tuple(a.shape) == tuple(b.shape)
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _own_tensors(module: torch.nn.Module, recurse: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters and buffers (its own only, unless ``recurse``) that
    hold memory."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in [
        *module.named_parameters(recurse=recurse),
        *module.named_buffers(recurse=recurse),
    ]:
        if t is not None and t.numel() and t.device.type != "meta":
            out.append((name, t))
    return out


def _quant_processing(module: torch.nn.Module) -> Any:
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None and callable(
        getattr(quant_method, "process_weights_after_loading", None)
    ):
        return quant_method
    return None


def _attention_like(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return bool(is_deferred_attention_layer(module))


def has_post_load(module: torch.nn.Module) -> bool:
    """Whether vLLM processes ``module`` after loading (through its quant method, or
    as an attention-like layer with processing of its own)."""
    return _quant_processing(module) is not None or _attention_like(module)


@dataclass(frozen=True)
class Destination:
    """One tensor a refit writes. ``kernel`` is the live tensor the engine computes
    with; ``loaded`` the loader-format tensor the pull lands in (``kernel`` itself
    when the pull writes it in place)."""

    name: str
    module: str
    leaf: str
    kernel: torch.Tensor | None
    loaded: torch.Tensor

    @property
    def in_place(self) -> bool:
        return self.loaded is self.kernel


@dataclass
class _Step:
    name: str
    module: torch.nn.Module
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Reprocessing:
    """What to process again after each update, in order: ``owners`` from their
    loader-format buffers, then ``readers`` with processing of their own (from the
    same bytes), then ``attention`` layers (their own processing, with the engine's
    activation dtype ``act_dtype``)."""

    owners: list[_Step]
    readers: list[_Step]
    attention: list[_Step] = field(default_factory=list)
    act_dtype: torch.dtype = torch.bfloat16

    @property
    def modules(self) -> list[str]:
        return [s.name for s in (*self.owners, *self.readers, *self.attention)]

    def run(self) -> None:
        """Bring every planned module up to date with the bytes now in the destinations."""
        for step in (*self.owners, *self.readers):
            reprocess_module(step.module, step.loaded)
        for step in self.attention:
            process: Any = step.module.process_weights_after_loading
            process(self.act_dtype)


def plan_reprocessing(
    model: torch.nn.Module,
    destinations: Iterable[Destination],
    act_dtype: torch.dtype = torch.bfloat16,
) -> Reprocessing:
    """Find, by storage, every module of ``model`` that computes from a tensor one of
    ``destinations`` writes, and how to bring it up to date (see the module
    docstring); refuse with :class:`UnrefittableModule` where that cannot be done."""
    dests = list(destinations)
    modules = dict(model.named_modules())
    written: dict[tuple[str, int], list[Destination]] = {}
    for d in dests:
        if d.kernel is not None and d.kernel.numel() and d.kernel.device.type != "meta":
            written.setdefault(storage_key(d.kernel), []).append(d)

    owners: dict[str, _Step] = {}
    for d in dests:
        if not d.in_place:
            owners.setdefault(d.module, _Step(d.module, modules[d.module])).loaded[d.leaf] = (
                d.loaded
            )
    owned = {id(s.module) for s in owners.values()}

    readers: list[_Step] = []
    attention: list[_Step] = []
    for name, module in modules.items():
        if _attention_like(module):
            if id(module) in owned or any(
                storage_key(t) in written for _, t in _own_tensors(module, recurse=True)
            ):
                _check_attention(name, module)
                attention.append(_Step(name, module))
            continue
        if id(module) in owned:
            continue
        step = _Step(name, module)
        for leaf, t in _own_tensors(module):
            hits = written.get(storage_key(t))
            if not hits:
                continue
            match = next(
                (d for d in hits if d.kernel is not None and _same_view(t, d.kernel)), None
            )
            if match is None:
                raise UnrefittableModule(
                    f"refitd: module {name!r} computes from {leaf!r}, a view of the memory "
                    f"that {hits[0].name!r} is refitted into ({tuple(t.shape)} {t.dtype} at "
                    f"offset {t.storage_offset()}, not the parameter itself), so its loader "
                    "format is unknown and its post-load processing cannot be re-run; "
                    "refusing the refit before any byte moves",
                    name,
                )
            kernel = match.kernel
            assert kernel is not None
            if not match.in_place and not _loader_shaped(kernel, match.loaded):
                raise UnrefittableModule(
                    f"refitd: module {name!r} computes from {leaf!r}, which is "
                    f"{match.name!r} after vLLM's post-load processing turned it into "
                    f"another kind ({tuple(kernel.shape)} {kernel.dtype}, loaded "
                    f"as {tuple(match.loaded.shape)} {match.loaded.dtype}); processing "
                    "again would leave this module reading the old bytes; refusing the "
                    "refit before any byte moves",
                    name,
                )
            step.loaded[leaf] = match.loaded
        if step.loaded and _quant_processing(module) is not None:
            readers.append(step)
    return Reprocessing(list(owners.values()), readers, attention, act_dtype)


def _check_attention(name: str, module: torch.nn.Module) -> None:
    """Refuse an attention layer whose processing again is not known to be exact."""
    if getattr(module, "is_amx_bmm_enabled", False):
        raise UnrefittableModule(
            f"refitd: attention layer {name!r} ({type(module).__name__}) packs W_UK/W_UV "
            "for its AMX kernels and frees kv_b_proj's weight when vLLM loads it; processing "
            "it again after a refit is not verified (AMX kernels die with SIGILL on the "
            "machines refitd is tested on), so refitting this model is refused before any "
            "byte moves; start vLLM with AMX off to refit it",
            name,
        )


def _loader_shaped(kernel: torch.Tensor, loaded: torch.Tensor) -> bool:
    return tuple(kernel.shape) == tuple(loaded.shape) and kernel.dtype == loaded.dtype


def _bind(module: torch.nn.Module, leaf: str, t: torch.Tensor) -> None:
    if leaf in module._buffers:
        module.register_buffer(leaf, t, persistent=leaf not in module._non_persistent_buffers_set)
    else:
        module.register_parameter(leaf, torch.nn.Parameter(t.data, requires_grad=False))


def reprocess_module(module: torch.nn.Module, loaded: Mapping[str, torch.Tensor]) -> None:
    """Run vLLM's post-load processing on ``module`` again, from ``loaded`` (leaf name
    → loader-format tensor), the way its layerwise reload does: bind those tensors
    as the module's parameters (or buffers), process, copy what processing made into
    the storage the running kernels hold (so every reference to it, a tied module's
    included, stays valid) and put those tensors back. A tensor processing turned
    into another kind (a shape or dtype of its own) is kept as processing made it.
    ``loaded`` empty: the module's current tensors are processed as they are."""
    kernel = dict(module.named_parameters(recurse=False))
    buffers = dict(module.named_buffers(recurse=False))
    for leaf, t in loaded.items():
        _bind(module, leaf, t)
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    quant_method = _quant_processing(module)
    if getattr(quant_method, "moe_kernel", None) is not None:
        # vLLM 0.32's update path for a built MoE kernel copies the new weights into
        # the old storage without the CPU kernels' prepacking; rebuild the kernel as
        # a first load does (the copy below keeps the kernel tensors' storage).
        quant_method.moe_kernel = None
    if quant_method is not None:
        quant_method.process_weights_after_loading(module)
    for name, old in [*kernel.items(), *buffers.items()]:
        new = getattr(module, name, None)
        if not (
            isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype
        ):
            continue  # processing changed the tensor's kind: keep what it made
        if new.data_ptr() != old.data_ptr() and old.numel():
            old.data.copy_(new)
        if name in kernel:
            module.register_parameter(name, old)  # type: ignore[arg-type]
        else:
            module.register_buffer(
                name, old, persistent=name not in module._non_persistent_buffers_set
            )
