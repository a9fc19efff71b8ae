"""The ``tcp`` transport: refitd's own data plane over plain TCP, with lanes.

For hosts without RDMA (cloud VMs, development boxes), where UCX over tcp has no true
one-sided read (its source wakes per fragment) and fell to half of one TCP stream
while the source host was busy. Here:

- **Lanes.** A connection to a peer is ``lanes`` TCP connections (default 4), each
  serviced by its own thread on each end, so one stalled lane does not hold up the
  others. A read longer than ``SLICE`` bytes is cut, and a batch is cut into
  requests (≤ ``REQUEST_BYTES``, ≤ ``MAX_READS`` reads) spread over the lanes; each
  lane keeps ``WINDOW`` requests in flight, so the wire never waits for a round trip.
- **No staging copy.** The source sends with ``sendmsg`` from memoryviews of the
  mapped region; the reader receives with ``recv_into`` (pieces ≥ 64 KiB) or
  ``recvmsg_into`` (smaller pieces, scattered ``IOV_MAX`` at a time) straight into the
  destination region. ``TCP_NODELAY`` and large socket buffers on both ends.
- **Safer than an rkey.** The source's data server (`transports.tcp.serve`) checks
  every read against the signed record the connection was granted (regions, their
  generations, the byte ranges of one lease: `transports.tcp.frames.scope_key`) before it
  sends a byte. Connections authenticate with the deployment secret (no token
  travels); a host ``accept`` refuses is closed unanswered.
- **Faults.** Every request has the pull deadline (``pull_timeout`` s) as its socket
  timeout: a stopped source fails the pulls reading from it (`PeerLost`, naming it)
  and nothing else; a killed one fails them at once. Either way the lane is closed
  (its stream is in an unknown state) and the next read connects again; a source
  that restarted (another incarnation) refuses that connection, and the error says so,
  so its daemon's new record is fetched.

``PeerInfo.address`` is the msgpack of ``(host, port, incarnation)``. A region record's
``key`` is empty in `advertise` (the whole region, for callers that trust each
other, as the contract suite does) or a lease scope in a grant; a daemon runs its
transport with ``require_lease`` so only the latter are served.

Modules:

- this package: `TcpTransport` and its options
- `peer`: the reading side's connection to a peer: `TcpPeer`, `TcpGrant`
- `lanes`: the reading side: one lane is one TCP connection to a peer
- `serve`: the source side: a data server that sends from the mapping
- `frames`: the wire: frames, the handshake, grants and scope checks
- `held`: reads of bytes still filling, held by the data server until complete
- `admission`: who the data server lets start a handshake, and how many at once
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Self

import msgspec

from refitd.errors import NotFoundError, ProtocolError

from ..interface import (
    AdvertisedRegion,
    Capabilities,
    LeaseScope,
    LocalRegion,
    MappedMemory,
    PeerInfo,
    Transport,
    TransportClosed,
    TransportOptions,
)
from .frames import Grant, scoped_grant
from .held import HOLD_S, Completion
from .lanes import REQUEST_BYTES
from .peer import BACKSTOP_S, SLICE, TcpGrant, TcpPeer, parse_address
from .serve import (
    HANDSHAKE_S,
    MAX_CONNECTIONS,
    MAX_PENDING,
    MAX_PENDING_PER_ADDRESS,
    DataServer,
    Served,
)

__all__ = [
    "BACKSTOP_S",
    "REQUEST_BYTES",
    "SLICE",
    "TcpGrant",
    "TcpOptions",
    "TcpPeer",
    "TcpTransport",
    "parse_address",
    "scoped_grant",
]


@dataclass(frozen=True)
class TcpOptions(TransportOptions):
    """The ``tcp`` transport's options besides the common ones: ``lanes``
    connections per peer, the data server's ``host`` and ``port`` (0: any free one),
    the host it advertises (``advertise_host``, "" the bound one), who may connect
    (``accept(host)``) and read (``authorize(lease)``, required when
    ``require_lease``), and ``incarnation``, its server's life."""

    lanes: int = 4
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    accept: Callable[[str], bool] | None = None
    authorize: Callable[[str], bool] | None = None
    require_lease: bool = False
    incarnation: int | None = None


def _view(segment: MappedMemory) -> memoryview:
    """A writable byte view of a whole segment's mapping (holding it keeps a
    `SharedSegment`'s mapping alive, even after the segment is closed)."""
    numpy = getattr(segment, "numpy", None)
    if callable(numpy):
        arr = numpy()
        return memoryview(arr).cast("B")
    import ctypes

    return memoryview((ctypes.c_char * segment.size).from_address(segment.address)).cast("B")


class TcpTransport(Transport):
    """refitd's own TCP data plane (see the module docstring).

    ``lanes`` TCP connections per peer (≥ 1); ``pull_timeout`` (s) the deadline of one
    batch; ``host``/``port`` where the data server listens (port 0: any free one) and
    ``advertise_host`` the address peers connect to (default: ``host``, or this host's
    name when it listens on every address). ``accept(ip)`` says whether a connecting
    host may talk to the data server at all (unanswered otherwise), ``authorize(lease)``
    whether a lease is still live; with ``require_lease`` the data server serves only
    lease-scoped grants. ``incarnation`` names this life of the data server (default: now,
    in ns). Admission to the data server (``loopback_uids``, ``handshake_s``,
    ``max_connections``, ``max_pending``, ``max_pending_per_address``): see
    `transports.tcp.serve` (the defaults are its constants)."""

    scheme = "tcp"
    #: its data server holds a read of bytes not complete yet (:meth:`hold_reads`);
    #: a batch may hold many small reads: they are gathered into requests over lanes
    capabilities = Capabilities(holds_reads=True, batch_reads=16384)

    def __init__(
        self,
        *,
        secret: bytes,
        peer_id: str = "",
        lanes: int = 4,
        pull_timeout: float = 120.0,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "",
        accept: Callable[[str], bool] | None = None,
        authorize: Callable[[str], bool] | None = None,
        require_lease: bool = False,
        incarnation: int | None = None,
        loopback_uids: Collection[int] | None = None,
        handshake_s: float = HANDSHAKE_S,
        max_connections: int = MAX_CONNECTIONS,
        max_pending: int = MAX_PENDING,
        max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
        hold_s: float = HOLD_S,
    ) -> None:
        super().__init__(secret=secret, peer_id=peer_id)
        if lanes < 1:
            raise ValueError(f"tcp transport refused {lanes} lanes: need at least 1")
        if pull_timeout <= 0:
            raise ValueError("pull_timeout must be > 0 seconds")
        self.lanes = lanes
        self.pull_timeout = pull_timeout
        self.host, self.port = host, port
        self.advertise_host = advertise_host
        self.accept, self.authorize, self.require_lease = accept, authorize, require_lease
        self.loopback_uids = loopback_uids
        self.handshake_s = handshake_s
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.max_pending_per_address = max_pending_per_address
        self.hold_s = hold_s
        self._completion: Completion | None = None
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self._regions: dict[int, LocalRegion] = {}
        self._views: dict[int, memoryview] = {}
        self._bases: dict[int, int] = {}  # region id -> base address of its mapping
        self._served: dict[int, Served] = {}
        self._peers: set[TcpPeer] = set()
        self._server: DataServer | None = None
        # An incarnation seeds the region generations (as before the rename): they count
        # up from this server's start time, so a record from an earlier life of the
        # server does not name a generation this one registers soon after it starts.
        self._region_generations = itertools.count(self.incarnation)
        self.closed = True

    @classmethod
    def from_options(cls, options: TransportOptions) -> Self:
        o = (
            options
            if isinstance(options, TcpOptions)
            else TcpOptions(options.secret, options.peer_id, options.pull_timeout)
        )
        return cls(
            secret=o.secret,
            peer_id=o.peer_id,
            lanes=o.lanes,
            pull_timeout=o.pull_timeout,
            host=o.host,
            port=o.port,
            advertise_host=o.advertise_host,
            accept=o.accept,
            authorize=o.authorize,
            require_lease=o.require_lease,
            incarnation=o.incarnation,
        )

    def hold_reads(self, completion: Completion | None) -> None:
        """Hold each read of bytes ``completion`` says are still filling until they are
        complete (`transports.tcp.held`), from now on; None: answer every read at once."""
        self._completion = completion
        if self._server is not None:
            self._server.holds.completion = completion

    @property
    def server(self) -> DataServer:
        if self._server is None:
            raise TransportClosed("tcp transport is not started")
        return self._server

    async def start(self) -> None:
        self._server = DataServer(
            secret=self.secret,
            incarnation=self.incarnation,
            regions=self._served,
            host=self.host,
            port=self.port,
            accept=self.accept,
            authorize=self.authorize,
            require_lease=self.require_lease,
            loopback_uids=self.loopback_uids,
            handshake_s=self.handshake_s,
            max_connections=self.max_connections,
            max_pending=self.max_pending,
            max_pending_per_address=self.max_pending_per_address,
            hold=self._completion,
            hold_s=self.hold_s,
        )
        self._server.start()
        self.closed = False

    async def close(self) -> None:
        if self.closed and self._server is None:
            return
        self.closed = True
        for peer in list(self._peers):
            await peer.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        self._regions.clear()
        self._views.clear()
        self._bases.clear()
        self._served.clear()

    async def register(self, region_id: int, segment: MappedMemory) -> LocalRegion:
        if self.closed:
            raise TransportClosed("register refused: tcp transport is closed")
        view = _view(segment)
        generation = next(self._region_generations)
        info = AdvertisedRegion(region_id, generation, 0, segment.size)
        region = LocalRegion(region_id, segment, info)
        self._regions[region_id] = region
        self._views[region_id] = view
        self._bases[region_id] = segment.address
        self._served[region_id] = Served(generation, segment.size, view, segment.address)
        return region

    async def deregister(self, region_id: int) -> None:
        if region_id not in self._regions:
            raise NotFoundError(f"deregistering region {region_id} refused: not registered")
        del self._regions[region_id]
        self._served.pop(region_id, None)
        self._views.pop(region_id, None)
        self._bases.pop(region_id, None)

    @property
    def regions(self) -> dict[int, LocalRegion]:
        return dict(self._regions)

    @property
    def address(self) -> tuple[str, int]:
        """Where peers connect: ``(host, port)``."""
        host, port = self.server.address
        if self.advertise_host:
            host = self.advertise_host
        elif host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return host, port

    def advertise(self) -> PeerInfo:
        host, port = self.address
        return PeerInfo(
            scheme=self.scheme,
            peer_id=self.peer_id,
            address=msgspec.msgpack.encode((host, port, self.incarnation)),
            regions=tuple(r.info for r in self._regions.values()),
        ).signed(self.secret)

    def _check_record(self, info: PeerInfo) -> None:
        info.verify(self.secret)
        if info.scheme != self.scheme:
            raise ProtocolError(
                f"connect refused: record is for scheme {info.scheme!r}, not {self.scheme!r}"
            )
        parse_address(info.address)
        try:
            Grant(info)
        except (ValueError, msgspec.MsgspecError) as exc:
            raise ProtocolError(f"record of {info.peer_id!r} refused: {exc}") from None

    @property
    def checks_lease(self) -> bool:
        """Run with ``require_lease`` and ``authorize``, as a daemon runs it."""
        return self.require_lease and self.authorize is not None

    def grant(self, scope: LeaseScope) -> PeerInfo:
        """The lease's grant, made by this source (:func:`scoped_grant` of its own
        advertisement): its data server reads nothing outside ``scope``, and nothing
        at all once the lease is no longer live (``authorize``)."""
        return scoped_grant(self.advertise(), scope.lease_id, scope.ranges, self.secret)

    async def connect(self, info: PeerInfo) -> TcpPeer:
        if self.closed:
            raise TransportClosed("connect refused: tcp transport is closed")
        self._check_record(info)
        peer = TcpPeer(self, info)
        await peer.open()
        self._peers.add(peer)
        return peer
