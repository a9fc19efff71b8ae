"""Replay of recorded movement-op chains on real tensors.

Capture (``geometry``) records how an engine's loader carved a view out of a full
source tensor as an :data:`~refitd.reshard.types.OpChain`. Replaying that chain on
the real source (or on a meta tensor, or on a tensor of element indices) yields
exactly what the loader would have copied. The planner uses replay on index
tensors to resolve a chain to source elements; the receiver uses it on pulled
bytes when a plan chooses a full read plus local replay.

Only pure movement ops are replayable: every element of the result is one element
of the input, unchanged. Anything else is refused, so a chain can never smuggle
arithmetic or a dtype change into a plan.
"""

from __future__ import annotations

from typing import Any

import torch

from refitd.reshard.types import OpChain, OpSpec, UnsupportedReshard

__all__ = ["MULTI_OUTPUT_OPS", "REPLAYABLE_OPS", "replay_ops", "validate_op"]

MULTI_OUTPUT_OPS: frozenset[str] = frozenset({"chunk", "split", "unbind"})
"""Ops returning a tuple of views; a chain always follows one with ``__getitem__(i)``."""

REPLAYABLE_OPS: frozenset[str] = frozenset(
    {
        "narrow",
        "select",
        "__getitem__",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        "permute",
        "movedim",
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "contiguous",
        *MULTI_OUTPUT_OPS,
    }
)
"""Method names a chain may contain. Each is a pure element movement."""


def _describe(index: Any) -> str:
    return type(index).__name__


def _check_index_item(item: Any, op: OpSpec) -> None:
    # bool is an int subclass but indexes as a mask (adds a dim, may drop all
    # elements); a tensor or list index is a gather, not a view.
    if isinstance(item, bool) or not (
        isinstance(item, int) or item is None or item is Ellipsis or isinstance(item, slice)
    ):
        raise UnsupportedReshard(
            f"__getitem__ with a {_describe(item)} index is advanced indexing, not a view; "
            f"refused in op {op!r}"
        )
    if isinstance(item, slice):
        for part in (item.start, item.stop, item.step):
            if part is not None and (isinstance(part, bool) or not isinstance(part, int)):
                raise UnsupportedReshard(
                    f"__getitem__ slice bound of type {_describe(part)} is not a plain int; "
                    f"refused in op {op!r}"
                )


def validate_op(op: OpSpec) -> None:
    """Raise :class:`UnsupportedReshard` unless ``op`` is a well-formed replayable op.

    Well-formed means ``(name, args_tuple, sorted_kwargs_items_tuple)`` with ``name``
    in :data:`REPLAYABLE_OPS` and, for ``__getitem__``, only int / slice / ``None`` /
    ``Ellipsis`` indices (no tensors, lists or bools).
    """
    if not (isinstance(op, tuple) and len(op) == 3):
        raise UnsupportedReshard(f"malformed op {op!r}: expected (name, args, kwargs)")
    name, args, kwargs = op
    if name not in REPLAYABLE_OPS:
        raise UnsupportedReshard(
            f"op {name!r} is not a replayable movement op; allowed: {sorted(REPLAYABLE_OPS)}"
        )
    if not isinstance(args, tuple) or not isinstance(kwargs, tuple):
        raise UnsupportedReshard(f"malformed op {op!r}: args and kwargs must be tuples")
    if name == "__getitem__":
        if len(args) != 1 or kwargs:
            raise UnsupportedReshard(f"malformed op {op!r}: __getitem__ takes one index")
        index = args[0]
        for item in index if isinstance(index, tuple) else (index,):
            _check_index_item(item, op)


def replay_ops(tensor: torch.Tensor, op_chain: OpChain) -> torch.Tensor:
    """Apply ``op_chain`` to ``tensor`` left to right and return the resulting view.

    Each op is ``(method_name, args, frozen_kwargs)`` and is applied as
    ``value.method_name(*args, **dict(frozen_kwargs))``. A multi-output op
    (``chunk``/``split``/``unbind``) yields a tuple that the next op, a
    ``("__getitem__", (i,), ())``, picks a piece from; a chain that ends on a tuple
    is refused. The result is whatever eager torch returns: a view where torch
    returns a view, a copy after ``contiguous()``/``reshape`` of a non-viewable
    layout. Unknown op names raise :class:`UnsupportedReshard` naming the op.
    """
    value: Any = tensor
    for op in op_chain:
        validate_op(op)
        name, args, kwargs = op
        if isinstance(value, tuple):
            # The only thing one can do with a multi-output result is pick a piece.
            if name != "__getitem__" or not isinstance(args[0], int) or isinstance(args[0], bool):
                raise UnsupportedReshard(
                    f"op {name!r} applied to a multi-output result; only __getitem__(int) "
                    f"may follow chunk/split/unbind"
                )
            value = value[args[0]]
            continue
        value = getattr(value, name)(*args, **dict(kwargs))
    if not isinstance(value, torch.Tensor):
        raise UnsupportedReshard(
            f"op chain ends on a {type(value).__name__}, not a tensor: a multi-output op "
            f"must be followed by __getitem__(i); chain={op_chain!r}"
        )
    return value
