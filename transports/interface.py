"""The data-plane interface: regions, peers, batched one-sided reads, a registry.

A *transport* moves bytes from a peer's registered memory into this process's
registered memory with one-sided reads (the peer's control logic takes no part).

    Transport                   one per daemon; an async context manager
    ├── register(id, segment)   -> LocalRegion: registered once, whole allocation
    ├── advertise()             -> PeerInfo: signed record a peer connects with
    ├── capabilities            -> Capabilities: what it can do (asked, never its scheme)
    └── connect(PeerInfo)       -> Peer: an async context manager
                                   └── await get(batch)  # region-relative reads

A *read* is ``(local_region, local_offset, remote_region, remote_offset, nbytes)``;
offsets and sizes are in bytes, relative to the start of the region. A batch is a
numpy structured array of ``READ_DTYPE`` or any sequence of 5-tuples; the rules on
batches live in `transports.batch`. Every read of a batch is checked against both
regions' records before the first byte moves (`validate_batch`); a refused batch
reads nothing.

Peer records are authenticated: `PeerInfo` carries an HMAC-SHA256 over every field
(worker address, region ids, generations, addresses, sizes, packed keys) made with the
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

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

import msgspec

from refitd.errors import NotFoundError, ProtocolError, TransportError
from refitd.signing import Signed

# Defined below this module (the batch algebra, the memory kinds), which import
# nothing of it back; re-exported here, where a transport's author looks for them.
from .batch import ByteRange, ReadBatch, ReadRefused
from .memory import MappedMemory, is_host

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "AdvertisedRegion",
    "ByteRange",
    "Capabilities",
    "LeaseScope",
    "LocalRegion",
    "MappedMemory",
    "Peer",
    "PeerInfo",
    "PeerLost",
    "PullFailed",
    "ReadRefused",
    "Scope",
    "Transport",
    "TransportClosed",
    "TransportOptions",
    "UnauthenticatedPeer",
    "UnknownScheme",
    "create_transport",
    "register_transport",
    "schemes",
    "transport_class",
]

# ---------------------------------------------------------------------------- errors


class TransportClosed(TransportError):
    """The transport or the peer connection is closed; the batch was not started."""


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


class UnauthenticatedPeer(ProtocolError):
    """A peer record's MAC did not verify under our secret; no key was unpacked."""


class UnknownScheme(NotFoundError):
    """No transport is registered under the requested scheme."""


# ---------------------------------------------------------------------------- records


class AdvertisedRegion(msgspec.Struct, frozen=True):
    """What a peer needs to read a region: the owner's address space, not ours.

    ``address`` is the region's base address in the process that serves it (the
    data-plane process for UCX); ``size`` is exact, in bytes; ``generation`` changes every
    time the region is (re-)registered, so a stale record is detectable; ``key`` is
    the scheme's own key to the region, bytes only that scheme decodes (empty where
    none is needed): a UCX packed remote key (``ucx``), a
    :class:`transports.shm.SegmentKey` (``shm``), a
    :class:`transports.tcp.frames.ScopeKey` (``tcp``).
    """

    region_id: int
    generation: int
    address: int
    size: int
    key: bytes = b""


class PeerInfo(Signed, frozen=True):
    """A transport's advertisement, signed by `advertise` with the shared secret
    (`refitd.signing`: HMAC-SHA256 over the record's msgpack encoding).

    ``address`` is scheme-specific (a UCX worker address; an in-process token).
    """

    scheme: str
    peer_id: str
    address: bytes
    regions: tuple[AdvertisedRegion, ...]
    mac: bytes = b""

    refused = UnauthenticatedPeer

    def _what(self) -> str:
        return f"peer record of {self.peer_id!r} ({self.scheme})"

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo:
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"peer record refused: malformed ({exc})") from exc


@dataclass(frozen=True)
class LocalRegion:
    """A registered region of ours. ``info`` is what `advertise` publishes for it."""

    region_id: int
    segment: MappedMemory = field(repr=False)
    info: AdvertisedRegion

    @property
    def size(self) -> int:
        return self.segment.size

    @property
    def generation(self) -> int:
        return self.info.generation


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

    async def scoped(self, info: PeerInfo) -> Peer:
        """A connection whose reads are checked against ``info``: a newer record, or
        the credential the source made for one lease (:meth:`Transport.grant`), of the same
        peer life. By default this connection, brought up to ``info`` (a connection
        made from ``info`` is returned as it is); a transport that checks each read
        against its own grant (``tcp``) returns a view over the same links."""
        if info is not self.info:
            await self.update(info)
        return self

    def cut(self) -> None:
        """Break the links under this connection so that a read blocked on a peer that
        missed its deadline wakes with an error and no late byte lands. By default
        nothing: a transport with no links of its own has no late bytes."""
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


Scope = Mapping[int, Sequence[tuple[int, int]]]
"""A lease's scope: region id -> the byte ranges ``[start, end)`` it may read there
(sorted, disjoint). Spelled once: the daemon's checks and every transport's grant
take this type; on the wire it is ``PeerRegions.scope``, the same map made concrete."""


@dataclass(frozen=True)
class LeaseScope:
    """What one lease lets a reader read from a peer: ``ranges`` (a :data:`Scope`)
    maps a host region id to its ``[start, end)`` byte ranges; ``lease_id`` names the
    lease (the source frees what it granted when the lease ends)."""

    lease_id: str
    ranges: Scope


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do: its users ask this, never its scheme's name.

    ``rdma``: its reads are one-sided RDMA (chosen over a transport without it where
    both ends run both). ``holds_reads``: its source's data server holds a read of
    bytes not complete there yet until they are (``hold_reads``), so a reader may
    ask ahead of them. ``reads_strided``: a reader maps the source's memory and
    gathers strided blocks itself, straight into their destinations (no packing at
    the source). ``shares_connections``: one connection per peer life serves every
    reader (each scoped to its grant, :meth:`Peer.scoped`); False: each reader's
    connection is its own, widened in place, and closed by that reader.
    ``piece`` (bytes): a read longer than this is cut into pieces of it, so several
    are in flight; ``batch_reads``: the most reads handed to :meth:`Peer.get` at once.
    """

    rdma: bool = False
    holds_reads: bool = False
    reads_strided: bool = False
    shares_connections: bool = True
    piece: int = 32 << 20
    batch_reads: int = 2048


@dataclass(frozen=True)
class TransportOptions:
    """What every transport is built with (:meth:`Transport.from_options`):
    ``secret`` (≥ 16 bytes) and ``peer_id`` as for :class:`Transport`;
    ``pull_timeout`` (s) the deadline of one batch of reads from a peer (a hung
    peer fails only the batches that read from it). A scheme with options of its
    own subclasses it (``transports.tcp.TcpOptions``) and reads them in its
    ``from_options``; given the common ones only, it takes its defaults."""

    secret: bytes = field(repr=False)
    peer_id: str = ""
    pull_timeout: float = 120.0


class Transport(ABC):
    """One data plane. Construct, then ``async with`` (or `start`/`close`).

    ``secret`` is the deployment's shared MAC key for peer records (bytes, ≥ 16).
    ``peer_id`` names this daemon in its advertisement.
    """

    scheme: ClassVar[str]
    #: what it can do (:class:`Capabilities`); the defaults unless it says more
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, *, secret: bytes, peer_id: str = "") -> None:
        if len(secret) < 16:
            raise ProtocolError(
                f"{self.scheme} transport refused a {len(secret)}-byte secret: need at least 16 bytes"
            )
        self.secret = secret
        self.peer_id = peer_id or f"{self.scheme}-{id(self):x}"

    @classmethod
    def from_options(cls, options: TransportOptions) -> Self:
        """This transport built from ``options`` (a transport with options of its
        own reads them here)."""
        return cls(secret=options.secret, peer_id=options.peer_id)

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None:
        """Close every peer and deregister every region. Idempotent."""

    @abstractmethod
    async def register(self, region_id: int, segment: MappedMemory) -> LocalRegion:
        """Register a whole allocation once under ``region_id`` (daemon-chosen).

        Registering an id again replaces the old registration with a new generation.
        """

    @abstractmethod
    async def deregister(self, region_id: int) -> None: ...

    def registers(self, memory: MappedMemory) -> bool:
        """Whether this transport registers (and reads) memory of ``memory``'s kind
        (`transports.memory`): host memory only, unless a transport says more. A
        region it does not register is one it has no path to."""
        return is_host(memory)

    @property
    @abstractmethod
    def regions(self) -> dict[int, LocalRegion]: ...

    @abstractmethod
    def advertise(self) -> PeerInfo:
        """This transport's signed record: worker address and every region's info."""

    @abstractmethod
    async def connect(self, info: PeerInfo) -> Peer:
        """Connect to a peer from its record; `UnauthenticatedPeer` if the MAC fails."""

    @property
    def checks_lease(self) -> bool:
        """Whether this transport's data server checks, before every read, that the
        lease of the grant it was given is live (``tcp``, as every daemon runs it): a
        grant of a lease released or expired since is refused its first read."""
        return False

    def grant(self, scope: LeaseScope) -> PeerInfo:
        """The credential a reader of this transport's memory connects with
        (:meth:`connect`, :meth:`Peer.scoped`) to read what ``scope`` grants: made here,
        at the source, and signed by it; a reader presents it as it was given, and never
        makes one. By default the advertisement itself (the reading daemon checks each
        read against the source's signed records); a transport whose data server checks
        each read against the grant (``tcp``), or whose reader maps the source's memory
        (``shm``: its connection checks each read), makes a lease-scoped one."""
        return self.advertise()

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
    "shm": "transports.shm:ShmTransport",
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


def create_transport(
    scheme: str, options: TransportOptions | None = None, **kwargs: Any
) -> Transport:
    """Build (not start) the transport registered for ``scheme``: from ``options``
    (:meth:`Transport.from_options`), or from its constructor's keyword arguments."""
    cls = transport_class(scheme)
    return cls.from_options(options) if options is not None else cls(**kwargs)
