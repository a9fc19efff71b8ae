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

- this package: `TcpTransport`, `TcpPeer`, `TcpGrant`
- `lanes`: the reading side: one lane is one TCP connection to a peer
- `serve`: the source side: a data server that sends from the mapping
- `frames`: the wire: frames, the handshake, grants and scope checks
- `held`: reads of bytes still filling, held by the data server until complete
- `admission`: who the data server lets start a handshake, and how many at once
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Self

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import NotFoundError, ProtocolError, TransportError

from ..batch import ReadBatch, as_read_batch, coalesce, split_pieces, suspect_ranges, validate_batch
from ..interface import (
    AdvertisedRegion,
    Capabilities,
    LeaseScope,
    LocalRegion,
    MappedMemory,
    Peer,
    PeerInfo,
    PeerLost,
    PullFailed,
    ReadRefused,
    Transport,
    TransportClosed,
    TransportOptions,
    UnauthenticatedPeer,
)
from .frames import (
    READ_ROW,
    Grant,
    check_scope,
    scoped_grant,
)
from .held import HOLD_S, Completion
from .lanes import BIG, REQUEST_BYTES, Lane, LaneError, Request, request_spans
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


SLICE = 1 << 20
"""A read longer than this (bytes) is cut into pieces spread over the lanes."""
KEEP_GRANTS = 64
"""Grants a connection remembers for requests still queued (newest first)."""
BACKSTOP_S = 5.0
"""Seconds past a batch's deadline after which its lanes are cut from this side."""


def parse_address(address: bytes) -> tuple[str, int, int]:
    """``(host, port, incarnation)`` of a ``tcp`` record's address."""
    try:
        host, port, incarnation = msgspec.msgpack.decode(address, type=tuple[str, int, int])
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"tcp peer address refused: malformed ({exc})") from None
    return host, port, incarnation


def _view(segment: MappedMemory) -> memoryview:
    """A writable byte view of a whole segment's mapping (holding it keeps a
    `SharedSegment`'s mapping alive, even after the segment is closed)."""
    numpy = getattr(segment, "numpy", None)
    if callable(numpy):
        arr = numpy()
        return memoryview(arr).cast("B")
    import ctypes

    return memoryview((ctypes.c_char * segment.size).from_address(segment.address)).cast("B")


class TcpPeer(Peer):
    """A connection to one peer's data server: ``lanes`` TCP connections.

    ``info`` is the record reads are checked against on both ends: the peer's own
    advertisement, or a lease-scoped grant made from it (`update` replaces it; the
    new grant is sent on each lane before its next request)."""

    def __init__(self, owner: TcpTransport, info: PeerInfo) -> None:
        self.owner = owner
        self.info = info
        self.address = parse_address(info.address)
        self._grants: dict[int, PeerInfo] = {0: info}
        self._number = self._current = 0
        self._check = Grant(info)
        self._closed = False
        self.lanes = [Lane(self, i) for i in range(owner.lanes)]
        self._ids = itertools.count()

    @property
    def incarnation(self) -> int:
        """The source's incarnation this connection is for."""
        return self.address[2]

    def current_grant(self) -> tuple[int, PeerInfo]:
        return self._current, self._grants[self._current]

    def grant(self, number: int) -> PeerInfo:
        """Grant ``number`` (lane threads call this; `LaneError` once forgotten)."""
        info = self._grants.get(number)
        if info is None:
            raise LaneError("refused", f"grant {number} was replaced {KEEP_GRANTS} times since")
        return info

    def with_grant(self, info: PeerInfo) -> TcpGrant:
        """A connection over these lanes whose reads are checked (here and at the
        source) against ``info``, a record of the same peer life (e.g. one pull's
        lease-scoped grant), while other reads go on under theirs."""
        if self._closed:
            raise TransportClosed(f"connection to {self.info.peer_id!r} is closed")
        self.owner._check_record(info)
        if info.address != self.info.address:
            raise ProtocolError(
                f"grant for peer {self.info.peer_id!r} refused: the record is for another "
                "address or another life of it"
            )
        return TcpGrant(self, self._add(info), info)

    async def scoped(self, info: PeerInfo) -> Peer:
        # Each pull reads under its own grant on the shared lanes; the lanes keep
        # the record they were opened with.
        return self.with_grant(info)

    def cut(self) -> None:
        for lane in self.lanes:
            lane.cut()

    def _add(self, info: PeerInfo) -> int:
        self._number += 1
        self._grants[self._number] = info
        self._grants.pop(self._number - KEEP_GRANTS, None)
        return self._number

    async def open(self) -> None:
        """Connect every lane (in parallel), then start their threads."""
        results = await asyncio.gather(
            *(asyncio.to_thread(lane.connect) for lane in self.lanes), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for lane in self.lanes:
                lane._drop()
            first = errors[0]
            who = self.info.peer_id
            if isinstance(first, LaneError) and first.kind == "auth":
                raise UnauthenticatedPeer(f"connect to {who!r} refused: {first}")
            if isinstance(first, LaneError) and first.kind == "busy":
                raise TransportError(f"connect to {who!r} refused: {first}")
            if isinstance(first, LaneError):
                raise TransportError(f"connect to {who!r} failed: {first}")
            raise first
        for lane in self.lanes:
            lane.thread.start()

    async def update(self, info: PeerInfo) -> None:
        if self._closed:
            raise TransportClosed(f"update refused: connection to {self.info.peer_id!r} is closed")
        self.owner._check_record(info)
        if info.address != self.info.address:
            raise ProtocolError(
                f"update of peer {self.info.peer_id!r} refused: the record is for another "
                "address or another life of it"
            )
        check = Grant(info)
        self._current = self._add(info)
        self.info, self._check = info, check

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        await self.read(batch, self._current, self._check)

    async def read(
        self,
        batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]],
        number: int,
        check: Grant,
    ) -> None:
        """`get` under grant ``number`` (whose checks are ``check``)."""
        if self._closed or self.owner.closed:
            raise TransportClosed(f"get refused: connection to {self.info.peer_id!r} is closed")
        reads = as_read_batch(batch)
        validate_batch(reads, self.owner.local_sizes(), check.sizes)
        bad = check_scope(
            check,
            reads["remote_region"],
            reads["remote_offset"],
            reads["nbytes"],
            check.generations,
            check.sizes,
        )
        if bad is not None:
            i, why = bad
            raise ReadRefused(i, tuple(int(v) for v in reads[i].tolist()), why, "scope")  # type: ignore[arg-type]
        live = coalesce(reads)
        if len(live) == 0:
            return
        pieces = split_pieces(live, SLICE)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.owner.pull_timeout
        futures: list[asyncio.Future[None]] = []
        # Small pieces and large ones go in separate requests: the small ones are
        # gathered into one buffer on each end, the large ones move from and into
        # the regions themselves.
        small = pieces["nbytes"] < BIG
        parts = [
            group[lo:hi]
            for group in (pieces[~small], pieces[small])
            for lo, hi in request_spans(group["nbytes"])
        ]
        for part in parts:
            rows = np.empty(len(part), READ_ROW)
            rows["region"], rows["offset"] = part["remote_region"], part["remote_offset"]
            rows["nbytes"] = part["nbytes"]
            fut: asyncio.Future[None] = loop.create_future()
            req = Request(
                rows.tobytes(),
                part["local_region"].copy(),
                part["local_offset"].copy(),
                part["nbytes"].copy(),
                number,
                deadline,
                fut,
                loop,
            )
            lane = min(self.lanes, key=lambda ln: ln.queued)
            lane.queued += 1
            lane.queue.put(req)
            futures.append(fut)
        try:
            async with asyncio.timeout(self.owner.pull_timeout + BACKSTOP_S):
                results = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            for lane in self.lanes:
                lane.cut()
            raise PeerLost(
                f"pull from {self.info.peer_id!r} timed out after {self.owner.pull_timeout} s "
                f"and its lanes did not give up within {BACKSTOP_S} s more: they were cut",
                suspect_ranges(reads),
            ) from None
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise self._failure(errors, reads)

    def _failure(self, errors: list[BaseException], reads: ReadBatch) -> PullFailed:
        who = self.info.peer_id
        first = next((e for e in errors if isinstance(e, LaneError)), None)
        if first is None:
            return PullFailed(f"pull from {who!r} failed: {errors[0]}", suspect_ranges(reads))
        if first.kind == "refused":
            return PullFailed(
                f"pull from {who!r} refused by the source: {first}", suspect_ranges(reads)
            )
        if first.kind == "timeout":
            return PeerLost(
                f"pull from {who!r} failed: {first}; pulls from other peers were not affected",
                suspect_ranges(reads),
            )
        if first.kind == "restarted":
            return PeerLost(f"pull from {who!r} failed: {first}", suspect_ranges(reads))
        return PeerLost(f"pull from {who!r} failed: {first}", suspect_ranges(reads))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.owner._peers.discard(self)
        for lane in self.lanes:
            lane.queue.put(None)
            lane.cut()
        started = [lane.thread for lane in self.lanes if lane.thread.is_alive()]
        if started:

            def join() -> None:
                for t in started:
                    t.join(10)

            await asyncio.to_thread(join)


class TcpGrant(Peer):
    """One grant over a `TcpPeer`'s lanes (see `TcpPeer.with_grant`); closing it
    leaves the lanes to the connection."""

    def __init__(self, base: TcpPeer, number: int, info: PeerInfo) -> None:
        self.base, self.number, self.info = base, number, info
        self._check = Grant(info)
        self._closed = False

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        if self._closed:
            raise TransportClosed(f"get refused: this grant of {self.info.peer_id!r} is closed")
        await self.base.read(batch, self.number, self._check)

    async def update(self, info: PeerInfo) -> None:
        fresh = self.base.with_grant(info)
        self.number, self.info, self._check = fresh.number, info, fresh._check

    async def scoped(self, info: PeerInfo) -> Peer:
        return self.base.with_grant(info)

    def cut(self) -> None:
        self.base.cut()

    async def close(self) -> None:
        self._closed = True


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
