"""Where an expert pool's rows live: views into its two shared-memory regions.

Layouts (bytes), banks one after another so each bank's rows stay contiguous:

- host region: bank ``b`` at ``host_bank_offsets[b]``, then ``layers * experts``
  rows of ``row_bytes[b]``, row ``layer * experts + expert``;
- slot region: bank ``b`` at ``slot_bank_offsets[b]``, then ``slots`` rows of
  ``row_bytes[b]``.

:class:`RegionExpertRows` gives zero-copy views of the host rows,
:class:`RegionSlotMemory` is the slot device of :class:`refitd.experts.ExpertSlots`
(its copies are guarded memcpys: a region shrunk by its owner is an error, never a
fault of the daemon), and :func:`touched_rows` says which rows a write touches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refitd.experts import (
    SlotDevice,
)
from refitd.experts.inflight import CopyFence, HostCopier
from transports.local import copy_view

__all__ = ["RegionExpertRows", "RegionSlotMemory", "touched_rows"]


class RegionExpertRows:
    """Host expert rows inside one region (see the module's layout); zero-copy views."""

    def __init__(
        self, view: memoryview, experts: int, layers: int, row_bytes: Sequence[int]
    ) -> None:
        self._view = view
        self._experts, self._layers = experts, layers
        self._row_bytes = tuple(row_bytes)
        self.bank_offsets = _bank_offsets(row_bytes, layers * experts)

    def row(self, bank: int, layer: int, row: int) -> memoryview | None:
        if not (0 <= bank < len(self._row_bytes) and 0 <= layer < self._layers):
            return None
        if not 0 <= row < self._experts:
            return None
        w = self._row_bytes[bank]
        at = self.bank_offsets[bank] + (layer * self._experts + row) * w
        return self._view[at : at + w]


class RegionSlotMemory(SlotDevice):
    """Slot memory inside one shared-memory region: a host-memory device whose copies
    are memcpys, read back by whoever maps the region."""

    def __init__(self, view: memoryview, slots: int, row_bytes: Sequence[int]) -> None:
        self._view = view
        self._row_bytes = tuple(row_bytes)
        self.bank_offsets = _bank_offsets(row_bytes, slots)
        self._copier = HostCopier("refitd-pool-copier")

    def write_slots_async(
        self, writes: Sequence[tuple[int, int, bytes | bytearray | memoryview]]
    ) -> CopyFence:
        """Prefetch copies run on the pool's copier thread, in issue order."""
        batch = list(writes)

        def job() -> None:
            for bank, slot, src in batch:
                self.write_slot(bank, slot, src)

        return self._copier.submit(job)

    def close(self) -> None:
        """Stop the copier after the copies already issued (before the region goes)."""
        self._copier.close()

    def _at(self, bank: int, slot: int) -> int:
        return self.bank_offsets[bank] + slot * self._row_bytes[bank]

    def write_slot(self, bank: int, dst_slot: int, src: bytes | bytearray | memoryview) -> None:
        at = self._at(bank, dst_slot)
        # Guarded: a host-row or slot region shrunk by its owner is an error here.
        copy_view(self._view[at : at + self._row_bytes[bank]], src)

    def copy_slot(self, bank: int, dst_slot: int, src_slot: int) -> None:
        w = self._row_bytes[bank]
        dst, src = self._at(bank, dst_slot), self._at(bank, src_slot)
        copy_view(self._view[dst : dst + w], self._view[src : src + w])


def touched_rows(
    ranges: np.ndarray, bank_offsets: Sequence[int], row_bytes: Sequence[int], rows: int
) -> np.ndarray:
    """Sorted row indices (``layer * experts + expert``) whose bytes in any bank overlap
    a write of ``ranges``, ``(n, 2)`` rows of ``(byte offset, nbytes)``. Bank ``b``
    holds ``rows`` rows of ``row_bytes[b]`` from ``bank_offsets[b]``; zero-length
    writes touch nothing. Vectorised: one pass per bank, not per write."""
    lo = ranges[:, 0].astype(np.int64)
    hi = lo + ranges[:, 1].astype(np.int64)  # exclusive
    diff = np.zeros(rows + 1, dtype=np.int64)
    for base, w in zip(bank_offsets, row_bytes, strict=True):
        end = base + rows * w
        hit = (hi > base) & (lo < end) & (hi > lo)
        if not hit.any():
            continue
        first = (np.maximum(lo[hit], base) - base) // w
        last = (np.minimum(hi[hit], end) - 1 - base) // w
        np.add.at(diff, first, 1)
        np.add.at(diff, last + 1, -1)
    return np.flatnonzero(np.cumsum(diff[:rows]) > 0)


def _bank_offsets(row_bytes: Sequence[int], rows: int) -> list[int]:
    out, at = [], 0
    for w in row_bytes:
        out.append(at)
        at += w * rows
    return out
