"""Zero-storage placeholders that record how a loader carves up a source tensor.

A placeholder (:class:`~refitd.reshard.lazy_weight.LazyWeight`, built on
:class:`LazyBase` here) stands in for one full trainer tensor while an engine's own
``load_weights`` runs on a meta twin. It carries shape, strides and dtype (so the
loader's shape arithmetic works) but no bytes. Every allow-listed movement op
returns a new placeholder whose op chain grows by one entry, encoded exactly as
:mod:`refitd.reshard.replay` replays it; ``copy_`` (and ``dest[idx] = lazy``) is a
record-only sink that notes which view of which source landed where. Anything
else reaches ``__torch_dispatch__`` and raises :class:`UnsupportedReshard` naming
the aten op, the source and its chain, so an unplannable loader is refused, never
approximated.

``torch.cat``/``torch.stack`` of placeholders build a :class:`LazyConcat`
(``refitd.reshard.lazy_concat``) whose sink records one copy per piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_leaves

from refitd.reshard.owners import StorageOwners
from refitd.reshard.replay import REPLAYABLE_OPS, validate_op
from refitd.reshard.types import (
    CASTABLE,
    RecordedCopy,
    RecordedFill,
    UnsupportedReshard,
    castable,
)

__all__ = [
    "CaptureRecorder",
    "FillRecorder",
    "LazyBase",
    "freeze_args",
    "freeze_kwargs",
]

_ALLOWED_HINT = "allowed: " + ", ".join(sorted(REPLAYABLE_OPS)) + ", cat, stack and the copy_ sink"


class CaptureRecorder:
    """Mutable state one capture shares between every placeholder it built.

    ``owners`` finds the destination a write lands in by its storage (set by the
    capture; without it a write is its running loader's, ``current``). ``current``
    is the full name of the parameter whose stamped loader is running (``None``
    outside any loader). ``copies`` and ``unattributed`` accumulate what the
    ``copy_`` sinks saw (``unowned`` says what each unattributed write was),
    ``fills`` the constant writes loaders made (:class:`FillRecorder`), ``zeroed``
    the sources a loader zeroed in place (their later copies write zeros).
    """

    __slots__ = ("copies", "current", "fills", "owners", "unattributed", "unowned", "zeroed")

    def __init__(self) -> None:
        self.copies: list[RecordedCopy] = []
        self.fills: list[RecordedFill] = []
        self.unattributed = 0
        self.unowned: list[str] = []
        self.zeroed: set[str] = set()
        self.current: str | None = None
        self.owners: StorageOwners | None = None

    def owner_name(self, dest: torch.Tensor, refresh: bool = True) -> str | None:
        """The destination ``dest`` belongs to (by its storage), or ``None``
        (``refresh``: as :meth:`~refitd.reshard.owners.StorageOwners.owner_of`)."""
        if self.owners is None:
            return self.current
        owner = self.owners.owner_of(dest, self.current, refresh)
        return None if owner is None else owner.name


def _method_names() -> dict[Callable[..., Any], str]:
    """Map every callable a loader may use for a movement op to its method name.

    Functional forms (``torch.narrow(x, ...)``) record under the method name, so
    every chain replays uniformly as ``value.name(*args)``.
    """
    names: dict[Callable[..., Any], str] = {}
    aliases = {"moveaxis": "movedim"}
    for name in [*REPLAYABLE_OPS, *aliases]:
        canonical = aliases.get(name, name)
        method = getattr(torch.Tensor, name, None)
        if method is not None:
            names[method] = canonical
        function = getattr(torch, name, None)
        if function is not None and name != "__getitem__":
            names[function] = canonical
    return names


_OP_NAMES = _method_names()
_META = torch.device("meta")
_COPY = torch.Tensor.copy_
_SETITEM = torch.Tensor.__setitem__
# Property getters arrive as fresh method-wrappers: compare with ==, not `is`.
_T_GET = torch.Tensor.T.__get__  # type: ignore[attr-defined]
_MT_GET = torch.Tensor.mT.__get__  # type: ignore[attr-defined]
_ITER = torch.Tensor.__iter__
_ITEM = torch.Tensor.item
_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]
_IDENTITY: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.detach, torch.detach})
# Device moves keep every element and its position; only a dtype change is a cast.
_MOVES: frozenset[Callable[..., Any]] = frozenset(
    {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.type}
)
_CAST_METHODS: dict[Callable[..., Any], torch.dtype] = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.double: torch.float64,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
}
_ZERO = torch.Tensor.zero_
_AS_SHAPE_OF: dict[Callable[..., Any], str] = {
    torch.Tensor.view_as: "view",
    torch.Tensor.reshape_as: "reshape",
}
_CAT_FUNCS: frozenset[Callable[..., Any]] = frozenset({torch.cat, torch.concat, torch.concatenate})


def freeze_args(value: Any) -> Any:
    """Turn lists (and ``torch.Size``) into tuples so a recorded op is immutable."""
    if isinstance(value, list | tuple):
        return tuple(freeze_args(v) for v in value)
    return value


def freeze_kwargs(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The op-chain encoding of keyword arguments: sorted ``(key, value)`` items."""
    return tuple(sorted((k, freeze_args(v)) for k, v in kwargs.items()))


class LazyBase(torch.Tensor):
    """Behaviour shared by every placeholder: op interception, sinks and refusals.

    Subclasses implement :meth:`_apply` (an allow-listed op), :meth:`_record_into`
    (what a sink records), :meth:`source_names` and :meth:`describe`.
    """

    _recorder: CaptureRecorder
    _meta: torch.Tensor

    # Concatenation is implemented in lazy_concat; it registers itself here so this
    # module does not import it (the two would import each other).
    concat_factory: ClassVar[Callable[[list[Any], int, bool], LazyBase] | None] = None

    @staticmethod
    def _wrap(cls: type[LazyBase], meta: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=_META,
            requires_grad=False,
        )

    def source_names(self) -> list[str]:
        """Names of the sources this placeholder reads, in first-use order."""
        raise NotImplementedError

    def describe(self) -> str:
        """A short human name for messages, e.g. ``'w1'`` or ``cat(dim=0)['a', 'b']``."""
        raise NotImplementedError

    def _apply(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _record_into(self, dest: torch.Tensor, param_name: str) -> None:
        raise NotImplementedError

    def cast(self, dtype: torch.dtype) -> LazyBase:
        """``self.to(dtype)``: the same elements, converted as the loader converts.

        Recorded as a step of the placeholder's cast chain, replayed at install on
        the pulled source in the source's dtype (``transfer_plan``); only casts
        between floating dtypes (:data:`~refitd.reshard.types.CASTABLE`) are.
        """
        if dtype == self.dtype:
            return self
        if not castable(self.dtype, dtype):
            raise self.refuse(
                f"to() casts {self.dtype} to {dtype}; only casts between "
                f"{', '.join(sorted(str(d) for d in CASTABLE))} are replayed at install"
            )
        return self._cast(dtype)

    def _cast(self, dtype: torch.dtype) -> LazyBase:
        raise NotImplementedError

    def zero_source(self) -> LazyBase:
        """``source.zero_()`` in place: the loader's later copies of it write zeros.

        gpt-oss's loader zeroes the down-projection bias it reads on every TP rank
        but the first, then copies it in: a constant write, recorded as a fill. Only
        a whole, uncast source may be zeroed (part of one would leave the rest
        readable and the zeroed part not).
        """
        raise self.refuse("zero_() of part of a source (a view, a cast or a concatenation)")

    def refuse(self, cause: str, hint: str = "") -> UnsupportedReshard:
        """An :class:`UnsupportedReshard`: ``cause``, then this placeholder, then ``hint``.

        Everything from ``on lazy '<name>'`` on is what ``summarize_unsupported``
        strips to group thousands of sources failing for one cause.
        """
        tail = f" on lazy {self.describe()!r} ({self._detail()})"
        return UnsupportedReshard(f"{cause}{tail}{'; ' + hint if hint else ''}")

    def _detail(self) -> str:
        return ""

    def _check_result(self, name: str, meta: torch.Tensor) -> None:
        # Read dtypes off the plain meta tensors: a read on the placeholder itself
        # would go through __torch_function__ on every recorded op.
        if meta.dtype != self._meta.dtype:
            raise self.refuse(f"{name} reinterprets dtype {self._meta.dtype} as {meta.dtype}")

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = _OP_NAMES.get(func)
        if name is not None and args and isinstance(args[0], LazyBase):
            return args[0]._apply(name, tuple(args[1:]), kwargs)
        if func is _COPY:
            return _copy_sink(args, kwargs)
        if func is _SETITEM and len(args) == 3 and isinstance(args[2], LazyBase):
            _setitem_sink(args[0], args[1], args[2])
            return None
        if func in _CAT_FUNCS or func is torch.stack:
            return _concat(func is torch.stack, args, kwargs)
        if (func in _IDENTITY or func == _DATA_GET) and args and isinstance(args[0], LazyBase):
            return args[0]  # same elements, same placement: nothing to record
        if func in _MOVES and args and isinstance(args[0], LazyBase):
            return _device_move(args[0], func, args[1:], kwargs)
        if func in _CAST_METHODS and args and isinstance(args[0], LazyBase):
            return args[0].cast(_CAST_METHODS[func])
        if func is _ZERO and args and isinstance(args[0], LazyBase):
            return args[0].zero_source()
        if func is _ITEM and args and isinstance(args[0], LazyBase):
            raise args[0].refuse(
                "item() turns the weight into a Python number (e.g. fill_(w.item()) for a "
                "scalar parameter); a value that leaves the tensor cannot be planned as a pull"
            )
        if func in _AS_SHAPE_OF and len(args) == 2 and isinstance(args[0], LazyBase):
            # x.view_as(y) is x.view(y.shape): record the replayable spelling.
            return args[0]._apply(_AS_SHAPE_OF[func], (tuple(args[1].shape),), {})
        if func is _ITER and isinstance(args[0], LazyBase):
            return iter(args[0]._apply("unbind", (0,), {}))
        if func == _T_GET and isinstance(args[0], LazyBase):
            return args[0]._apply("permute", tuple(range(args[0].dim() - 1, -1, -1)), {})
        if func == _MT_GET and isinstance(args[0], LazyBase):
            return args[0]._apply("transpose", (-2, -1), {})
        # Metadata reads (.shape, .dtype, .size(), .dim(), .stride()) resolve from the
        # wrapper; anything that needs data falls through to __torch_dispatch__.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        lazies = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, LazyBase)]
        lazy = lazies[0] if lazies else None
        if lazy is None:  # pragma: no cover - dispatch only reaches us with a lazy
            raise UnsupportedReshard(f"unsupported op {func} on a placeholder")
        raise lazy.refuse(f"unsupported op {func}", _ALLOWED_HINT)


def _device_move(lazy: LazyBase, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``.to(...)``/``.type(...)``/``.cpu()``/``.cuda()``: the placeholder itself, cast
    (:meth:`LazyBase.cast`) where a dtype is named."""
    dtypes = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.dtype)]
    dtypes += [a.dtype for a in args if isinstance(a, torch.Tensor)]
    if func is torch.Tensor.type and not dtypes:
        # type() names the tensor type (a string): metadata, as torch answers it; a
        # type given by name reaches __torch_dispatch__ and is refused there.
        with torch._C.DisableTorchFunctionSubclass():
            return func(lazy, *args, **kwargs)
    if func in (torch.Tensor.to, torch.Tensor.type) and dtypes:
        if len(set(dtypes)) > 1:
            raise lazy.refuse(f"to() names several dtypes {dtypes}")
        return lazy.cast(dtypes[0])
    return lazy


def _copy_sink(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dest = args[0]
    src = args[1] if len(args) > 1 else kwargs.get("src")
    if not isinstance(src, LazyBase):
        if isinstance(dest, LazyBase):
            raise dest.refuse("copy_ into a placeholder overwrites a source")
        # Neither side is ours (a lazy sat in an unrelated kwarg): behave as torch.
        with torch._C.DisableTorchFunctionSubclass():
            return _COPY(*args, **kwargs)
    _sink(dest, src)
    # Record-only: hand back the destination so the loader carries on unchanged.
    return dest


def _setitem_sink(dest: Any, index: Any, src: LazyBase) -> None:
    """``dest[index] = src``: a copy into the view ``dest[index]``, if it is a view."""
    if isinstance(dest, LazyBase):
        raise src.refuse(f"assignment into placeholder {dest.describe()!r}")
    try:
        # Only basic indexing yields a view; a tensor/list index would record into
        # a temporary copy, i.e. a write that never reaches the parameter.
        validate_op(("__getitem__", (index,), ()))
    except UnsupportedReshard as exc:
        raise src.refuse(f"assignment target: {exc}") from None
    _sink(dest[index], src)


def _sink(dest: Any, src: LazyBase) -> None:
    if isinstance(dest, LazyBase):
        raise src.refuse(f"copy_ of a placeholder into placeholder {dest.describe()!r}")
    if not isinstance(dest, torch.Tensor):
        raise src.refuse(f"copy_ into a {type(dest).__name__}")
    if tuple(dest.shape) != tuple(src.shape):
        # A broadcast copy writes one source element to many destination elements;
        # refused rather than expressed as stride-0 records the planner would have
        # to special-case.
        raise src.refuse(
            f"copy_ broadcasts shape {tuple(src.shape)} into {tuple(dest.shape)}; "
            "broadcasting copies are refused"
        )
    if dest.dtype != src.dtype and not castable(src.dtype, dest.dtype):
        raise src.refuse(
            f"copy_ casts {src.dtype} into a {dest.dtype} destination; only casts "
            f"between {', '.join(sorted(str(d) for d in CASTABLE))} are replayed at install"
        )
    recorder = src._recorder
    name = recorder.owner_name(dest)
    if name is None:
        recorder.unattributed += 1
        recorder.unowned.append(
            f"{src.describe()!r} into a {tuple(dest.shape)} {dest.dtype} tensor"
        )
        return
    src._record_into(dest, name)


def _concat(stack: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = args[0] if args else kwargs.get("tensors", ())
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    extra = set(kwargs) - {"tensors", "dim", "axis"}
    pieces = list(tensors)
    lazies = [p for p in pieces if isinstance(p, LazyBase)]
    op = "stack" if stack else "cat"
    if extra:
        raise lazies[0].refuse(f"{op} with {sorted(extra)} is not a movement op")
    if len(lazies) != len(pieces):
        raise lazies[0].refuse(
            f"{op} mixes placeholders with {len(pieces) - len(lazies)} real tensor(s): the "
            "result is partly synthesized, not derived from a source"
        )
    factory = LazyBase.concat_factory
    if factory is None:  # pragma: no cover - lazy_concat registers at import
        raise lazies[0].refuse(f"{op} support is not loaded")
    return factory(pieces, int(dim), stack)


_FILLS = {torch.Tensor.fill_: "fill_", torch.Tensor.zero_: "zero_"}


class FillRecorder(torch.overrides.TorchFunctionMode):
    """While active, ``fill_``/``zero_`` on a tensor that lies in a destination's
    storage (:attr:`CaptureRecorder.owners`; without owners, inside a stamped
    loader and in its parameter) is recorded as a constant write into that
    destination, with the geometry the view reports. Elsewhere, and on
    placeholders, torch behaves as usual."""

    def __init__(self, recorder: CaptureRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS and args:
            dest = args[0]
            # No refresh on a miss: loaders fill temporaries often, and a fill missed
            # fails closed (its destination is then reported unwritten).
            name = (
                self.recorder.owner_name(dest, refresh=False)
                if isinstance(dest, torch.Tensor)
                and not isinstance(dest, LazyBase)
                and dest.device == _META
                else None
            )
            if name is not None:
                self.recorder.fills.append(
                    RecordedFill(
                        name,
                        int(dest.storage_offset()),
                        tuple(int(n) for n in dest.shape),
                        tuple(int(n) for n in dest.stride()),
                    )
                )
        return func(*args, **kwargs)
