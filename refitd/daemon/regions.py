"""The daemon's records of regions and the bounds check every pull passes first.

Pure: a :class:`RegionTable` holds :class:`RegionInfo` records (no memory), and
:func:`validate_descriptors` checks a whole descriptor table against two tables
before any byte moves. Vectorised with numpy so 100k descriptors check in
milliseconds; the refusal names the *first* offending descriptor by index.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator, Mapping

import numpy as np

from refitd.daemon.schemas import DescriptorTable, PackSpec, RegionInfo
from refitd.errors import NotFoundError, ProtocolError

__all__ = ["RegionTable", "validate_descriptors", "validate_pack_specs"]

_I64_MAX = np.iinfo(np.int64).max


class RegionTable:
    """Region records by id. Ids are never reused within one daemon epoch."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._records: dict[str, RegionInfo] = {}
        self._seq = itertools.count(1)

    def new_id(self) -> str:
        return f"r{next(self._seq)}-{secrets.token_hex(4)}"

    def add(self, info: RegionInfo) -> RegionInfo:
        if info.region_id in self._records:
            raise ProtocolError(f"region id {info.region_id!r} is already recorded")
        self._records[info.region_id] = info
        return info

    def get(self, region_id: str) -> RegionInfo:
        info = self._records.get(region_id)
        if info is None:
            raise NotFoundError(f"region {region_id!r} is not recorded on this daemon")
        return info

    def remove(self, region_id: str) -> RegionInfo:
        info = self.get(region_id)
        del self._records[region_id]
        return info

    def sizes(self) -> dict[str, int]:
        return {k: v.nbytes for k, v in self._records.items()}

    def __iter__(self) -> Iterator[RegionInfo]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, region_id: object) -> bool:
        return region_id in self._records


def _sizes_of(names: list[str], sizes: Mapping[str, int], side: str) -> np.ndarray:
    out = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        size = sizes.get(name)
        if size is None:
            raise NotFoundError(f"{side} region {name!r} is not recorded")
        out[i] = size
    return out


def validate_descriptors(
    d: DescriptorTable, src_sizes: Mapping[str, int], dst_sizes: Mapping[str, int]
) -> np.ndarray:
    """Check every descriptor of ``d``; return its ``(n, 5)`` rows if all are in bounds.

    A descriptor is refused (:class:`ProtocolError` naming its index and values) when
    a region index is out of range, an offset or size is negative, ``offset + nbytes``
    overflows, or the byte range leaves its region. Zero-length reads inside a region
    (including at its very end) are allowed. Unknown region names are
    :class:`NotFoundError`. Nothing is read or written by this function.
    """
    rows = d.rows()
    if rows.shape[0] == 0:
        return rows
    src_size = _sizes_of(d.src_regions, src_sizes, "source")
    dst_size = _sizes_of(d.dst_regions, dst_sizes, "destination")
    si, so, di, do, nb = (rows[:, k] for k in range(5))
    bad = (si < 0) | (si >= len(src_size)) | (di < 0) | (di >= len(dst_size))
    bad |= (so < 0) | (do < 0) | (nb < 0)
    # Overflow guard: offsets and sizes are each < 2**63, compare without adding.
    ok_idx = ~bad
    s_lim = np.zeros_like(so)
    d_lim = np.zeros_like(do)
    s_lim[ok_idx] = src_size[si[ok_idx]]
    d_lim[ok_idx] = dst_size[di[ok_idx]]
    bad |= ok_idx & ((so > s_lim) | (nb > s_lim - so) | (do > d_lim) | (nb > d_lim - do))
    if bad.any():
        i = int(np.argmax(bad))
        r = [int(x) for x in rows[i]]
        sname = d.src_regions[r[0]] if 0 <= r[0] < len(d.src_regions) else f"#{r[0]}"
        dname = d.dst_regions[r[2]] if 0 <= r[2] < len(d.dst_regions) else f"#{r[2]}"
        raise ProtocolError(
            f"descriptor {i} refused: read {r[4]} bytes from {sname!r}+{r[1]} into "
            f"{dname!r}+{r[3]} leaves a region or has a negative field "
            f"(source {src_sizes.get(sname, '?')} bytes, destination "
            f"{dst_sizes.get(dname, '?')} bytes); nothing was transferred"
        )
    return rows


def validate_pack_specs(
    specs: list[PackSpec], src_sizes: Mapping[str, int], dst_sizes: Mapping[str, int]
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
