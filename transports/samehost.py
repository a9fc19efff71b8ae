"""The ``shm`` transport: reads from a peer on this host through its shared segments.

A peer process on the same host (the same kernel boot) registers whole shared
segments; its record names each one by segment name and file identity. Connecting
maps every listed segment here, by name, after checking that the name is the very
file the signed record states (``st_dev``, ``st_ino``, before and after mapping) and
that its size is exact; a read is then a memory copy between two mappings of this
process (the ``local`` transport's parallel C memcpy). No byte goes through the
peer process, and a peer that dies cannot take this one with it: the mappings stay
valid, the file is not reused while mapped.

Refused at ``connect`` (nothing mapped): a record from another kernel boot (another
host, so its names map other files), a name that is another file here (a separate
``/dev/shm``, e.g. another container), a size that differs.

``PeerInfo.address`` is ``<boot id>:<pid>`` of the serving process; each region's
``rkey`` is the msgpack of ``(segment name, st_dev, st_ino)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError, TransportError

from .core import (
    LocalRegion,
    PeerInfo,
    ReadBatch,
    RegionInfo,
    Segment,
    TransportClosed,
    as_read_batch,
    validate_batch,
)
from .inproc import InProcessPeer
from .local import LocalTransport
from .shm import SHM_DIR, SharedSegment

__all__ = ["SameHostPeer", "SameHostTransport", "boot_id", "file_id", "same_file"]

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This kernel's boot id ("" where the kernel does not expose it)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def file_id(name: str) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of segment ``name``: under one kernel boot it names exactly
    one file, so a record of it proves which memory a name maps."""
    st = os.stat(SHM_DIR / name)
    return st.st_dev, st.st_ino


def same_file(name: str, want: tuple[int, ...]) -> None:
    """Refuse (:class:`TransportError`) unless segment ``name`` here is the file
    ``(st_dev, st_ino)`` = ``want``."""
    try:
        got = file_id(name)
    except FileNotFoundError:
        raise TransportError(f"segment {name!r} does not exist on this host") from None
    if got != want:
        raise TransportError(
            f"segment {name!r} here is another file than the peer's (a separate /dev/shm)"
        )


class SameHostPeer(InProcessPeer):
    """A connection to a same-host peer: its segments mapped here."""

    def __init__(self, owner: SameHostTransport, info: PeerInfo) -> None:
        super().__init__(owner, info)
        self.host = owner
        self._maps: dict[int, SharedSegment] = {}
        self._map_all(info)

    def _map_all(self, info: PeerInfo) -> None:
        maps: dict[int, SharedSegment] = {}
        try:
            for r in info.regions:
                name, dev, ino = msgspec.msgpack.decode(r.rkey, type=tuple[str, int, int])
                same_file(name, (dev, ino))
                seg = SharedSegment.attach(name, r.size)
                maps[r.region_id] = seg
                same_file(name, (dev, ino))  # the name was not swapped while mapping
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            for seg in maps.values():
                seg.close()
            raise ProtocolError(f"peer record of {info.peer_id!r} refused: {exc}") from None
        except BaseException:
            for seg in maps.values():
                seg.close()
            raise
        old, self._maps = self._maps, maps
        for seg in old.values():
            seg.close()
        self._remote = {r.region_id: r for r in info.regions}

    async def update(self, info: PeerInfo) -> None:
        info.verify(self.owner.secret)
        if info.address != self.info.address:
            raise ProtocolError(
                f"update of peer {self.info.peer_id!r} refused: the record is for another peer"
            )
        self._map_all(info)
        self.info = info

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
        live = reads[reads["nbytes"] > 0]
        if len(live) == 0:
            return
        dst = np.array([local[int(r)].segment.address for r in live["local_region"].tolist()])
        src = np.array([self._maps[int(r)].address for r in live["remote_region"].tolist()])
        await self.host.copy(
            dst.astype(np.int64) + live["local_offset"],
            src.astype(np.int64) + live["remote_offset"],
            live["nbytes"].copy(),
        )

    async def close(self) -> None:
        await super().close()
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


class SameHostTransport(LocalTransport):
    scheme = "shm"

    async def register(self, region_id: int, segment: Segment) -> LocalRegion:
        region = await super().register(region_id, segment)
        dev, ino = file_id(segment.name)
        key = msgspec.msgpack.encode((segment.name, dev, ino))
        info = RegionInfo(region.info.region_id, region.info.epoch, 0, region.info.size, key)
        self._regions[region_id] = LocalRegion(region_id, segment, info)
        return self._regions[region_id]

    def advertise(self) -> PeerInfo:
        return PeerInfo(
            scheme=self.scheme,
            peer_id=self.peer_id,
            address=f"{boot_id()}:{os.getpid()}".encode(),
            regions=tuple(r.info for r in self._regions.values()),
        ).signed(self.secret)

    async def connect(self, info: PeerInfo) -> SameHostPeer:
        if self.closed:
            raise TransportClosed(f"connect refused: {self.scheme} transport is closed")
        info.verify(self.secret)
        if info.scheme != self.scheme:
            raise ProtocolError(
                f"connect refused: record is for scheme {info.scheme!r}, not {self.scheme!r}"
            )
        theirs = info.address.decode(errors="replace").partition(":")[0]
        mine = boot_id()
        if not mine or theirs != mine:
            raise TransportError(
                f"connect to {info.peer_id!r} refused: it runs under another kernel (boot id "
                "differs: another host), so its segment names are not this host's"
            )
        return SameHostPeer(self, info)
