"""vLLM's post-load processing run ahead of the swap, into new storage.

:meth:`Reprocessing.run <refitd.integrations.vllm.postload.Reprocessing.run>` processes
modules in place, after the new bytes are bound: correct, but it holds the engine for
as long as processing takes (on CPU, oneDNN repacks every linear weight). An in-flight
refit (docs/vllm.md) instead prepares while the engine serves:

- :func:`prepare` runs each owner's and reader's processing on a **twin** of the
  module (a shallow copy with parameter and buffer tables of its own, and its own copy
  of the quant method, whose processing may keep state on it), from the loader-format
  bytes waiting in the inactive copy. The live module is never touched, so the engine
  serves on from it meanwhile. Every tensor processing leaves in shared memory refitd
  pulls into (a weight processing kept as loaded) is cloned into memory of its own, so
  the next prefetch, which writes that memory, cannot change what serves.
- :meth:`Prepared.apply`, in the pause, moves each twin's state into its live module:
  a tensor of the same shape and dtype is rebound (``p.data = new``: every holder of
  that parameter follows), or copied into the old storage when a module not prepared
  here holds that storage too (the one copy left in the pause); anything else
  processing set (a new kernel handle, a ``cpu_linear`` closure, a repacked weight of
  another kind) replaces the live one.
- Attention layers with processing of their own (MLA's ``W_UK``/``W_UV``, views of
  ``kv_b_proj``'s weight on CPU) are processed in the pause, in place, after the
  rebinding: their processing writes into the storage the running kernels hold.

Preparation that raises leaves the live model as it was: nothing is applied, and the
in-flight refit is refused before any pause.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.integrations.vllm.postload import Reprocessing, storage_key

__all__ = ["Prepared", "place_parameter", "prepare"]

_TABLES = ("_parameters", "_buffers", "_modules")


@dataclass
class _Twin:
    name: str
    live: torch.nn.Module
    twin: torch.nn.Module


@dataclass
class Prepared:
    """Processing done ahead for one version; :meth:`apply` installs it (in the pause)."""

    twins: list[_Twin]
    attention: list[tuple[str, torch.nn.Module]]
    act_dtype: torch.dtype
    shared: set[tuple[str, int]] = field(default_factory=set)
    """Storage keys held by modules not prepared here: copied into, never rebound."""

    @property
    def modules(self) -> list[str]:
        return [t.name for t in self.twins] + [n for n, _ in self.attention]

    def apply(self) -> None:
        """Move every twin's state into its live module, then process the attention
        layers (the only processing left in the pause)."""
        for t in self.twins:
            _adopt(t.live, t.twin, self.shared)
        for _, module in self.attention:
            process: Any = module.process_weights_after_loading
            process(self.act_dtype)


def _twin_of(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` whose tables, parameters and quant method are its
    own: processing it changes nothing the live module's forward reads."""
    twin = copy.copy(module)
    twin.__dict__["_parameters"] = {
        k: None if p is None else torch.nn.Parameter(p.data, requires_grad=False)
        for k, p in module._parameters.items()
    }
    for k, p in module._parameters.items():
        mine = twin._parameters[k]
        if p is not None and mine is not None:
            mine.__dict__.update(p.__dict__)  # weight_loader & co
    twin.__dict__["_buffers"] = dict(module._buffers)
    twin.__dict__["_modules"] = dict(module._modules)
    qm = module.__dict__.get("quant_method")
    if qm is not None:
        twin.__dict__["quant_method"] = copy.copy(qm)
    twin.__dict__.pop("_already_called_process_weights_after_loading", None)
    return twin


def _bind(module: torch.nn.Module, leaf: str, t: torch.Tensor) -> None:
    if leaf in module._buffers:
        module._buffers[leaf] = t
    else:
        old = module._parameters.get(leaf)
        p = torch.nn.Parameter(t, requires_grad=False)
        if old is not None:
            p.__dict__.update(old.__dict__)  # weight_loader & co
        module._parameters[leaf] = p


def place_parameter(root: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Register ``param`` under its full dotted ``name`` in ``root``, making the plain
    modules on the way: a tree whose parameters are a refit's destinations by name."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            mod.add_module(part, child)
        mod = child
    mod.register_parameter(leaf, param)


def _own(t: torch.Tensor, pulled: Callable[[torch.Tensor], bool]) -> torch.Tensor:
    return t.clone() if t.numel() and pulled(t) else t


def prepare(
    plan: Reprocessing,
    model: torch.nn.Module,
    prefetched: Callable[[torch.Tensor], torch.Tensor],
    pulled: Callable[[torch.Tensor], bool],
    pace: Callable[[float], None] | None = None,
) -> Prepared:
    """Run ``plan``'s processing ahead, on twins (module docstring). ``prefetched(t)`` is
    the inactive copy's view of the loader-format tensor ``t`` a step names (the new
    version's bytes); ``pulled(t)`` whether ``t`` lives in memory a later pull writes;
    ``pace(s)``, when given, is called after each step with the seconds it took."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    twins: list[_Twin] = []
    for step in (*plan.owners, *plan.readers):
        began = time.perf_counter()
        twin = _twin_of(step.module)
        for leaf, t in step.loaded.items():
            _bind(twin, leaf, prefetched(t))
        qm: Any = twin.__dict__.get("quant_method")
        if qm is not None and (
            isinstance(qm, QuantizeMethodBase)
            or callable(getattr(qm, "process_weights_after_loading", None))
        ):
            if getattr(qm, "moe_kernel", None) is not None:
                qm.moe_kernel = None  # as postload.reprocess_module: rebuilt as at load
            qm.process_weights_after_loading(twin)
        for table in ("_parameters", "_buffers"):
            tensors: dict[str, Any] = twin.__dict__[table]
            for k, v in list(tensors.items()):
                if v is None:
                    continue
                own = _own(v.data if isinstance(v, torch.nn.Parameter) else v, pulled)
                if isinstance(v, torch.nn.Parameter):
                    v.data = own
                else:
                    tensors[k] = own
        twins.append(_Twin(step.name, step.module, twin))
        if pace is not None:
            pace(time.perf_counter() - began)
    prepared_ids = {id(t.live) for t in twins}
    shared = {
        storage_key(x) for m in model.modules() if id(m) not in prepared_ids for x in _tensors(m)
    }
    return Prepared(twins, [(s.name, s.module) for s in plan.attention], plan.act_dtype, shared)


def _tensors(m: torch.nn.Module) -> Iterable[torch.Tensor]:
    for t in [*m._parameters.values(), *m._buffers.values()]:
        if t is not None and t.numel() and t.device.type != "meta":
            yield t


def _adopt(live: torch.nn.Module, twin: torch.nn.Module, shared: set[tuple[str, int]]) -> None:
    """``live`` takes ``twin``'s processed state (see :meth:`Prepared.apply`)."""
    for table in ("_parameters", "_buffers"):
        mine: dict[str, Any] = live.__dict__[table]
        theirs: dict[str, Any] = twin.__dict__[table]
        for k in [k for k in mine if k not in theirs]:
            del mine[k]
        for k, new in theirs.items():
            old = mine.get(k)
            if (
                old is None
                or new is None
                or old.shape != new.shape
                or old.dtype != new.dtype
                or not old.numel()
            ):
                mine[k] = new
            elif storage_key(old) in shared:
                old.data.copy_(new)  # another module holds this storage: keep it
            elif table == "_parameters":
                old.data = new.data
            else:
                mine[k] = new
    for k, v in twin.__dict__.items():
        if k not in _TABLES and live.__dict__.get(k, _MISSING) is not v:
            live.__dict__[k] = v
    for k in [k for k in live.__dict__ if k not in twin.__dict__]:
        del live.__dict__[k]


_MISSING = object()
