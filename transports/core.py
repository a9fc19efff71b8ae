"""The data-plane interface: regions, peers, batched one-sided reads, a registry.

A *transport* moves bytes from a peer's registered memory into this process's
registered memory with one-sided reads (the peer's control logic takes no part).

    Transport                   one per daemon; an async context manager
    ├── register(id, segment)   -> LocalRegion: registered once, whole allocation
    ├── advertise()             -> PeerInfo: signed record a peer connects with
    └── connect(PeerInfo)       -> Peer: an async context manager
                                   └── await get(batch)  # region-relative reads

A *read* is ``(local_region, local_offset, remote_region, remote_offset, nbytes)``;
offsets and sizes are in bytes, relative to the start of the region. A batch is a
numpy structured array of ``READ_DTYPE`` (so a daemon passes 100k reads without a
Python object per read) or any sequence of 5-tuples. Every read of a batch is checked
against both regions' records before the first byte moves (`validate_batch`); a
refused batch reads nothing.

Peer records are authenticated: `PeerInfo` carries an HMAC-SHA256 over every field
(worker address, region ids, epochs, addresses, sizes, packed keys) made with the
secret the transports of one deployment share. A record whose MAC does not verify is
refused before any key is unpacked.

Errors (all from `refitd.errors`)::

    TransportError
    ├── TransportClosed         the transport or peer was closed; nothing was read
    └── PullFailed              a batch failed mid-flight; `.suspect` lists the
        └── PeerLost            destination byte ranges that may hold partial data
    ProtocolError
    ├── ReadRefused             a read failed validation; `.index` names it
    └── UnauthenticatedPeer     a peer record's MAC does not verify
    NotFoundError
    └── UnknownScheme           no transport registered under a scheme

Implementations: ``reference`` (ctypes memmove, the oracle), ``local`` (same-process
copy in a thread pool), ``shm`` (a same-host peer's segments, mapped here), ``ucx``
(UCX one-sided GET from a supervised child process), ``tcp`` (refitd's own lanes of
plain TCP, for hosts without RDMA).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import itertools
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self, cast

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import NotFoundError, ProtocolError, TransportError

__all__ = [
    "READ_DTYPE",
    "ByteRange",
    "LocalRegion",
    "Peer",
    "PeerInfo",
    "PeerLost",
    "PullFailed",
    "ReadRefused",
    "RegionInfo",
    "Segment",
    "Transport",
    "TransportClosed",
    "UnauthenticatedPeer",
    "UnknownScheme",
    "as_read_batch",
    "batch_as_rows",
    "coalesce",
    "create_transport",
    "register_transport",
    "rows_as_batch",
    "schemes",
    "split_pieces",
    "split_shares",
    "suspect_ranges",
    "transport_class",
    "validate_batch",
]

#: One read per row. All fields are little-endian int64; offsets and nbytes in bytes.
READ_DTYPE = np.dtype(
    [
        ("local_region", "<i8"),
        ("local_offset", "<i8"),
        ("remote_region", "<i8"),
        ("remote_offset", "<i8"),
        ("nbytes", "<i8"),
    ]
)

ReadBatch = npt.NDArray[np.void]


# ---------------------------------------------------------------------------- errors


class TransportClosed(TransportError):
    """The transport or the peer connection is closed; the batch was not started."""


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes at ``offset`` (bytes) in local region ``region``."""

    region: int
    offset: int
    nbytes: int


class PullFailed(TransportError):
    """A batch failed after bytes may have moved.

    ``suspect`` lists the destination ranges (coalesced) whose content is now
    undefined: the caller must not use them until a later pull rewrites them.
    """

    def __init__(self, message: str, suspect: Sequence[ByteRange]) -> None:
        shown = ", ".join(
            f"region {r.region} [{r.offset}, {r.offset + r.nbytes})" for r in suspect[:8]
        )
        more = f" and {len(suspect) - 8} more" if len(suspect) > 8 else ""
        super().__init__(f"{message}; suspect destination bytes: {shown or 'none'}{more}")
        self.suspect: tuple[ByteRange, ...] = tuple(suspect)


class PeerLost(PullFailed):
    """The peer (or our own data-plane process) died while the batch was in flight."""


class ReadRefused(ProtocolError):
    """Read ``index`` of a batch failed validation; no read of the batch was posted."""

    def __init__(
        self,
        index: int,
        read: tuple[int, int, int, int, int],
        why: str,
        check: str = "",
        other: int | None = None,
    ) -> None:
        lr, lo, rr, ro, n = read
        super().__init__(
            f"read #{index} (local region {lr} @ {lo}, remote region {rr} @ {ro}, "
            f"{n} bytes) refused: {why}; nothing in the batch was read"
        )
        self.index = index
        self.read = read
        self.why = why
        #: which check refused it (see :func:`validate_batch`), "" when not said
        self.check = check
        #: for an overlap, the index of the earlier read it collides with
        self.other = other


class UnauthenticatedPeer(ProtocolError):
    """A peer record's MAC did not verify under our secret; no key was unpacked."""


class UnknownScheme(NotFoundError):
    """No transport is registered under the requested scheme."""


# ---------------------------------------------------------------------------- records


class RegionInfo(msgspec.Struct, frozen=True):
    """What a peer needs to read a region: the owner's address space, not ours.

    ``address`` is the region's base address in the process that serves it (the
    data-plane process for UCX); ``size`` is exact, in bytes; ``epoch`` changes every
    time the region is (re-)registered, so a stale record is detectable; ``rkey`` is
    the transport's packed remote key (empty where none is needed).
    """

    region_id: int
    epoch: int
    address: int
    size: int
    rkey: bytes = b""


class PeerInfo(msgspec.Struct, frozen=True):
    """A transport's advertisement, signed by `advertise` with the shared secret.

    ``address`` is scheme-specific (a UCX worker address; an in-process token).
    """

    scheme: str
    peer_id: str
    address: bytes
    regions: tuple[RegionInfo, ...]
    mac: bytes = b""

    def signing_bytes(self) -> bytes:
        """Canonical bytes covered by the MAC: every field but the MAC itself."""
        parts = [self.scheme.encode(), self.peer_id.encode(), self.address]
        for r in self.regions:
            parts.append(struct.pack("<qQQQ", r.region_id, r.epoch, r.address, r.size))
            parts.append(r.rkey)
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def signed(self, secret: bytes) -> PeerInfo:
        mac = hmac.new(secret, self.signing_bytes(), hashlib.sha256).digest()
        return msgspec.structs.replace(self, mac=mac)

    def verify(self, secret: bytes) -> None:
        """Raise `UnauthenticatedPeer` unless the MAC matches under ``secret``."""
        want = hmac.new(secret, self.signing_bytes(), hashlib.sha256).digest()
        if not hmac.compare_digest(want, self.mac):
            raise UnauthenticatedPeer(
                f"peer record of {self.peer_id!r} ({self.scheme}) refused: its MAC does not "
                "verify under our secret (tampered, or signed by a daemon outside this "
                "deployment)"
            )

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo:
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"peer record refused: malformed ({exc})") from exc


class Segment(Protocol):
    """Memory a transport can register: `transports.shm.SharedSegment` fits.

    ``name`` lets a separate data-plane process map the same memory; ``address`` is
    the base address in *this* process; ``size`` is in bytes.
    """

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def address(self) -> int: ...


@dataclass(frozen=True)
class LocalRegion:
    """A registered region of ours. ``info`` is what `advertise` publishes for it."""

    region_id: int
    segment: Segment = field(repr=False)
    info: RegionInfo

    @property
    def size(self) -> int:
        return self.segment.size

    @property
    def epoch(self) -> int:
        return self.info.epoch


# ---------------------------------------------------------------------------- batches


def as_read_batch(batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> ReadBatch:
    """Return ``batch`` as a 1-D ``READ_DTYPE`` array, without copying when it is one.

    Accepts a ``READ_DTYPE`` array, an int64 array of shape (n, 5) in read order, or
    an iterable of 5-tuples.
    """
    if isinstance(batch, np.ndarray):
        if batch.dtype == READ_DTYPE:
            return cast(ReadBatch, batch.reshape(-1))
        if batch.dtype.fields is None and batch.ndim == 2 and batch.shape[1] == 5:
            arr = np.ascontiguousarray(batch, dtype="<i8")
            return cast(ReadBatch, arr.view(READ_DTYPE).reshape(-1))
        raise ProtocolError(
            f"batch refused: an array of dtype {batch.dtype} and shape {batch.shape} is neither "
            "READ_DTYPE nor int64 of shape (n, 5)"
        )
    rows = [tuple(int(v) for v in r) for r in batch]
    for i, r in enumerate(rows):
        if len(r) != 5:
            raise ProtocolError(f"batch refused: read #{i} has {len(r)} fields, expected 5")
    return np.array(rows, dtype=READ_DTYPE).reshape(-1)


def _sizes_of(
    ids: npt.NDArray[np.int64], table: dict[int, int]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Sizes for region ``ids`` from ``table`` (id -> size), and a mask of known ids."""
    if not table:
        return np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
    keys = np.array(sorted(table), dtype=np.int64)
    sizes = np.array([table[int(k)] for k in keys], dtype=np.int64)
    pos = np.clip(np.searchsorted(keys, ids), 0, len(keys) - 1)
    known = keys[pos] == ids
    return np.where(known, sizes[pos], 0), known


def validate_batch(
    batch: ReadBatch,
    local_sizes: dict[int, int],
    remote_sizes: dict[int, int],
    remote_nbytes: npt.NDArray[np.int64] | None = None,
) -> None:
    """Refuse the whole batch, naming the first bad read, unless every read is in bounds.

    A read is in bounds when both region ids are registered (the table maps region
    id -> size in bytes), ``offset >= 0``, ``nbytes >= 0`` and ``offset + nbytes <=
    size`` on both sides (checked as ``offset <= size - nbytes`` so no sum can
    overflow). A zero-byte read is allowed anywhere in ``[0, size]``. Destination
    ranges of one batch must not overlap: overlapping writes would race.

    ``remote_nbytes`` (one length per read, bytes), when given, is the length of the
    source range each read spans where it differs from what it writes (a strided
    gather reads a footprint wider than the bytes it packs).
    """
    if len(batch) == 0:
        return
    lr, lo = batch["local_region"], batch["local_offset"]
    rr, ro, n = batch["remote_region"], batch["remote_offset"], batch["nbytes"]
    rn = n if remote_nbytes is None else remote_nbytes
    lsize, lknown = _sizes_of(lr, local_sizes)
    rsize, rknown = _sizes_of(rr, remote_sizes)
    checks: list[tuple[str, npt.NDArray[np.bool_], Callable[[int], str]]] = [
        (
            "remote_unknown",
            ~rknown,
            lambda i: f"remote region {int(rr[i])} is not in the peer's authenticated record",
        ),
        (
            "local_unknown",
            ~lknown,
            lambda i: f"local region {int(lr[i])} is not registered with this transport",
        ),
        ("negative", n < 0, lambda i: "negative length"),
        ("negative", rn < 0, lambda i: "negative source length"),
        ("negative", lo < 0, lambda i: "negative local offset"),
        ("negative", ro < 0, lambda i: "negative remote offset"),
        (
            "remote_range",
            ro > rsize - rn,
            lambda i: f"remote range ends past the region's {int(rsize[i])} bytes",
        ),
        (
            "local_range",
            lo > lsize - n,
            lambda i: f"local range ends past the region's {int(lsize[i])} bytes",
        ),
    ]
    for check, bad, why in checks:
        hits = np.flatnonzero(bad)
        if len(hits):
            i = int(hits[0])
            raise ReadRefused(i, tuple(int(v) for v in batch[i].tolist()), why(i), check)  # type: ignore[arg-type]
    nz = np.flatnonzero(n > 0)
    if len(nz) > 1:
        order = nz[np.lexsort((lo[nz], lr[nz]))]
        same = lr[order[1:]] == lr[order[:-1]]
        overlap = same & (lo[order[1:]] < lo[order[:-1]] + n[order[:-1]])
        hits = np.flatnonzero(overlap)
        if len(hits):
            a, b = int(order[hits[0]]), int(order[hits[0] + 1])
            i = max(a, b)
            raise ReadRefused(
                i,
                tuple(int(v) for v in batch[i].tolist()),  # type: ignore[arg-type]
                f"its destination overlaps read #{min(a, b)}'s; overlapping writes would race",
                "overlap",
                min(a, b),
            )


def coalesce(batch: ReadBatch) -> ReadBatch:
    """Drop zero-byte reads and merge reads contiguous on both sides into one.

    Reads are sorted by destination first (a validated batch has no overlapping
    destinations, so order does not change the result). A contiguous layout of n
    pieces becomes one read; a shuffled one stays n reads.
    """
    live = batch[batch["nbytes"] > 0]
    if len(live) < 2:
        return live.copy()
    live = live[np.lexsort((live["local_offset"], live["local_region"]))]
    lr, lo, rr, ro, n = (live[f] for f in READ_DTYPE.names or ())
    joins = (
        (lr[1:] == lr[:-1])
        & (rr[1:] == rr[:-1])
        & (lo[1:] == lo[:-1] + n[:-1])
        & (ro[1:] == ro[:-1] + n[:-1])
    )
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    out: ReadBatch = live[starts].copy()  # typed here: numpy < 2.4 stubs say Any
    out["nbytes"] = np.add.reduceat(n, starts)
    return out


def split_shares(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    shares: int,
    tag: npt.NDArray[np.int64] | None = None,
) -> list[
    tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
    ]
]:
    """Cut copies (``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``) into
    ``shares`` groups of about equal bytes, splitting a copy where a cut falls in it.

    Returns ``(dst, src, nbytes, tag)`` per non-empty share; ``tag`` (one int per
    copy, e.g. a region index) follows its copy's pieces. Order within a share is kept.
    """
    tag = np.zeros(len(nbytes), np.int64) if tag is None else tag
    total = int(nbytes.sum())
    if shares <= 1 or total == 0:
        return [(dst, src, nbytes, tag)]
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    cuts = [total * k // shares for k in range(shares + 1)]
    out = []
    for a, b in itertools.pairwise(cuts):
        lo = np.maximum(starts, a)
        hi = np.minimum(ends, b)
        take = hi > lo
        if not take.any():
            continue
        skip = (lo - starts)[take]
        out.append((dst[take] + skip, src[take] + skip, (hi - lo)[take], tag[take]))
    return out


def split_pieces(batch: ReadBatch, piece: int) -> ReadBatch:
    """``batch`` with every read longer than ``piece`` bytes cut into ``piece``-sized
    reads (same bytes, same order), so several can be in flight at once."""
    n = batch["nbytes"]
    counts = np.maximum(1, -(-n // piece))
    if int(counts.max(initial=1)) == 1:
        return batch
    out = np.repeat(batch, counts)
    k = np.arange(len(out)) - np.repeat(np.cumsum(counts) - counts, counts)
    step = k * piece
    out["local_offset"] += step
    out["remote_offset"] += step
    out["nbytes"] = np.minimum(piece, np.repeat(n, counts) - step)
    return out


def rows_as_batch(rows: npt.NDArray[np.int64]) -> ReadBatch:
    """Wire descriptor rows ``(src_region, src_offset, dst_region, dst_offset, nbytes)``
    (the pull API's layout) as a ``READ_DTYPE`` batch read into this side (the
    destination is local, the source remote)."""
    return as_read_batch(np.ascontiguousarray(rows.reshape(-1, 5)[:, [2, 3, 0, 1, 4]]))


def batch_as_rows(batch: ReadBatch) -> npt.NDArray[np.int64]:
    """The inverse of :func:`rows_as_batch`: ``(n, 5)`` wire rows."""
    flat = np.ascontiguousarray(batch).view("<i8").reshape(-1, 5)
    return np.ascontiguousarray(flat[:, [2, 3, 0, 1, 4]])


def suspect_ranges(batch: ReadBatch) -> list[ByteRange]:
    """The destination ranges ``batch`` writes, sorted and coalesced (bytes)."""
    live = batch[batch["nbytes"] > 0]
    if len(live) == 0:
        return []
    live = live[np.lexsort((live["local_offset"], live["local_region"]))]
    out: list[ByteRange] = []
    reg, start, end = (
        int(live[0]["local_region"]),
        int(live[0]["local_offset"]),
        int(live[0]["local_offset"]),
    )
    for r, o, n in zip(
        live["local_region"].tolist(),
        live["local_offset"].tolist(),
        live["nbytes"].tolist(),
        strict=True,
    ):
        if r == reg and o <= end:
            end = max(end, o + n)
            continue
        out.append(ByteRange(reg, start, end - start))
        reg, start, end = r, o, o + n
    out.append(ByteRange(reg, start, end - start))
    return out


# ---------------------------------------------------------------------------- interface


class Peer(ABC):
    """A connection to one peer transport, made from its authenticated `PeerInfo`."""

    info: PeerInfo

    @abstractmethod
    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        """Read every read of ``batch`` from the peer into our regions; return when done.

        Validates the whole batch first (`ReadRefused`: nothing read). A failure after
        posting raises `PullFailed` (or `PeerLost`) naming the suspect destination
        ranges. Concurrent calls are allowed; each completes independently.
        """

    @abstractmethod
    async def update(self, info: PeerInfo) -> None:
        """Replace the peer's region records with a newer authenticated record."""

    @abstractmethod
    async def close(self) -> None:
        """Release the connection; later `get` raises `TransportClosed`."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Transport(ABC):
    """One data plane. Construct, then ``async with`` (or `start`/`close`).

    ``secret`` is the deployment's shared MAC key for peer records (bytes, ≥ 16).
    ``peer_id`` names this daemon in its advertisement.
    """

    scheme: ClassVar[str]

    def __init__(self, *, secret: bytes, peer_id: str = "") -> None:
        if len(secret) < 16:
            raise ProtocolError(
                f"{self.scheme} transport refused a {len(secret)}-byte secret: need at least 16 bytes"
            )
        self.secret = secret
        self.peer_id = peer_id or f"{self.scheme}-{id(self):x}"

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None:
        """Close every peer and deregister every region. Idempotent."""

    @abstractmethod
    async def register(self, region_id: int, segment: Segment) -> LocalRegion:
        """Register a whole allocation once under ``region_id`` (daemon-chosen).

        Registering an id again replaces the old registration with a new epoch.
        """

    @abstractmethod
    async def deregister(self, region_id: int) -> None: ...

    @property
    @abstractmethod
    def regions(self) -> dict[int, LocalRegion]: ...

    @abstractmethod
    def advertise(self) -> PeerInfo:
        """This transport's signed record: worker address and every region's info."""

    @abstractmethod
    async def connect(self, info: PeerInfo) -> Peer:
        """Connect to a peer from its record; `UnauthenticatedPeer` if the MAC fails."""

    async def wait_ready(self) -> None:
        """Return once the data plane can serve (a restarting one finishes restarting)."""
        return None  # in-process transports never restart

    def local_sizes(self) -> dict[int, int]:
        return {rid: r.size for rid, r in self.regions.items()}

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


# ---------------------------------------------------------------------------- registry

# scheme -> "module:Class"; imported on first use so `ucx` costs nothing unless chosen.
_REGISTRY: dict[str, str | type[Transport]] = {
    "reference": "transports.reference:ReferenceTransport",
    "local": "transports.local:LocalTransport",
    "shm": "transports.samehost:SameHostTransport",
    "ucx": "transports.ucx:UcxTransport",
    "tcp": "transports.tcp:TcpTransport",
}
ENTRY_POINT_GROUP = "refitd.transports"


def register_transport(scheme: str, cls: str | type[Transport]) -> None:
    """Add (or replace) the transport for ``scheme``: a class or ``"module:Class"``.

    Deployments may instead declare an entry point in the ``refitd.transports`` group.
    """
    _REGISTRY[scheme] = cls


def schemes() -> list[str]:
    names = set(_REGISTRY)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def transport_class(scheme: str) -> type[Transport]:
    target: str | type[Transport] | None = _REGISTRY.get(scheme)
    if target is None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == scheme:
                target = ep.value
                break
    if target is None:
        raise UnknownScheme(
            f"transport scheme {scheme!r} refused: not registered (known: {', '.join(schemes())})"
        )
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
        _REGISTRY[scheme] = target
    assert isinstance(target, type)
    return target


def create_transport(scheme: str, **kwargs: Any) -> Transport:
    """Build (not start) the transport registered for ``scheme``."""
    return transport_class(scheme)(**kwargs)
