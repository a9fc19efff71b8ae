"""Region records by id: :class:`RegionTable`, the daemon's list of the regions it holds.

The records only; the memory behind them, pins and reaping are the store's
(`refitd.daemon.state.store`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from refitd.errors import NotFoundError, ProtocolError
from refitd.wire import RegionInfo

__all__ = ["RegionTable"]


class RegionTable:
    """Region records by id. Ids are never reused within one daemon incarnation."""

    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation
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
