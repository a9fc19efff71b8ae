"""Swap mode: one copy per refit, and still nothing installed when a pull fails.

The engine's host parameters live in one shared segment the daemon writes (see
:class:`~refitd.client.receiver.DaemonReceiver`). Swap mode keeps a second segment of
the same size and layout, the *shadow*, registered once and reused by every refit:

1. the pull lands in the shadow, once, where the parameters will read it;
2. only when every byte has arrived (the pull reports DONE: its lease held to the
   end, every descriptor copied), the parameters are rebound to the shadow's views
   (``p.data = view``: no byte is copied) and the two segments trade roles. A failed
   or refused pull leaves the parameters on the segment they were on, untouched, so
   the engine serves the previous version's bytes exactly.

What it costs: one more engine-sized segment of host memory (staging mode's scratch
image is the same size, so against staging nothing more), and the swap itself
(microseconds a parameter). Bytes of the engine the pull does not write (parameters
``allow_unwritten`` names, or written only through the install's scatter) are copied
from the serving segment into the shadow after the pull and before the swap, so they
carry over; on a plan that writes every byte there are none.

Rebinding ``p.data`` is what placing the parameters in shared memory already does
once; it is safe for anything that reads the parameter through its module (vLLM's
CPU kernels, and eager execution generally). A CUDA graph captures addresses, so GPU
parameters do not swap: there the receiver refits in staging mode.

Two refits at once on one engine would land in the one shadow, and the later swap
would rebind the parameters to a segment holding neither version whole while both
reported success; a receiver runs one refit at a time
(:class:`~refitd.client.onerefit.OneRefit`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from refitd.client.install import CompiledPull
from transports.batch import merge_ranges
from transports.segments import SharedSegment

__all__ = ["EngineViews", "unpulled", "unwritten_ranges"]


class EngineViews:
    """Each parameter's view into each of two segments of one layout (``offsets``:
    bytes from the segment's start), built once; :meth:`bind` points every parameter
    at one segment's views."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        offsets: dict[str, int],
        segments: tuple[SharedSegment, SharedSegment],
    ) -> None:
        self.params = params
        self.views: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = (
            _views(params, offsets, segments[0]),
            _views(params, offsets, segments[1]),
        )

    def bind(self, which: int) -> None:
        """Every parameter now reads segment ``which`` (0 or 1)."""
        for name, view in self.views[which].items():
            self.params[name].data = view


def _views(
    params: dict[str, torch.nn.Parameter], offsets: dict[str, int], seg: SharedSegment
) -> dict[str, torch.Tensor]:
    return {
        name: seg.torch(p.dtype, offsets[name], p.numel()).view(p.shape)
        for name, p in params.items()
        if p.numel()
    }


def unwritten_ranges(
    spans: Iterable[tuple[int, int]], written: Iterable[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The parts of ``spans`` (``(offset, nbytes)``: each parameter's bytes) that no
    range of ``written`` covers, as sorted ``(offset, nbytes)``: what swap mode
    carries over from the serving segment. Pure: offsets and sizes in bytes."""
    rows = np.array(list(written), dtype=np.int64).reshape(-1, 2)
    merged = [(r.offset, r.offset + r.nbytes) for r in merge_ranges(0 * rows[:, 0], *rows.T)]
    starts = np.array([lo for lo, _ in merged], dtype=np.int64)
    out: list[tuple[int, int]] = []
    for off, n in sorted(spans):
        at, end = off, off + n
        i = max(int(np.searchsorted(starts, at, side="right")) - 1, 0)
        while at < end and i < len(merged):
            lo, hi = merged[i]
            if hi <= at:
                i += 1
                continue
            if lo >= end:
                break
            if lo > at:
                out.append((at, lo - at))
            at = max(at, hi)
            i += 1
        if at < end:
            out.append((at, end - at))
    return out


def unpulled(
    comp: CompiledPull, params: dict[str, torch.nn.Parameter], offsets: dict[str, int]
) -> list[tuple[int, int]]:
    """The parameters' bytes (at byte ``offsets`` of the engine region) that ``comp``
    does not pull into the engine region: what a swap carries over."""
    rows = comp.rows[comp.rows[:, 2] == comp.engine_id]
    written = [(int(o), int(n)) for o, n in zip(rows[:, 3], rows[:, 4], strict=True)]
    written += [(p.dst_offset, p.nbytes) for p in comp.packs if p.dst_region == comp.engine_id]
    spans = [(off, params[n].numel() * params[n].element_size()) for n, off in offsets.items()]
    return unwritten_ranges(spans, written)
