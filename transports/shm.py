"""The ``shm`` transport: reads from a peer on this host through its shared segments.

A peer process on the same host (the same kernel boot) registers whole shared
segments; its record names each one by segment name and file identity. Connecting
maps every listed segment here, by name, after checking that the name is the very
file the signed record states (``st_dev``, ``st_ino``, before and after mapping) and
that its size is exact; a read is then a memory copy between two mappings of this
process (the ``local`` transport's parallel C memcpy). No byte goes through the
peer process, and a peer that dies cannot take this one with it: the mappings stay
valid, the file is not reused while mapped.

Refused at ``connect`` or ``update`` (nothing read; the peer keeps what it had):
a record from another kernel boot (another host, so its names map other files), a
name that is another file here (a separate ``/dev/shm``, e.g. another container), a
size that differs.

Mappings belong to the transport, not to a peer: each is keyed by the file it maps
(name, ``st_dev``, ``st_ino``, size), shared by every peer whose record names that
file, and kept after the last peer lets go of it, up to ``max_mappings`` unused
ones (least recently used unmapped first). A fresh mapping of a large segment costs
a page fault per 4 KiB on first touch, so a peer connected again for the next pull
reads through the mappings of the last one. A mapping a peer or a read in flight
holds is never unmapped.

``PeerInfo.address`` is ``<boot id>:<tag>`` (the tag tells peers of one host apart:
the life it was given, a daemon's incarnation, else the serving process's pid); each
region's ``key`` is a :class:`SegmentKey`: the msgpack of ``(segment name, st_dev,
st_ino)``, and in a lease's grant also the lease and the ``[start, end)`` byte ranges
of the region that lease may read. A source hands a reader the grant it makes
itself (:meth:`ShmTransport.grant`: the lease's regions, each limited to its ranges,
signed); the reader connects with it as given (:meth:`ShmTransport.check_grant`
checks it is the one for the pull's lease, and makes nothing), and its connection
refuses a read outside those ranges (``ReadRefused``) though the mapping is whole.
:meth:`ShmTransport.loopback` reads between this transport's own regions (a
daemon's pull from itself).
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError, RefitError, TransportError
from refitd.memory_kinds import MemoryKind

from .batch import (
    ReadBatch,
    ReadRefused,
    as_read_batch,
    spans_of,
    suspect_ranges,
    validate_batch,
    within_spans,
)
from .interface import (
    AdvertisedRegion,
    Capabilities,
    LeaseScope,
    LocalRegion,
    MappedMemory,
    Peer,
    PeerInfo,
    PullFailed,
    TransportClosed,
)
from .local import CopyFault, LocalTransport
from .memory import DeviceFault, copy_by_kind
from .segments import SharedSegment
from .shmkeys import SegmentKey, boot_id, check_grant, file_id, same_file, segment_key

__all__ = [
    "MAX_MAPPINGS",
    "SegmentKey",
    "ShmPeer",
    "ShmTransport",
    "boot_id",
    "file_id",
    "same_file",
    "segment_key",
]

MAX_MAPPINGS = 256
"""Peer segments kept mapped while no peer uses them (least recently used go first)."""

FileKey = tuple[str, int, int, int]
"""A mapping's identity: segment name, ``st_dev``, ``st_ino``, exact size in bytes."""


@dataclass
class _Mapping:
    segment: SharedSegment
    users: int = 0  # peers whose record names it, plus reads in flight from it


class ShmPeer(Peer):
    """A connection to a same-host peer: its listed segments, mapped here and held
    (never unmapped) until the peer closes or an update stops listing them. Under a
    lease's grant it reads only the byte ranges the grant gives each region, and takes
    updates of that lease only."""

    def __init__(self, owner: ShmTransport, info: PeerInfo) -> None:
        self.owner = owner
        self.info = info
        self._closed = False
        self._remote: dict[int, AdvertisedRegion] = {}
        self._held: dict[int, FileKey] = {}
        #: per region of a lease's grant, its readable spans (starts, ends: bytes)
        self._spans: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}
        #: the lease of the grant it reads under ("" for an advertisement)
        self.lease = ""
        self._accept(info)

    def _accept(self, info: PeerInfo) -> None:
        """Hold a verified mapping of every region ``info`` lists, then let go of the
        ones held before (an unchanged one is held twice a moment, so it stays).
        On any refusal nothing changes and the error names the region."""
        keys: dict[int, FileKey] = {}
        spans: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}
        leases: set[str] = set()
        try:
            for r in info.regions:
                seg = SegmentKey.of(r, f"peer record of {info.peer_id!r}")
                leases.add(seg.lease)
                if seg.extents is not None:
                    spans[r.region_id] = spans_of(seg.extents)
                key = (seg.name, seg.dev, seg.ino, r.size)
                try:
                    self.owner._hold(key)
                except (RefitError, OSError) as exc:
                    raise TransportError(
                        f"region {r.region_id} of {info.peer_id!r} does not map here: {exc}"
                    ) from None
                keys[r.region_id] = key
            if len(leases) > 1:
                raise ProtocolError(
                    f"peer record of {info.peer_id!r} refused: it names {len(leases)} leases; "
                    "one grant, one lease"
                )
            lease = leases.pop() if leases else self.lease  # no region: no lease said
            if self.lease and lease != self.lease:  # nor a whole-region advertisement
                raise ProtocolError(
                    f"update of peer {info.peer_id!r} refused: the grant is of lease {lease!r}, "
                    f"the connection reads under lease {self.lease!r}"
                )
        except BaseException:
            self.owner._let_go(keys.values())
            raise
        old, self._held = self._held, keys
        self._remote = {r.region_id: r for r in info.regions}
        self._spans, self.lease = spans, lease
        self.owner._let_go(old.values())

    async def update(self, info: PeerInfo) -> None:
        if self._closed or self.owner.closed:
            raise TransportClosed(f"update refused: connection to {self.info.peer_id!r} is closed")
        self.owner._check_record(info)
        if info.address != self.info.address:
            raise ProtocolError(
                f"update of peer {self.info.peer_id!r} refused: the record is for another peer"
            )
        self._accept(info)
        self.info = info

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        if self._closed or self.owner.closed:
            raise TransportClosed(f"get refused: connection to {self.info.peer_id!r} is closed")
        reads = as_read_batch(batch)
        validate_batch(
            reads, self.owner.local_sizes(), {k: v.size for k, v in self._remote.items()}
        )
        # An update may stop listing a region while this read is in flight: the read
        # holds its own mappings so none is unmapped under the copy.
        rids = [int(r) for r in np.unique(reads["remote_region"]).tolist()]
        self._check_spans(reads, rids)
        keys = [self._held[r] for r in rids]
        self.owner._hold_mapped(keys)
        try:
            mapped = {r: self.owner._mapped(k) for r, k in zip(rids, keys, strict=True)}
            await self.owner.copy_reads(reads, mapped)
        finally:
            self.owner._let_go(keys)

    def _check_spans(self, reads: ReadBatch, rids: list[int]) -> None:
        """Refuse the batch (:class:`ReadRefused`, naming the first read) unless every
        read of a region its grant limits lies in that region's granted ranges
        (:func:`~transports.batch.within_spans`, every read of a region at once). A
        read of no bytes (in bounds: checked before) reads nothing, and passes, as
        the daemon's own scope check lets it."""
        for rid in rids:
            spans = self._spans.get(rid)
            if spans is None:
                continue  # the whole region (an advertisement's)
            rows = np.flatnonzero(reads["remote_region"] == rid)
            nbytes = reads["nbytes"][rows]
            _, inside = within_spans(reads["remote_offset"][rows], nbytes, *spans)
            inside |= nbytes == 0
            if not inside.all():
                i = int(rows[np.flatnonzero(~inside)[0]])
                lr, lo, rr, ro, n = (int(v) for v in reads[i].tolist())
                raise ReadRefused(
                    i,
                    (lr, lo, rr, ro, n),
                    f"remote region {rr} bytes [{ro}, {ro + n}) are outside what lease "
                    f"{self.lease!r} was granted",
                    check="grant",
                )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        held, self._held = self._held, {}
        self.owner._let_go(held.values())


class _Loopback(Peer):
    """Reads between one transport's own registered regions (no mapping made)."""

    def __init__(self, owner: ShmTransport) -> None:
        self.owner = owner
        # Its regions are read as registered at each get, not from a record.
        self.info = PeerInfo(owner.scheme, owner.peer_id, b"loopback", ())
        self._closed = False

    async def update(self, info: PeerInfo) -> None:
        self.owner._check_record(info)
        self.info = info

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        if self._closed or self.owner.closed:
            raise TransportClosed("get refused: the loopback connection is closed")
        reads = as_read_batch(batch)
        # Validated against the regions registered now: one registered since the
        # connection was made (a staging region packed for this pull) is readable.
        sizes = self.owner.local_sizes()
        validate_batch(reads, sizes, sizes)
        regions = self.owner.regions
        memory = {
            int(rid): regions[int(rid)].segment
            for rid in np.unique(reads["remote_region"]).tolist()
        }
        await self.owner.copy_reads(reads, memory)

    async def close(self) -> None:
        self._closed = True


class ShmTransport(LocalTransport):
    """``boot_id`` empty means this kernel's (another value: tests of a peer that
    claims another host); ``incarnation`` names this life of the source in its
    address (default: the process's pid); ``max_mappings`` bounds the unused peer
    mappings kept; the other options are :class:`~transports.local.LocalTransport`'s
    (its copy engine)."""

    scheme = "shm"
    #: A reader maps the peer's segments, so it gathers strided blocks itself, and its
    #: connection (its mappings) is its own. A batch is one parallel memcpy that cuts
    #: its bytes into per-thread shares itself, so reads are not cut (on the test host
    #: a 1 GiB read cut into 32 MiB pieces moved at about 70% of the speed of the whole
    #: read) and batches are large: each costs a validation and two thread hand-offs,
    #: which on a busy host wait for a core.
    capabilities = Capabilities(
        reads_strided=True, shares_connections=False, piece=1 << 62, batch_reads=8192
    )

    def __init__(
        self,
        *,
        boot_id: str = "",
        incarnation: int | None = None,
        max_mappings: int = MAX_MAPPINGS,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.boot_id = boot_id
        self.incarnation = os.getpid() if incarnation is None else incarnation
        self.max_mappings = max_mappings
        #: every peer mapping, least recently used first
        self._maps: collections.OrderedDict[FileKey, _Mapping] = collections.OrderedDict()
        #: peer segments mapped since start (a mapping reused is not counted again)
        self.maps_made = 0

    # ------------------------------------------------------------ records

    async def register(self, region_id: int, segment: MappedMemory) -> LocalRegion:
        region = await super().register(region_id, segment)
        key = b""  # a name already unlinked, or device memory: never advertised here
        if segment.kind == MemoryKind.HOST:
            with contextlib.suppress(OSError):
                key = segment_key(segment.name, *file_id(segment.name))
        info = AdvertisedRegion(
            region.info.region_id, region.info.generation, 0, region.info.size, key
        )
        self._regions[region_id] = LocalRegion(region_id, segment, info)
        return self._regions[region_id]

    def advertise(self) -> PeerInfo:
        """This transport's signed record: every region with a segment name here, each
        whole (what a lease may read of them is its grant's, :meth:`grant`)."""
        return self._record(r.info for r in self._regions.values() if r.info.key)

    def _record(self, regions: Iterable[AdvertisedRegion]) -> PeerInfo:
        return PeerInfo(
            scheme=self.scheme,
            peer_id=self.peer_id,
            address=f"{self.boot_id or boot_id()}:{self.incarnation}".encode(),
            regions=tuple(regions),
        ).signed(self.secret)

    def grant(self, scope: LeaseScope) -> PeerInfo:
        """The lease's grant, made by this source and signed by it: the regions of
        ``scope`` with a segment here (host memory whose name is not gone: there is
        no same-host path to another), in id order, each keyed to the lease and
        limited to its ``[start, end)`` byte ranges (a :class:`SegmentKey`). A reader
        presents it as given; its connection maps each segment whole, and reads
        nothing outside those ranges (:class:`ShmPeer`)."""
        regions = []
        for rid in sorted(scope.ranges):
            region = self._regions.get(rid)
            if region is None or not region.info.key:
                continue
            seg = SegmentKey.decode(region.info.key)
            extents = [(int(a), int(b)) for a, b in scope.ranges[rid]]
            key = seg._replace(lease=scope.lease_id, extents=extents).encode()
            regions.append(msgspec.structs.replace(region.info, key=key))
        return self._record(regions)

    def check_grant(self, grant: PeerInfo, scope: LeaseScope) -> None:
        """Refuse ``grant`` unless it is a source's same-host grant for ``scope``'s
        lease naming every region of ``scope`` (:func:`transports.shmkeys.check_grant`):
        a reader connects with it as given; this checks it, and makes nothing."""
        check_grant(grant, scope, self.secret, self.scheme)

    async def connect(self, info: PeerInfo) -> ShmPeer:
        self._check_record(info)
        theirs = info.address.decode(errors="replace").partition(":")[0]
        mine = self.boot_id or boot_id()
        if not mine or theirs != mine:
            raise TransportError(
                f"connect to {info.peer_id!r} refused: it runs under another kernel (boot id "
                "differs: another host), so its segment names are not this host's"
            )
        return ShmPeer(self, info)

    def loopback(self) -> Peer:
        """A connection reading this transport's own regions into its own regions."""
        if self.closed:
            raise TransportClosed(f"loopback refused: {self.scheme} transport is closed")
        return _Loopback(self)

    async def close(self) -> None:
        await super().close()
        maps, self._maps = self._maps, collections.OrderedDict()
        for m in maps.values():
            m.segment.close()

    # ------------------------------------------------------------ mappings

    @property
    def mapped(self) -> int:
        """Peer segments mapped now (held or kept for reuse)."""
        return len(self._maps)

    def _hold(self, key: FileKey) -> None:
        """Hold the mapping of ``key``, mapping it first (checked to be that very file,
        before and after, at exactly that size) unless it is mapped already."""
        m = self._maps.pop(key, None)
        if m is None:
            name, dev, ino, size = key
            same_file(name, (dev, ino))
            seg = SharedSegment.attach(name, size)
            try:
                same_file(name, (dev, ino))  # the name was not swapped while mapping
            except BaseException:
                seg.close()
                raise
            m = _Mapping(seg)
            self.maps_made += 1
        m.users += 1
        self._maps[key] = m  # most recently used last

    def _mapped(self, key: FileKey) -> SharedSegment:
        return self._maps[key].segment

    def _hold_mapped(self, keys: Iterable[FileKey]) -> None:
        for key in keys:
            self._maps[key].users += 1

    def _let_go(self, keys: Iterable[FileKey]) -> None:
        """Drop one hold of each key; unmap unused mappings past ``max_mappings``."""
        for key in keys:
            m = self._maps.get(key)
            if m is not None:
                m.users -= 1
        unused = [k for k, m in self._maps.items() if m.users <= 0]
        for key in unused[: max(0, len(unused) - self.max_mappings)]:
            self._maps.pop(key).segment.close()

    # ------------------------------------------------------------ copying

    async def copy_reads(self, reads: ReadBatch, src_memory: Mapping[int, MappedMemory]) -> None:
        """Copy validated ``reads`` into this transport's regions from the remote
        regions whose memory (mapped or opened here) ``src_memory`` gives, each read
        through what its two kinds of memory support (`transports.memory`)."""
        live = reads[reads["nbytes"] > 0]
        if len(live) == 0:
            return
        dst_memory = {k: r.segment for k, r in self.regions.items()}
        dst = _addresses(live["local_region"], {k: m.address for k, m in dst_memory.items()})
        src = _addresses(live["remote_region"], {k: m.address for k, m in src_memory.items()})
        dst_at = dst + live["local_offset"]
        try:
            await copy_by_kind(
                dst_at,
                src + live["remote_offset"],
                live["nbytes"].copy(),
                live["local_region"],
                live["remote_region"],
                dst_memory,
                src_memory,
                self.copy,
            )
        except DeviceFault as exc:
            # A device's copy failed (a CUDA error): this batch fails, every one of
            # its destination ranges suspect; the process and other pulls go on.
            raise PullFailed(f"read stopped by a device copy: {exc}", suspect_ranges(live)) from exc
        except CopyFault as exc:
            # A segment was shrunk under its mapping (its owner may do that at any
            # time): this batch fails, its destination ranges suspect; nothing else.
            k = int(np.flatnonzero((dst_at <= exc.dst) & (exc.dst < dst_at + live["nbytes"]))[0])
            row = live[k]
            region = (
                f"destination region {int(row['local_region'])}"
                if exc.side == "destination"
                else f"source region {int(row['remote_region'])}"
            )
            raise PullFailed(
                f"read stopped: {region} faulted under the copy (its segment was shrunk, "
                "or its filesystem is full)",
                suspect_ranges(live),
            ) from exc


def _addresses(ids: npt.NDArray[np.int64], bases: dict[int, int]) -> npt.NDArray[np.int64]:
    """Base address per region id of ``ids`` (every id is in ``bases``), vectorised."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    table = np.array([bases[int(i)] for i in uniq.tolist()], dtype=np.int64)
    return table[inverse.reshape(-1)]
