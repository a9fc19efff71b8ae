"""Shared machinery of the two same-process transports (`reference`, `local`).

Both transports' peers live in this process: `advertise` publishes an in-process
token, and `connect` finds the peer transport by that token (and refuses a record
from another process). Addresses in a `AdvertisedRegion` are therefore addresses in this
process, and a read is a plain memory copy between two mappings.
"""

from __future__ import annotations

import os
import time
import weakref
from abc import abstractmethod
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from refitd.errors import NotFoundError, ProtocolError

from .batch import ReadBatch, as_read_batch, suspect_ranges, validate_batch
from .interface import (
    AdvertisedRegion,
    LocalRegion,
    MappedMemory,
    Peer,
    PeerInfo,
    PullFailed,
    Transport,
    TransportClosed,
)
from .memory import DeviceFault, copy_by_kind

# token -> live in-process transport; weak so a dropped transport disappears.
_LIVE: weakref.WeakValueDictionary[str, InProcessTransport] = weakref.WeakValueDictionary()


class InProcessPeer(Peer):
    def __init__(self, owner: InProcessTransport, info: PeerInfo) -> None:
        self.owner = owner
        self.info = info
        self._remote: dict[int, AdvertisedRegion] = {r.region_id: r for r in info.regions}
        self._closed = False

    async def update(self, info: PeerInfo) -> None:
        info.verify(self.owner.secret)
        if info.address != self.info.address:
            raise ProtocolError(
                f"update of peer {self.info.peer_id!r} refused: the record is for another peer"
            )
        self.info = info
        self._remote = {r.region_id: r for r in info.regions}

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        if self._closed or self.owner.closed:
            raise TransportClosed(f"get refused: connection to {self.info.peer_id!r} is closed")
        reads = as_read_batch(batch)
        local = self.owner.regions
        validate_batch(
            reads,
            {k: v.size for k, v in local.items()},
            {k: v.size for k, v in self._remote.items()},
        )
        # The source must still be the registration the record names: a region
        # re-registered since (new generation) or dropped is refused, not read.
        target = _LIVE.get(self.info.address.decode())
        if target is None or target.closed:
            raise TransportClosed(f"get refused: peer {self.info.peer_id!r} is gone")
        live = target.regions
        for rid in np.unique(reads["remote_region"]).tolist():
            rec, cur = self._remote[rid], live.get(rid)
            if cur is None or cur.info.generation != rec.generation:
                raise ProtocolError(
                    f"get refused: remote region {rid} generation {rec.generation} is no longer "
                    f"registered at {self.info.peer_id!r}; fetch a fresh record"
                )
        live_reads = reads[reads["nbytes"] > 0]
        if len(live_reads) == 0:
            return
        dst = np.array(
            [local[int(r)].segment.address for r in live_reads["local_region"].tolist()], np.int64
        )
        src = np.array(
            [self._remote[int(r)].address for r in live_reads["remote_region"].tolist()], np.int64
        )
        try:
            await copy_by_kind(
                dst + live_reads["local_offset"],
                src + live_reads["remote_offset"],
                live_reads["nbytes"].copy(),
                live_reads["local_region"],
                live_reads["remote_region"],
                {k: v.segment for k, v in local.items()},
                {k: v.segment for k, v in live.items()},
                self.owner.copy,
            )
        except DeviceFault as exc:
            raise PullFailed(
                f"read from {self.info.peer_id!r} failed in a device copy: {exc}",
                suspect_ranges(live_reads),
            ) from exc

    async def close(self) -> None:
        self._closed = True


class InProcessTransport(Transport):
    """A transport whose peers are other transports of this process."""

    def __init__(self, *, secret: bytes, peer_id: str = "") -> None:
        super().__init__(secret=secret, peer_id=peer_id)
        self._regions: dict[int, LocalRegion] = {}
        self._token = f"{os.getpid()}:{id(self):x}:{time.monotonic_ns()}"
        self.closed = True
        self._generation = time.time_ns()

    async def start(self) -> None:
        self.closed = False
        _LIVE[self._token] = self

    async def close(self) -> None:
        self.closed = True
        _LIVE.pop(self._token, None)
        self._regions.clear()

    async def register(self, region_id: int, segment: MappedMemory) -> LocalRegion:
        if self.closed:
            raise TransportClosed(
                f"registering region {region_id} refused: {self.scheme} transport is closed"
            )
        self._generation += 1
        info = AdvertisedRegion(
            region_id=region_id,
            generation=self._generation,
            address=segment.address,
            size=segment.size,
        )
        region = LocalRegion(region_id, segment, info)
        self._regions[region_id] = region
        return region

    async def deregister(self, region_id: int) -> None:
        region = self._regions.pop(region_id, None)
        if region is None:
            raise NotFoundError(f"deregistering region {region_id} refused: not registered")
        # A device driver's registration of host memory belongs to its mapping, not to
        # a region: it goes when the mapping is closed (transports.pins), off the loop.

    def registers(self, memory: MappedMemory) -> bool:
        """Every kind: reads in this process go through the memory's own engine
        (`transports.memory.copy_by_kind`)."""
        return True

    @property
    def regions(self) -> dict[int, LocalRegion]:
        return dict(self._regions)

    def advertise(self) -> PeerInfo:
        return PeerInfo(
            scheme=self.scheme,
            peer_id=self.peer_id,
            address=self._token.encode(),
            regions=tuple(r.info for r in self._regions.values()),
        ).signed(self.secret)

    def _check_record(self, info: PeerInfo) -> None:
        """Refuse a record this transport cannot connect with: the transport is
        closed, the MAC does not verify, or the record is of another scheme."""
        if self.closed:
            raise TransportClosed(f"connect refused: {self.scheme} transport is closed")
        info.verify(self.secret)
        if info.scheme != self.scheme:
            raise ProtocolError(
                f"connect refused: record is for scheme {info.scheme!r}, not {self.scheme!r}"
            )

    async def connect(self, info: PeerInfo) -> Peer:
        self._check_record(info)
        token = info.address.decode()
        if not token.startswith(f"{os.getpid()}:") or token not in _LIVE:
            raise ProtocolError(
                f"connect refused: {info.peer_id!r} is not a live transport of this process"
            )
        return InProcessPeer(self, info)

    @abstractmethod
    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (validated)."""
