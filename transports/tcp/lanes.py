"""The ``tcp`` transport's reading side: one lane is one TCP connection to a peer's
data server and the thread that services it (`transports.tcp` owns the lanes).

A lane's thread takes requests from its queue, sends them ahead (``WINDOW`` at most,
and only as many request bytes as any receive buffer holds, ``PIPELINE_BYTES``: the
source reads the next request only after answering the one before) and receives the
answers in order: large pieces straight into the destination with ``recv_into``,
requests of small pieces into the lane's buffer and on to their destinations with
one batched C copy. A request's deadline is the socket timeout while it is owed. Any
failure fails the request and every one after it on the lane and closes the
connection (its stream is then in an unknown state); the next request connects
again. A REFUSED answer fails only its request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..batch import read_spans
from ..interface import PeerInfo
from ..local import CopyFault, copy_batch_guarded
from .frames import (
    CHALLENGE,
    HEADER,
    HELLO,
    MAGIC,
    MAX_GRANTS,
    MAX_READS,
    PROOF,
    READ_ROW,
    Kind,
    client_proof,
    refusal_reason,
    server_proof,
)
from .serve import IOV_MAX, recv_exact, send_all, tune


class LaneOwner(Protocol):
    """What a lane reads of its transport (``TcpTransport``): the deployment secret,
    its server's life, the pull deadline (s), and where its regions are mapped."""

    @property
    def secret(self) -> bytes: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def pull_timeout(self) -> float: ...
    @property
    def _views(self) -> dict[int, memoryview]: ...
    @property
    def _bases(self) -> dict[int, int]: ...


class LanePeer(Protocol):
    """What a lane reads of the connection it belongs to (``TcpPeer``): the peer's
    ``(host, port, incarnation)``, its record, the grant reads are checked against
    (the current one, or one by number) and the transport that owns it."""

    @property
    def owner(self) -> LaneOwner: ...
    @property
    def info(self) -> PeerInfo: ...
    @property
    def address(self) -> tuple[str, int, int]: ...

    def current_grant(self) -> tuple[int, PeerInfo]: ...
    def grant(self, number: int) -> PeerInfo: ...


__all__ = ["BIG", "REQUEST_BYTES", "Lane", "LaneError", "Request", "request_spans"]

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


class LaneError(Exception):
    """A lane's failure, told to the batch it failed: ``kind`` is "lost" (the
    connection broke or was refused), "timeout", "refused" (the source refused a
    read), "restarted" (another incarnation answered), "auth", or "busy" (the data
    server had no room for another connection, and said so)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(eq=False)
class Request:
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


class Lane:
    """One TCP connection to the peer and the thread that services it."""

    def __init__(self, peer: LanePeer, index: int) -> None:
        self.peer = peer
        self.index = index
        self.queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
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
        """Connect and authenticate (raises `LaneError`)."""
        p = self.peer
        host, port, incarnation = p.address
        timeout = min(10.0, p.owner.pull_timeout)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise LaneError("lost", f"cannot connect to {host}:{port}: {exc}") from None
        try:
            tune(sock)
            cn = os.urandom(16)
            mine = p.owner.incarnation
            sock.sendall(HELLO.pack(MAGIC, mine, incarnation, cn))
            try:
                answer = recv_exact(sock, CHALLENGE.size)
            except ConnectionError:
                raise LaneError(
                    "auth",
                    f"{host}:{port} closed the connection unanswered: this host (or, over "
                    "loopback, this host's user) is not a trusted peer there, or it is no "
                    "refitd tcp data server",
                ) from None
            why = refusal_reason(answer)
            if why is not None:
                raise LaneError(
                    "busy",
                    f"the data server at {host}:{port} refused the connection before its "
                    f"handshake: {why}",
                )
            se, sn, smac = CHALLENGE.unpack(answer)
            if se != incarnation:
                raise LaneError(
                    "restarted",
                    f"the source restarted: {host}:{port} now runs incarnation {se}, the record "
                    f"names incarnation {incarnation}; fetch its new record",
                )
            if smac != server_proof(p.owner.secret, cn, sn, mine, se):
                raise LaneError(
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
                raise LaneError(
                    "auth",
                    f"{host}:{port} refused our proof or record (another deployment secret, "
                    "or a record it does not serve)",
                ) from None
        except LaneError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise LaneError("lost", f"handshake with {host}:{port} failed: {exc}") from None
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
        outstanding: collections.deque[Request] = collections.deque()
        held: Request | None = None  # taken from the queue, waiting for room to send
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
                except LaneError as exc:
                    self._fail([head, *outstanding], exc)
                    outstanding.clear()
                    continue
                self.queued -= 1
                head.finish()
        if held is not None:
            self._fail([held], LaneError("closed", "the connection was closed"))
        self._drop()
        while True:  # fail what arrived after the stop
            try:
                late = self.queue.get_nowait()
            except queue.Empty:
                break
            if late is not None:
                self._fail([late], LaneError("closed", "the connection was closed"))

    def _fail(self, items: Sequence[Request], exc: LaneError) -> None:
        self._drop()
        for item in items:
            self.queued -= 1
            item.finish(exc)

    def _send(self, item: Request, outstanding: collections.deque[Request]) -> None:
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
        except LaneError as exc:
            self._fail([item, *outstanding], exc)
            outstanding.clear()
            return
        except OSError as exc:
            self._fail([item, *outstanding], self._classify(exc))
            outstanding.clear()
            return
        outstanding.append(item)

    def _classify(self, exc: OSError) -> LaneError:
        who = self.peer.info.peer_id
        if isinstance(exc, TimeoutError):
            return LaneError(
                "timeout",
                f"no answer from {who!r} within the pull deadline of "
                f"{self.peer.owner.pull_timeout} s (stopped, overloaded or unreachable)",
            )
        return LaneError("lost", f"the connection to {who!r} broke mid-read ({exc})")

    def _receive(self, item: Request) -> None:
        sock = self.sock
        assert sock is not None
        try:
            sock.settimeout(max(1e-3, item.deadline - time.monotonic()))
            kind, a, _, rid = HEADER.unpack(recv_exact(sock, HEADER.size))
            if rid != id(item):
                raise LaneError("lost", "the source answered another request: stream out of step")
            if kind == Kind.REFUSED:
                why = recv_exact(sock, a).decode(errors="replace")
                # A refusal is a whole answer: the connection stays good.
                raise LaneError("refused", why)
            if kind != Kind.DATA:
                raise LaneError("lost", f"the source sent an unknown frame kind {kind}")
            self._land(sock, item)
        except CopyFault as exc:
            # A destination shrunk under its mapping by its client: this read fails
            # (its ranges suspect), the process lives on.
            raise LaneError("lost", f"landing the bytes failed: {exc}") from None
        except OSError as exc:
            raise self._classify(exc) from None
        except LaneError as exc:
            if exc.kind == "refused":
                self.queued -= 1
                item.finish(exc)
                raise _Refused from None
            raise

    def _land(self, sock: socket.socket, item: Request) -> None:
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
            copy_batch_guarded(to, at, size)  # a client may shrink the destination
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


def request_spans(sizes: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans of pieces: ≤ ``MAX_READS`` pieces and about
    ``REQUEST_BYTES`` bytes each (a larger single piece is its own span)."""
    return read_spans(sizes, MAX_READS, REQUEST_BYTES)
