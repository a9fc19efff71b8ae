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
- **Safer than an rkey.** The source's data server (`transports.tcpserve`) checks
  every read against the signed record the connection was granted (regions, their
  epochs, the byte ranges of one lease: `transports.tcpwire.scope_key`) before it
  sends a byte. Connections authenticate with the deployment secret (no token
  travels); a host ``accept`` refuses is closed unanswered.
- **Faults.** Every request has the pull deadline (``pull_timeout`` s) as its socket
  timeout: a stopped source fails the pulls reading from it (`PeerLost`, naming it)
  and nothing else; a killed one fails them at once. Either way the lane is closed
  (its stream is in an unknown state) and the next read connects again; a source
  that restarted (another epoch) refuses that connection, and the error says so,
  so its daemon's new record is fetched.

``PeerInfo.address`` is the msgpack of ``(host, port, epoch)``. A region record's
``rkey`` is empty in `advertise` (the whole region, for callers that trust each
other, as the contract suite does) or a lease scope in a grant; a daemon runs its
transport with ``require_lease`` so only the latter are served.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import NotFoundError, ProtocolError, TransportError

from .core import (
    LocalRegion,
    Peer,
    PeerInfo,
    PeerLost,
    PullFailed,
    ReadBatch,
    ReadRefused,
    RegionInfo,
    Segment,
    Transport,
    TransportClosed,
    UnauthenticatedPeer,
    as_read_batch,
    coalesce,
    split_pieces,
    suspect_ranges,
    validate_batch,
)
from .native import copy_lib
from .tcpserve import IOV_MAX, DataServer, Served, recv_exact, send_all, tune
from .tcpwire import (
    CHALLENGE,
    HEADER,
    HELLO,
    MAGIC,
    MAX_GRANTS,
    MAX_READS,
    PROOF,
    READ_ROW,
    Grant,
    Kind,
    check_scope,
    client_proof,
    server_proof,
)

__all__ = [
    "BACKSTOP_S",
    "REQUEST_BYTES",
    "SLICE",
    "TcpGrant",
    "TcpPeer",
    "TcpTransport",
    "parse_address",
]

SLICE = 1 << 20
"""A read longer than this (bytes) is cut into pieces spread over the lanes."""
REQUEST_BYTES = 4 << 20
"""Bytes one request asks for at most (a request holds ≤ ``MAX_READS`` reads)."""
WINDOW = 4
"""Requests one lane keeps in flight."""
PIPELINE_BYTES = 64 << 10
"""Request bytes (24 per read) one lane sends ahead while answers are owed: less than
any socket receive buffer a kernel starts a connection with."""
BIG = 64 << 10
"""Pieces at least this large are received one ``recv_into`` each; smaller ones are
scattered by ``recvmsg_into``, many per system call."""
KEEP_GRANTS = 64
"""Grants a connection remembers for requests still queued (newest first)."""
BACKSTOP_S = 5.0
"""Seconds past a batch's deadline after which its lanes are cut from this side."""


def parse_address(address: bytes) -> tuple[str, int, int]:
    """``(host, port, epoch)`` of a ``tcp`` record's address."""
    try:
        host, port, epoch = msgspec.msgpack.decode(address, type=tuple[str, int, int])
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"tcp peer address refused: malformed ({exc})") from None
    return host, port, epoch


def _view(segment: Segment) -> memoryview:
    """A writable byte view of a whole segment's mapping (holding it keeps a
    `SharedSegment`'s mapping alive, even after the segment is closed)."""
    numpy = getattr(segment, "numpy", None)
    if callable(numpy):
        arr = numpy()
        return memoryview(arr).cast("B")
    import ctypes

    return memoryview((ctypes.c_char * segment.size).from_address(segment.address)).cast("B")


class _LaneError(Exception):
    """A lane's failure, told to the batch it failed: ``kind`` is "lost" (the
    connection broke or was refused), "timeout", "refused" (the source refused a
    read), "restarted" (another epoch answered) or "auth"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(eq=False)
class _Request:
    """Reads of one request: the wire rows, and where each lands here."""

    rows: bytes
    dst_region: npt.NDArray[np.int64]
    dst_offset: npt.NDArray[np.int64]
    nbytes: npt.NDArray[np.int64]
    grant: int
    deadline: float
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop

    def finish(self, error: BaseException | None = None) -> None:
        def done() -> None:
            if self.future.done():
                return
            if error is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(error)

        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            self.loop.call_soon_threadsafe(done)


class _Lane:
    """One TCP connection to the peer and the thread that services it."""

    def __init__(self, peer: TcpPeer, index: int) -> None:
        self.peer = peer
        self.index = index
        self.queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        #: grant numbers sent on this connection, oldest first (as the server keeps them)
        self.sent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.queued = 0  # requests handed to this lane and not finished
        self.bounce: npt.NDArray[np.uint8] | None = None  # small pieces land here first
        self.thread = threading.Thread(
            target=self._run, name=f"tcp-lane-{peer.info.peer_id}-{index}", daemon=True
        )

    # -- connection

    def connect(self) -> None:
        """Connect and authenticate (raises `_LaneError`)."""
        p = self.peer
        host, port, epoch = p.address
        timeout = min(10.0, p.owner.pull_timeout)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise _LaneError("lost", f"cannot connect to {host}:{port}: {exc}") from None
        try:
            tune(sock)
            cn = os.urandom(16)
            mine = p.owner.epoch
            sock.sendall(HELLO.pack(MAGIC, mine, epoch, cn))
            try:
                se, sn, smac = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size))
            except ConnectionError:
                raise _LaneError(
                    "auth",
                    f"{host}:{port} closed the connection unanswered: this host is not a "
                    "trusted peer there, or it is no refitd tcp data server",
                ) from None
            if se != epoch:
                raise _LaneError(
                    "restarted",
                    f"the source restarted: {host}:{port} now runs epoch {se}, the record "
                    f"names epoch {epoch}; fetch its new record",
                )
            if smac != server_proof(p.owner.secret, cn, sn, mine, se):
                raise _LaneError(
                    "auth",
                    f"{host}:{port} failed to prove the deployment secret: not a daemon of "
                    "this deployment",
                )
            number, grant = p.current_grant()
            proof = client_proof(p.owner.secret, cn, sn, mine, se, grant.mac)
            body = grant.encode()
            send_all(sock, [PROOF.pack(proof), HEADER.pack(Kind.GRANT, len(body), number, 0), body])
            try:
                recv_exact(sock, 1)
            except ConnectionError:
                raise _LaneError(
                    "auth",
                    f"{host}:{port} refused our proof or record (another deployment secret, "
                    "or a record it does not serve)",
                ) from None
        except _LaneError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise _LaneError("lost", f"handshake with {host}:{port} failed: {exc}") from None
        sock.settimeout(None)
        self.sock = sock
        self.sent = collections.OrderedDict({number: None})

    def cut(self) -> None:
        """Break the connection from outside (a backstop or a close): a thread blocked
        on it wakes with an error."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    # -- the thread

    def _run(self) -> None:
        outstanding: collections.deque[_Request] = collections.deque()
        held: _Request | None = None  # taken from the queue, waiting for room to send
        stopping = False
        while True:
            if not outstanding:
                if held is None:
                    if stopping:
                        break
                    held = self.queue.get()
                    if held is None:
                        break
                item, held = held, None
                self._send(item, outstanding)
                continue
            while len(outstanding) < WINDOW and not stopping:
                if held is None:
                    try:
                        held = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if held is None:
                        stopping = True
                        break
                # The source reads the next request only after it sent the answer
                # before it: while answers are owed, send only what its receive
                # buffer surely holds, or both ends would wait on each other.
                if sum(len(r.rows) for r in outstanding) + len(held.rows) > PIPELINE_BYTES:
                    break
                item, held = held, None
                self._send(item, outstanding)
            if outstanding:
                head = outstanding.popleft()
                try:
                    self._receive(head)
                except _Refused:
                    continue
                except _LaneError as exc:
                    self._fail([head, *outstanding], exc)
                    outstanding.clear()
                    continue
                self.queued -= 1
                head.finish()
        if held is not None:
            self._fail([held], _LaneError("closed", "the connection was closed"))
        self._drop()
        while True:  # fail what arrived after the stop
            try:
                late = self.queue.get_nowait()
            except queue.Empty:
                break
            if late is not None:
                self._fail([late], _LaneError("closed", "the connection was closed"))

    def _fail(self, items: Sequence[_Request], exc: _LaneError) -> None:
        self._drop()
        for item in items:
            self.queued -= 1
            item.finish(exc)

    def _send(self, item: _Request, outstanding: collections.deque[_Request]) -> None:
        try:
            if self.sock is not None and not outstanding and _closed_by_peer(self.sock):
                self._drop()  # an idle connection the source closed (it stopped, or restarted)
            if self.sock is None:
                self.connect()
            assert self.sock is not None
            self.sock.settimeout(max(1e-3, item.deadline - time.monotonic()))
            bufs: list[memoryview | bytes] = []
            if item.grant not in self.sent:
                body = self.peer.grant(item.grant).encode()
                bufs += [HEADER.pack(Kind.GRANT, len(body), item.grant, 0), body]
                self.sent[item.grant] = None
                while len(self.sent) > MAX_GRANTS:
                    self.sent.popitem(last=False)
            n = len(item.rows) // READ_ROW.itemsize
            bufs += [HEADER.pack(Kind.READ, n, item.grant, id(item)), item.rows]
            send_all(self.sock, bufs)
        except _LaneError as exc:
            self._fail([item, *outstanding], exc)
            outstanding.clear()
            return
        except OSError as exc:
            self._fail([item, *outstanding], self._classify(exc))
            outstanding.clear()
            return
        outstanding.append(item)

    def _classify(self, exc: OSError) -> _LaneError:
        who = self.peer.info.peer_id
        if isinstance(exc, TimeoutError):
            return _LaneError(
                "timeout",
                f"no answer from {who!r} within the pull deadline of "
                f"{self.peer.owner.pull_timeout} s (stopped, overloaded or unreachable)",
            )
        return _LaneError("lost", f"the connection to {who!r} broke mid-read ({exc})")

    def _receive(self, item: _Request) -> None:
        sock = self.sock
        assert sock is not None
        try:
            sock.settimeout(max(1e-3, item.deadline - time.monotonic()))
            kind, a, _, rid = HEADER.unpack(recv_exact(sock, HEADER.size))
            if rid != id(item):
                raise _LaneError("lost", "the source answered another request: stream out of step")
            if kind == Kind.REFUSED:
                why = recv_exact(sock, a).decode(errors="replace")
                # A refusal is a whole answer: the connection stays good.
                raise _LaneError("refused", why)
            if kind != Kind.DATA:
                raise _LaneError("lost", f"the source sent an unknown frame kind {kind}")
            self._land(sock, item)
        except OSError as exc:
            raise self._classify(exc) from None
        except _LaneError as exc:
            if exc.kind == "refused":
                self.queued -= 1
                item.finish(exc)
                raise _Refused from None
            raise

    def _land(self, sock: socket.socket, item: _Request) -> None:
        total = int(item.nbytes.sum())
        if total <= REQUEST_BYTES and bool((item.nbytes < BIG).all()):
            # Small pieces: one receive into the lane's buffer, then one batched copy
            # (C, GIL released) to their destinations: no Python per piece.
            if self.bounce is None:
                self.bounce = np.empty(REQUEST_BYTES, np.uint8)
            _recv_into(sock, self.bounce.data[:total])
            bases = self.peer.owner._bases
            to = np.fromiter((bases[int(r)] for r in item.dst_region), np.int64, len(item.nbytes))
            to += item.dst_offset
            at = int(self.bounce.ctypes.data) + np.cumsum(item.nbytes) - item.nbytes
            size = np.ascontiguousarray(item.nbytes)
            copy_lib().rfx_copy_batch(len(size), to.ctypes.data, at.ctypes.data, size.ctypes.data)
            return
        views = self.peer.owner._views
        small: list[memoryview] = []
        for r, o, n in zip(
            item.dst_region.tolist(), item.dst_offset.tolist(), item.nbytes.tolist(), strict=True
        ):
            if n == 0:
                continue
            dst = views[r][o : o + n]
            if n >= BIG:
                if small:
                    _recv_scatter(sock, small)
                    small = []
                _recv_into(sock, dst)
            else:
                small.append(dst)
                if len(small) >= IOV_MAX:
                    _recv_scatter(sock, small)
                    small = []
        if small:
            _recv_scatter(sock, small)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection was closed from the other end (a peek, no wait)."""
    sock.settimeout(0)  # with a timeout, Python would wait for data before the peek
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Refused(Exception):
    """A refused request was already finished; the lane goes on."""


def _recv_into(sock: socket.socket, dst: memoryview) -> None:
    got, n = 0, len(dst)
    while got < n:
        k = sock.recv_into(dst[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("the source closed the connection mid-read")
        got += k


def _recv_scatter(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Fill every buffer of ``bufs`` in order, ``IOV_MAX`` per ``recvmsg_into``."""
    i = 0
    while i < len(bufs):
        n = sock.recvmsg_into(bufs[i : i + IOV_MAX])[0]
        if n == 0:
            raise ConnectionError("the source closed the connection mid-read")
        while n and i < len(bufs):
            size = len(bufs[i])
            if n >= size:
                n -= size
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


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
        self.lanes = [_Lane(self, i) for i in range(owner.lanes)]
        self._ids = itertools.count()

    @property
    def epoch(self) -> int:
        """The source's epoch this connection is for."""
        return self.address[2]

    def current_grant(self) -> tuple[int, PeerInfo]:
        return self._current, self._grants[self._current]

    def grant(self, number: int) -> PeerInfo:
        """Grant ``number`` (lane threads call this; `_LaneError` once forgotten)."""
        info = self._grants.get(number)
        if info is None:
            raise _LaneError("refused", f"grant {number} was replaced {KEEP_GRANTS} times since")
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
            if isinstance(first, _LaneError) and first.kind == "auth":
                raise UnauthenticatedPeer(f"connect to {who!r} refused: {first}")
            if isinstance(first, _LaneError):
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
            check.epochs,
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
            for lo, hi in _requests(group["nbytes"])
        ]
        for part in parts:
            rows = np.empty(len(part), READ_ROW)
            rows["region"], rows["offset"] = part["remote_region"], part["remote_offset"]
            rows["nbytes"] = part["nbytes"]
            fut: asyncio.Future[None] = loop.create_future()
            req = _Request(
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
        first = next((e for e in errors if isinstance(e, _LaneError)), None)
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

    async def close(self) -> None:
        self._closed = True


def _requests(sizes: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans of pieces: ≤ ``MAX_READS`` pieces and about
    ``REQUEST_BYTES`` bytes each (a larger single piece is its own span)."""
    spans: list[tuple[int, int]] = []
    lo, n = 0, len(sizes)
    while lo < n:
        csum = np.cumsum(sizes[lo : lo + MAX_READS])
        k = int(np.searchsorted(csum, REQUEST_BYTES, side="right"))
        hi = lo + max(1, min(k, MAX_READS))
        spans.append((lo, hi))
        lo = hi
    return spans


class TcpTransport(Transport):
    """refitd's own TCP data plane (see the module docstring).

    ``lanes`` TCP connections per peer (≥ 1); ``pull_timeout`` (s) the deadline of one
    batch; ``host``/``port`` where the data server listens (port 0: any free one) and
    ``advertise_host`` the address peers connect to (default: ``host``, or this host's
    name when it listens on every address). ``accept(ip)`` says whether a connecting
    host may talk to the data server at all (unanswered otherwise), ``authorize(lease)``
    whether a lease is still live; with ``require_lease`` the data server serves only
    lease-scoped grants. ``epoch`` names this life of the data server (default: now,
    in ns)."""

    scheme = "tcp"

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
        epoch: int | None = None,
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
        self.epoch = epoch if epoch is not None else time.time_ns()
        self._regions: dict[int, LocalRegion] = {}
        self._views: dict[int, memoryview] = {}
        self._bases: dict[int, int] = {}  # region id -> base address of its mapping
        self._served: dict[int, Served] = {}
        self._peers: set[TcpPeer] = set()
        self._server: DataServer | None = None
        self._region_epochs = itertools.count(self.epoch)
        self.closed = True

    @property
    def server(self) -> DataServer:
        if self._server is None:
            raise TransportClosed("tcp transport is not started")
        return self._server

    async def start(self) -> None:
        self._server = DataServer(
            secret=self.secret,
            epoch=self.epoch,
            regions=self._served,
            host=self.host,
            port=self.port,
            accept=self.accept,
            authorize=self.authorize,
            require_lease=self.require_lease,
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

    async def register(self, region_id: int, segment: Segment) -> LocalRegion:
        if self.closed:
            raise TransportClosed("register refused: tcp transport is closed")
        view = _view(segment)
        epoch = next(self._region_epochs)
        info = RegionInfo(region_id, epoch, 0, segment.size)
        region = LocalRegion(region_id, segment, info)
        self._regions[region_id] = region
        self._views[region_id] = view
        self._bases[region_id] = segment.address
        self._served[region_id] = Served(epoch, segment.size, view, segment.address)
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
            address=msgspec.msgpack.encode((host, port, self.epoch)),
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

    async def connect(self, info: PeerInfo) -> TcpPeer:
        if self.closed:
            raise TransportClosed("connect refused: tcp transport is closed")
        self._check_record(info)
        peer = TcpPeer(self, info)
        await peer.open()
        self._peers.add(peer)
        return peer
