"""Which destination a loader's write lands in, found by the memory it lands in.

A capture records a write as the write of the parameter (or persistent buffer)
whose storage it lands in, whichever code made it: a ``weight_loader``, or the
model's own ``load_weights`` copying into ``param.data`` itself (gpt-oss's experts,
biases and attention sinks). On the meta device every allocation still has a
storage object of its own, shared by all views of it (``.data``, ``[i]``,
``narrow``), so the storage identifies the owner without any bytes.

A write into a storage no parameter or persistent buffer owns (a temporary the
loader then copies on, or a tensor of its own) cannot be tied to a destination; the
capture keeps it as an unattributed write and the receiver refuses the refit naming
it, before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Owner", "StorageOwners", "owned_tensors"]


@dataclass(frozen=True)
class Owner:
    """A destination by name, and the tensor the model holds under that name."""

    name: str
    tensor: torch.Tensor


def owned_tensors(model: torch.nn.Module) -> list[Owner]:
    """Every parameter and persistent buffer of ``model``: what a checkpoint load
    writes (the same destinations ``coverage.destinations_of`` lists). A tensor held
    under several names (a tied ``lm_head``) is listed once, under its first name."""
    out = [Owner(n, p) for n, p in model.named_parameters()]
    seen = {id(p) for p in model.parameters()}
    for prefix, mod in model.named_modules():
        skip = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is None or name in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append(Owner(f"{prefix}.{name}" if prefix else name, buf))
    return out


def _storage_key(t: torch.Tensor) -> int:
    # The storage implementation's address: one per allocation, shared by every view
    # (meta tensors included, whose storages hold no bytes).
    return int(t.untyped_storage()._cdata)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last]`` element of ``t``'s storage that ``t`` reaches."""
    lo = int(t.storage_offset())
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)
    return lo, lo + max(reach, 0)


class StorageOwners:
    """Storage → the destinations of a model that live in it.

    Built once per capture; rebuilt once when a write lands in a storage it does not
    know (a loader may rebind a parameter's ``data`` while it loads), so a write is
    attributed to the storage as it is when the write happens. Holding the tensors
    keeps their storages alive, so an address is never reused during the capture.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._table: dict[int, list[Owner]] = {}
        self._refresh()

    def _refresh(self) -> None:
        table: dict[int, list[Owner]] = {}
        for owner in owned_tensors(self._model):
            table.setdefault(_storage_key(owner.tensor), []).append(owner)
        self._table = table

    def owner_of(
        self, dest: torch.Tensor, hint: str | None = None, refresh: bool = True
    ) -> Owner | None:
        """The destination ``dest`` (a view being written) belongs to, or ``None``.

        When several destinations share the storage, the one whose elements hold
        every element of ``dest`` is its owner (``hint``, the parameter whose loader
        is running, first if it is one of them); ``None`` if no single one does.
        ``refresh``: look the model's destinations up again before answering
        ``None`` for a storage not seen.
        """
        key = _storage_key(dest)
        candidates = self._table.get(key)
        if candidates is None and not refresh:
            return None
        if candidates is None:
            self._refresh()
            candidates = self._table.get(key)
            if candidates is None:
                return None
        if len(candidates) == 1:
            return candidates[0]
        lo, hi = _span(dest)
        holding = [c for c in candidates if _span(c.tensor)[0] <= lo and hi <= _span(c.tensor)[1]]
        for c in holding:
            if c.name == hint:
                return c
        return holding[0] if len(holding) == 1 else None
