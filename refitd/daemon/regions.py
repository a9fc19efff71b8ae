"""The daemon's records of regions and the bounds check every pull passes first.

Pure: a :class:`RegionTable` holds :class:`RegionInfo` records (no memory), and
:func:`validate_descriptors` checks a whole descriptor table against two tables
before any byte moves. Vectorised with numpy so 100k descriptors check in
milliseconds; the refusal names the *first* offending descriptor by index.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import numpy as np

from refitd.errors import NotFoundError, ProtocolError
from refitd.wire import DescriptorTable, PackSpec, RegionInfo
from transports.core import ReadRefused, rows_as_batch, validate_batch

__all__ = [
    "RegionTable",
    "refuse_overlapping_writes",
    "validate_descriptors",
    "validate_pack_specs",
]


class RegionTable:
    """Region records by id. Ids are never reused within one daemon epoch."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._records: dict[int, RegionInfo] = {}
        self._seq = itertools.count(1)

    def new_id(self) -> int:
        return next(self._seq)

    def add(self, info: RegionInfo) -> RegionInfo:
        if info.region_id in self._records:
            raise ProtocolError(f"region id {info.region_id!r} is already recorded")
        self._records[info.region_id] = info
        return info

    def get(self, region_id: int) -> RegionInfo:
        info = self._records.get(region_id)
        if info is None:
            raise NotFoundError(f"region {region_id!r} is not recorded on this daemon")
        return info

    def remove(self, region_id: int) -> RegionInfo:
        info = self.get(region_id)
        del self._records[region_id]
        return info

    def sizes(self) -> dict[int, int]:
        return {k: v.nbytes for k, v in self._records.items()}

    def __iter__(self) -> Iterator[RegionInfo]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, region_id: object) -> bool:
        return region_id in self._records


#: the daemon's words for each check of :func:`transports.core.validate_batch`
_WHY = {
    "remote_unknown": "its source region is not recorded",
    "local_unknown": "its destination region is not recorded",
    "negative": "it has a negative offset or size",
    "remote_range": "its source range ends past the source region",
    "local_range": "its destination range ends past the destination region",
    "overlap": "its destination range overlaps another descriptor's",
}


def validate_descriptors(
    d: DescriptorTable, src_sizes: Mapping[int, int], dst_sizes: Mapping[int, int]
) -> np.ndarray:
    """Check every descriptor of ``d``; return its ``(n, 5)`` rows if all are in bounds.

    ``src_sizes``/``dst_sizes`` map region id to size in bytes, from the daemons' own
    records. The checks are the data plane's own (:func:`transports.core.validate_batch`,
    on the descriptors as reads into this daemon): a descriptor is refused
    (:class:`ProtocolError` naming its index and values) when a region is not
    recorded, an offset or size is negative, the byte range leaves its region
    (checked as ``offset <= size - nbytes`` so nothing overflows), or its destination
    overlaps another's. Zero-length reads inside a region, including at its very
    end, pass. Nothing is read or written by this function.
    """
    rows = d.rows()
    if rows.shape[0] == 0:
        return rows
    try:
        validate_batch(rows_as_batch(rows), dict(dst_sizes), dict(src_sizes))
    except ReadRefused as exc:
        i = exc.index
        r = [int(x) for x in rows[i]]
        why = _WHY.get(exc.check, exc.why)
        raise ProtocolError(
            f"descriptor {i} refused: read {r[4]} bytes from region {r[0]}+{r[1]} "
            f"(of {src_sizes.get(r[0], '?')} bytes) into region {r[2]}+{r[3]} "
            f"(of {dst_sizes.get(r[2], '?')} bytes): {why}; nothing was transferred"
        ) from None
    return rows


def validate_pack_specs(
    specs: list[PackSpec], src_sizes: Mapping[int, int], dst_sizes: Mapping[int, int]
) -> None:
    """Check each pack spec's strided footprint lies in its source region and its packed
    bytes in its destination region; refuse the first that does not."""
    for i, p in enumerate(specs):
        where = (
            f"pack spec {i} ({p.src_region!r}+{p.src_offset} -> {p.dst_region!r}+{p.dst_offset})"
        )
        ssize = src_sizes.get(p.src_region)
        dsize = dst_sizes.get(p.dst_region)
        if ssize is None:
            raise NotFoundError(f"{where}: source region {p.src_region!r} is not recorded")
        if dsize is None:
            raise NotFoundError(f"{where}: destination region {p.dst_region!r} is not recorded")
        if len(p.shape) != len(p.strides) or any(s < 0 for s in p.shape):
            raise ProtocolError(f"{where}: shape {p.shape} and strides {p.strides} disagree")
        if p.nbytes == 0:
            continue
        lo = p.src_offset + p.itemsize * sum(
            st * (n - 1) for st, n in zip(p.strides, p.shape, strict=True) if st < 0
        )
        hi = p.src_offset + p.itemsize * (
            1 + sum(st * (n - 1) for st, n in zip(p.strides, p.shape, strict=True) if st > 0)
        )
        if lo < 0 or hi > ssize:
            raise ProtocolError(
                f"{where} refused: its elements span bytes [{lo}, {hi}) outside the "
                f"{ssize}-byte source region; nothing was transferred"
            )
        if p.dst_offset + p.nbytes > dsize:
            raise ProtocolError(
                f"{where} refused: {p.nbytes} packed bytes overrun the {dsize}-byte "
                "destination region; nothing was transferred"
            )


def refuse_overlapping_writes(rows: np.ndarray, specs: list[PackSpec]) -> None:
    """Refuse a plan that writes any destination byte twice (:class:`ProtocolError`
    naming both writes): the copies run concurrently, so which one lands would be up
    to chance. Call after the bounds checks (``offset + nbytes`` cannot overflow
    then). Zero-length writes overlap nothing. Descriptor ``i`` is named by its
    index, pack spec ``j`` as ``pack spec j``."""
    regions = [rows[:, 2], np.array([p.dst_region for p in specs], dtype=np.int64)]
    starts = [rows[:, 3], np.array([p.dst_offset for p in specs], dtype=np.int64)]
    sizes = [rows[:, 4], np.array([p.nbytes for p in specs], dtype=np.int64)]
    region, start, size = (np.concatenate(x) for x in (regions, starts, sizes))
    names = np.arange(len(region))
    keep = size > 0
    region, start, size, names = region[keep], start[keep], size[keep], names[keep]
    order = np.lexsort((start, region))
    region, start, end, names = region[order], start[order], (start + size)[order], names[order]
    # Sorted by (region, start): if any two writes overlap, some adjacent pair does.
    hits = np.flatnonzero((region[1:] == region[:-1]) & (start[1:] < end[:-1]))
    if len(hits):
        i = int(hits[0])

        def what(k: int) -> str:
            n = int(names[k])
            return f"descriptor {n}" if n < len(rows) else f"pack spec {n - len(rows)}"

        raise ProtocolError(
            f"{what(i)} and {what(i + 1)} refused: their destination ranges overlap in "
            f"region {int(region[i])} at byte {int(start[i + 1])}; a plan writes each "
            "destination byte once; nothing was transferred"
        )
