"""Value types shared by every stage of the reshard planner.

A *source* is one full trainer tensor (by name, in its global shape). Capture
records, for every destination parameter, which view of which source the engine's
loader copied and where the copy landed; the later stages turn those records into
contiguous reads. Everything here is plain data: no I/O, no torch storage.

Op chains use ModelExpress's encoding so plans port between the two projects: a
chain is a tuple of ``(method_name, args, frozen_kwargs)`` applied left to right to
the full source tensor, where ``frozen_kwargs`` is ``tuple(sorted(kwargs.items()))``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.errors import PlanError

__all__ = [
    "CASTABLE",
    "CaptureResult",
    "IncompleteRefit",
    "OpChain",
    "OpSpec",
    "RecordedCopy",
    "RecordedFill",
    "UnsupportedReshard",
    "castable",
    "summarize_unsupported",
]

OpSpec = tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]]
"""One recorded op: ``(method name, positional args, sorted kwargs items)``."""

OpChain = tuple[OpSpec, ...]
"""Ops applied, in order, to the full source tensor to obtain what was copied."""


class UnsupportedReshard(PlanError):
    """A source's geometry cannot be planned exactly, so it must not be pulled.

    Raised while capturing (an op outside the allow-list touched a placeholder, a
    conversion synthesized a tensor) and by receivers that refuse a plan carrying
    any unsupported or unattributed source. The message names the source and the
    cause; never is a partial or approximate plan produced instead.
    """


class IncompleteRefit(UnsupportedReshard):
    """The engine's loaders would leave destinations unwritten by the manifest.

    ``missing`` maps every such parameter or buffer to ``(unwritten elements, total
    elements)``; the message names each of them.
    """

    def __init__(self, message: str, missing: dict[str, tuple[int, int]]) -> None:
        super().__init__(message)
        self.missing = missing


CASTABLE = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})
"""Floating dtypes a loader's ``copy_`` may convert between. Such a copy is planned
as a full read in the source's dtype and converted at install by the same
``copy_`` the loader runs, so the destination holds exactly what a fresh load
would (a narrowing cast rounds as the loader's does, no more, no less)."""


def castable(src: torch.dtype, dest: torch.dtype) -> bool:
    """Whether a loader's ``copy_`` of ``src`` into ``dest`` can be replayed exactly."""
    return src in CASTABLE and dest in CASTABLE


@dataclass(frozen=True)
class RecordedCopy:
    """One ``dest.copy_(view_of_source)`` observed during capture.

    ``dest_offset``, ``dest_shape`` and ``dest_stride`` are in *elements* of the
    destination parameter's storage, exactly as ``Tensor.storage_offset()``,
    ``.shape`` and ``.stride()`` reported them on the meta twin. ``casts`` are the
    dtypes the loader converted the view through before the ``copy_`` (``.to()``,
    ``.float()``...), in order; the install replays them, then the ``copy_``'s own
    conversion into ``dest_dtype``.
    """

    src_name: str
    op_chain: OpChain
    param_name: str
    dest_offset: int
    dest_shape: tuple[int, ...]
    dest_stride: tuple[int, ...]
    dest_dtype: torch.dtype
    casts: tuple[torch.dtype, ...] = ()


@dataclass(frozen=True)
class RecordedFill:
    """A constant write (``fill_``/``zero_``) a parameter's loader made into it.

    Needs no transfer (its value does not come from any source; vLLM's vocabulary
    embedding zeroes its padding rows this way) but counts as written when a
    receiver checks that a refit leaves no destination element unwritten. Geometry
    as in :class:`RecordedCopy`.
    """

    param_name: str
    dest_offset: int
    dest_shape: tuple[int, ...]
    dest_stride: tuple[int, ...]


@dataclass
class CaptureResult:
    """Everything a capture learned about a model's loaders.

    ``unsupported`` lists source names (in manifest order) whose loader path could
    not be recorded exactly; ``unsupported_reasons`` maps each to its cause.
    ``unattributed`` counts ``copy_`` sinks whose destination lies in memory that
    belongs to no parameter or persistent buffer, i.e. writes refitd cannot tie
    to a destination; ``unowned`` says what each was (source and destination).
    ``fills`` are the constant writes loaders made into a destination.
    """

    copies: list[RecordedCopy] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    unattributed: int = 0
    unsupported_reasons: dict[str, str] = field(default_factory=dict)
    fills: list[RecordedFill] = field(default_factory=list)
    unowned: list[str] = field(default_factory=list)


# A cause message ends with the source it was raised for (" on lazy 'name' ...");
# dropping that tail lets thousands of sources failing for one reason group as one.
_SOURCE_TAIL = re.compile(r"\s+on lazy\s+'.*$", re.DOTALL)


def _cause_of(reason: str) -> str:
    return _SOURCE_TAIL.sub("", reason).strip()


def summarize_unsupported(reasons: dict[str, str], limit: int | None = 5) -> list[tuple[str, int]]:
    """Group unsupported-source messages into ``(cause, count)``, most common first.

    Ties keep the order in which a cause was first seen. ``limit`` caps the number
    of causes returned; ``None`` returns all of them.
    """
    counts = Counter(_cause_of(reason) for reason in reasons.values())
    ordered = sorted(counts.items(), key=lambda item: -item[1])  # stable: first-seen ties
    return ordered if limit is None else ordered[:limit]
