"""Which destinations a capture leaves unwritten: a refit must write all of them.

A refit is complete when every element of every destination (each engine parameter,
and each persistent buffer the caller names) is the target of some recorded
``copy_``, or of a constant ``fill_``/``zero_`` its own loader made (vLLM zeroes
vocabulary padding rows so; the value is already in place and needs no transfer). A destination the engine's loaders never touch for the published
manifest would silently keep its old value, so receivers refuse such a plan before
any byte moves (:class:`~refitd.reshard.types.IncompleteRefit`) unless the caller
names it in ``allow_unwritten``.

Coverage is computed from the recorded destination geometry alone (offset, shape
and stride in elements of the destination's storage), as sorted element intervals:
no per-element mask, so a large model costs one interval per contiguous run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt
import torch

from refitd.reshard.types import (
    CaptureResult,
    IncompleteRefit,
    RecordedCopy,
    RecordedFill,
    UnsupportedReshard,
)

__all__ = ["destinations_of", "refuse_unwritten", "unwritten"]

IntArray = npt.NDArray[np.int64]
Layout = Mapping[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]

_RUN_LIMIT = 1 << 26
"""More element runs than this in one destination view is refused rather than
expanded (a pathological stride pattern, not a real loader)."""


def destinations_of(
    module: torch.nn.Module,
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """Every parameter and persistent buffer of ``module`` with its layout
    ``(shape, stride, dtype)``: what a checkpoint load writes, so a refit must too.

    Non-persistent buffers (computed at construction, such as rotary caches) are
    not loaded from checkpoints and are left out.
    """
    out = {n: (tuple(p.shape), tuple(p.stride()), p.dtype) for n, p in module.named_parameters()}
    for prefix, mod in module.named_modules():
        skip = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is None or name in skip:
                continue
            full = f"{prefix}.{name}" if prefix else name
            out.setdefault(full, (tuple(buf.shape), tuple(buf.stride()), buf.dtype))
    return out


def element_runs(
    offset: int, shape: Iterable[int], stride: Iterable[int]
) -> tuple[IntArray, IntArray]:
    """The elements of a strided view as ``(starts, lengths)`` of contiguous runs."""
    dims = [(int(n), int(s)) for n, s in zip(shape, stride, strict=True) if int(n) != 1]
    if any(n == 0 for n, _ in dims):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    dims.sort(key=lambda d: -abs(d[1]))
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    count = 1
    for n, _ in dims:
        count *= n
    if count > _RUN_LIMIT:
        raise UnsupportedReshard(
            f"a destination view of {count} separate runs is too fragmented to check"
        )
    starts = np.full(1, offset, dtype=np.int64)
    for n, s in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    return starts, np.full(starts.shape[0], run, dtype=np.int64)


def _merge(starts: IntArray, ends: IntArray) -> tuple[IntArray, IntArray]:
    """Union of half-open intervals, as disjoint sorted ``(starts, ends)``."""
    if starts.shape[0] == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(s.shape[0], dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], s.shape[0]) - 1
    return s[first], reach[last]


def _covered_before(x: IntArray, cs: IntArray, ce: IntArray) -> IntArray:
    """How many covered elements lie below each ``x`` (``cs``/``ce`` merged)."""
    if cs.shape[0] == 0:
        return np.zeros_like(x)
    prefix = np.concatenate([[0], np.cumsum(ce - cs)])
    i = np.searchsorted(cs, x, side="right")  # intervals starting at or below x
    inside = np.where(i > 0, np.minimum(x, ce[np.maximum(i - 1, 0)]) - cs[np.maximum(i - 1, 0)], 0)
    out: IntArray = prefix[np.maximum(i - 1, 0)] * (i > 0) + np.maximum(inside, 0)
    return out


def unwritten(capture: CaptureResult, layout: Layout) -> dict[str, tuple[int, int]]:
    """``{destination: (unwritten elements, total elements)}`` for every destination
    of ``layout`` that ``capture``'s copies do not write whole."""
    starts: dict[str, list[IntArray]] = {}
    ends: dict[str, list[IntArray]] = {}
    writes: list[RecordedCopy | RecordedFill] = [*capture.copies, *capture.fills]
    for c in writes:
        if c.param_name not in layout:
            continue
        s, n = element_runs(c.dest_offset, c.dest_shape, c.dest_stride)
        starts.setdefault(c.param_name, []).append(s)
        ends.setdefault(c.param_name, []).append(s + n)
    missing: dict[str, tuple[int, int]] = {}
    for name, (shape, stride, _) in layout.items():
        ts, tn = element_runs(0, shape, stride)
        ts, te = _merge(ts, ts + tn)
        total = int((te - ts).sum())
        if total == 0:
            continue
        if name in starts:
            cs, ce = _merge(np.concatenate(starts[name]), np.concatenate(ends[name]))
            got = int((_covered_before(te, cs, ce) - _covered_before(ts, cs, ce)).sum())
        else:
            got = 0
        if got < total:
            missing[name] = (total - got, total)
    return missing


def refuse_unwritten(
    capture: CaptureResult, layout: Layout, allow_unwritten: Iterable[str] = ()
) -> None:
    """Raise :class:`IncompleteRefit` naming every destination of ``layout`` that
    ``capture`` leaves (wholly or partly) unwritten, except ``allow_unwritten``."""
    allowed = set(allow_unwritten)
    missing = {n: m for n, m in unwritten(capture, layout).items() if n not in allowed}
    if not missing:
        return
    parts = [
        f"{name} ({'all' if left == total else f'{left} of'} {total} elements)"
        for name, (left, total) in missing.items()
    ]
    raise IncompleteRefit(
        f"refit refused before any transfer: the engine's loaders would leave "
        f"{len(missing)} destination(s) unwritten by the published manifest, keeping "
        f"their old values: {', '.join(parts)}. Publish them, or pass their names in "
        f"allow_unwritten= if they are meant to stay untouched",
        missing,
    )
