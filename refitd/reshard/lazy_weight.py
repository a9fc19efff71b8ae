"""The placeholder of one source tensor: :class:`LazyWeight`, and the views of it a
loader makes.

A :class:`LazyWeight` stands in for one full trainer tensor while an engine's own
``load_weights`` runs on a meta twin. It carries shape, strides and dtype (so the
loader's shape arithmetic works) but no bytes. Every allow-listed movement op
returns a new placeholder whose op chain grows by one entry, encoded exactly as
:mod:`refitd.reshard.replay` replays it; a cast grows its cast chain; and when it
reaches a ``copy_`` sink it records one :class:`~refitd.reshard.types.RecordedCopy`
(or, for a source the loader zeroed, a constant fill). Interception, sinks and
refusals are the placeholders' common base, :class:`~refitd.reshard.lazy.LazyBase`.
"""

from __future__ import annotations

from typing import Any

import torch

from refitd.reshard.lazy import CaptureRecorder, LazyBase, freeze_args, freeze_kwargs
from refitd.reshard.replay import MULTI_OUTPUT_OPS, validate_op
from refitd.reshard.types import OpChain, OpSpec, RecordedCopy, RecordedFill, UnsupportedReshard

__all__ = ["LazyWeight"]


class LazyWeight(LazyBase):
    """Placeholder for one full source tensor, or an allow-listed view of one.

    ``_name`` is the source's name (kept through any rename in a conversion);
    ``_ops`` the chain from the full source to this view; ``_recorder`` the capture
    state shared by all placeholders of one capture.
    """

    _name: str
    _ops: OpChain
    _casts: tuple[torch.dtype, ...]
    """The dtypes the loader converted the source through, in order (the last is
    this placeholder's dtype); empty while it has the source's dtype."""

    @staticmethod
    def __new__(
        cls,
        name: str,
        shape: torch.Size | tuple[int, ...] | list[int],
        dtype: torch.dtype,
        device: str | torch.device = "meta",
        ops: OpChain = (),
        recorder: CaptureRecorder | None = None,
        meta: torch.Tensor | None = None,
    ) -> LazyWeight:
        if meta is None:
            meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
        t: LazyWeight = LazyBase._wrap(cls, meta)
        t._name = name
        t._ops = tuple(ops)
        t._recorder = recorder if recorder is not None else CaptureRecorder()
        t._meta = meta
        t._casts = ()
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        casts = f", casts={self._casts!r}" if self._casts else ""
        return f"LazyWeight({self._name!r}, shape={tuple(self.shape)}, ops={self._ops!r}{casts})"

    def source_names(self) -> list[str]:
        return [self._name]

    def describe(self) -> str:
        return self._name

    def _detail(self) -> str:
        casts = f", casts={tuple(str(d) for d in self._casts)}" if self._casts else ""
        return f"chain={self._ops!r}{casts}"

    def _child(self, meta: torch.Tensor, ops: OpChain) -> LazyWeight:
        child = LazyWeight(self._name, meta.shape, meta.dtype, "meta", ops, self._recorder, meta)
        child._casts = self._casts
        return child

    def _cast(self, dtype: torch.dtype) -> LazyBase:
        meta = torch.empty_strided(
            self._meta.shape, self._meta.stride(), dtype=dtype, device="meta"
        )
        child = self._child(meta, self._ops)
        child._casts = (*self._casts, dtype)
        return child

    def zero_source(self) -> LazyBase:
        if self._ops or self._casts:
            return super().zero_source()
        self._recorder.zeroed.add(self._name)
        return self

    def _apply(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name == "__getitem__":
            # Validated raw: freezing would turn an advanced list index into a
            # basic tuple index and record the wrong elements.
            op: OpSpec = (name, tuple(args), ())
            try:
                validate_op(op)
            except UnsupportedReshard as exc:
                raise self.refuse(str(exc)) from None
        else:
            op = (name, freeze_args(args), freeze_kwargs(kwargs))
        result = getattr(self._meta, name)(*args, **kwargs)
        ops = (*self._ops, op)
        if isinstance(result, torch.Tensor):
            self._check_result(name, result)
            return self._child(result, ops)
        if name in MULTI_OUTPUT_OPS:
            # One child per piece; the trailing __getitem__ lets replay pick it again.
            return tuple(
                self._child(piece, (*ops, ("__getitem__", (i,), ())))
                for i, piece in enumerate(result)
            )
        raise self.refuse(f"{name} returned a {type(result).__name__}, not a view")

    def _record_into(self, dest: torch.Tensor, param_name: str) -> None:
        recorder = self._recorder
        if self._name in recorder.zeroed:
            # The loader zeroed this source before copying it: zeros, from no pull.
            recorder.fills.append(
                RecordedFill(
                    param_name,
                    int(dest.storage_offset()),
                    tuple(int(n) for n in dest.shape),
                    tuple(int(n) for n in dest.stride()),
                )
            )
            return
        recorder.copies.append(
            RecordedCopy(
                src_name=self._name,
                op_chain=self._ops,
                param_name=param_name,
                dest_offset=int(dest.storage_offset()),
                dest_shape=tuple(dest.shape),
                dest_stride=tuple(dest.stride()),
                dest_dtype=dest.dtype,
                casts=self._casts,
            )
        )
