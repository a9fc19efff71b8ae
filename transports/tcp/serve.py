"""The ``tcp`` data plane's source side: a data server that sends from the mapping.

One listening socket; one thread per data connection, blocking I/O (every send and
receive releases the GIL, so a busy event loop in the daemon does not slow the
wire, and one slow connection holds up only itself). Per connection, in order:

1. admission, in the accepting thread, before a thread or a slot is spent on it: a
   peer whose address ``accept`` refuses, or a loopback connection of a uid not in
   ``loopback_uids`` (by default the server's own and root: the ones the threat model
   does not protect against), is closed unanswered (not a byte sent); a connection past
   the bounds on pending handshakes (``max_pending_per_address``, every loopback address
   counting as one, and ``max_pending``) or on connections (``max_connections``) is
   answered with a refusal that says which (`frames.refusal`) and closed;
2. the handshake of `transports.tcp.frames` (a proof of the deployment secret from each
   side, bound to both incarnations and to the grant the connection opens with), all of
   it within ``handshake_s`` (a deadline for the whole handshake, not for each byte);
   only then is the connection counted as established, and no longer as pending;
3. frames: a GRANT (a signed record: which regions, which generations, which byte ranges,
   under which lease) is verified and kept (the newest ``MAX_GRANTS``); every READ
   names one of them and is checked whole against it (`frames.check_scope`), and
   against the lease's liveness (``authorize``), before a byte is sent. A refused
   READ gets a REFUSED frame; a malformed frame closes its connection only.
4. held reads: a READ of bytes the daemon is still filling (a relay's mirror, whose
   downstream reads ahead of it) is held, after the checks of 3 and before a byte is
   sent, until ``hold`` (a :class:`Completion`) says those bytes are complete, then
   checked again (the lease may have ended, the region gone) and answered; it is
   refused when they do not complete within ``hold_s`` or their fill failed. A
   connection holds one read at a time (it answers in order), and one peer address
   at most ``MAX_HELD_PER_ADDRESS``: a read past that is refused, not held.

Data goes out with ``sendmsg`` of memoryviews of the region's mapping: no staging
copy; small pieces are gathered, up to ``IOV_MAX`` per system call.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError

from ..interface import PeerInfo
from ..local import CopyFault, copy_batch_guarded
from .admission import Admission, Refuser, address_key
from .frames import (
    CHALLENGE,
    HEADER,
    HELLO,
    MAGIC,
    MAX_GRANT_BYTES,
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
from .held import HOLD_S, Completion, Holds

__all__ = [
    "IOV_MAX",
    "DataServer",
    "Served",
    "recv_exact",
    "send_all",
    "tune",
]

log = logging.getLogger("refitd.dataplane")

IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
HANDSHAKE_S = 10.0
"""Seconds a new connection has for its whole handshake (not for each byte of it)."""
MAX_CONNECTIONS = 256
"""Established connections the data server holds at once."""
MAX_PENDING = 256
"""Handshakes in progress at once, from every address together."""
MAX_PENDING_PER_ADDRESS = 64
"""Handshakes in progress at once from one address (every loopback address is one): as
many as one peer daemon's lanes (``data_plane.lanes`` is at most 64), which connect at
once."""
BUFFER = 4 << 20
"""Socket buffer asked for on both ends (bytes), where the host allows that much."""


@dataclass(frozen=True)
class Served:
    """A region the server may send from: its registration generation, size (bytes) and a
    byte view of the mapping (holding it keeps the mapping alive)."""

    generation: int
    size: int
    view: memoryview
    address: int  # of the mapping's first byte, in this process


def tune(sock: socket.socket) -> None:
    """``TCP_NODELAY`` (a small read's reply goes out now, not after an ACK), and
    ``BUFFER``-sized socket buffers where ``net.core.[rw]mem_max`` allows them (a
    smaller cap would switch off the kernel's autotuning for less)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, cap in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
        try:
            with open(f"/proc/sys/net/core/{cap}") as f:
                limit = int(f.read())
        except (OSError, ValueError):
            continue
        if limit >= BUFFER:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes; ConnectionError when the peer closes first, TimeoutError
    when ``deadline`` (``time.monotonic()``) passes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the handshake deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the connection closed")
        got += k
    return bytes(buf)


def send_all(sock: socket.socket, bufs: list[memoryview | bytes]) -> None:
    """Send every buffer, gathered ``IOV_MAX`` at a time (``sendmsg``), in order."""
    i = 0
    while i < len(bufs):
        n = sock.sendmsg(bufs[i : i + IOV_MAX])
        while n and i < len(bufs):
            size = len(bufs[i])
            if n >= size:
                n -= size
                i += 1
            else:
                bufs[i] = memoryview(bufs[i])[n:]
                n = 0
        while i < len(bufs) and len(bufs[i]) == 0:
            i += 1


GATHER_PIECE = 64 << 10
"""Pieces under this size (bytes) are gathered into a buffer and sent in one call."""
GATHER_BYTES = 4 << 20
"""A request of small pieces up to this many bytes in all is gathered (the buffer
each connection allocates on its first such request)."""


class _Connection:
    """One data connection's socket and its gather buffer (made on first use)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer: npt.NDArray[np.uint8] | None = None

    def buffer(self) -> npt.NDArray[np.uint8]:
        if self._buffer is None:
            self._buffer = np.empty(GATHER_BYTES, np.uint8)
        return self._buffer


class DataServer:
    """Serves reads of ``regions`` (region id -> `Served`, read at each request, so a
    registration made later is served and a dropped one is not).

    ``accept(address)`` says whether a connecting host may talk to us at all (None:
    any; it runs in the accepting thread, so it must be quick); ``loopback_uids`` which
    local users may connect over loopback (None: this process's uid and root);
    ``authorize(lease)`` whether a lease is still live (None: every lease); with
    ``require_lease`` a grant without a lease scope on every region is refused.
    ``handshake_s``, ``max_connections``, ``max_pending`` and
    ``max_pending_per_address``, ``hold`` and ``hold_s``: see the module docstring.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        incarnation: int,
        regions: dict[int, Served],
        host: str,
        port: int,
        accept: Callable[[str], bool] | None = None,
        authorize: Callable[[str], bool] | None = None,
        require_lease: bool = False,
        max_connections: int = MAX_CONNECTIONS,
        max_pending: int = MAX_PENDING,
        max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
        loopback_uids: Collection[int] | None = None,
        handshake_s: float = HANDSHAKE_S,
        hold: Completion | None = None,
        hold_s: float = HOLD_S,
    ) -> None:
        self.secret = secret
        self.incarnation = incarnation
        self.regions = regions
        self.accept = accept
        self.authorize = authorize
        self.require_lease = require_lease
        self.handshake_s = handshake_s
        #: reads of bytes still filling, held until complete (`transports.tcp.held`)
        self.holds = Holds(hold, hold_s)
        self.admission = Admission(
            max_connections=max_connections,
            max_pending=max_pending,
            max_pending_per_address=max_pending_per_address,
            loopback_uids=loopback_uids,
        )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._refuser = Refuser()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"tcp-data-server-{self.address[1]}", daemon=True
        )
        #: connections closed because of a malformed frame or failed handshake
        self.dropped = 0
        #: connections refused before their handshake (untrusted, or no room)
        self.refused = 0

    def start(self) -> None:
        self._refuser.start()
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and cut every connection (their threads then end)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._refuser.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            host = addr[0]
            why = self._untrusted(conn, host)
            if why is not None:
                self.refused += 1
                log.warning("tcp data connection from %s closed unanswered: %s", host, why)
                conn.close()
                continue
            key = address_key(host)
            full = self.admission.admit(key)
            if full is not None:
                self.refused += 1
                log.warning("tcp data connection from %s refused: %s", host, full)
                self._refuser.refuse(conn, full)
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, host, key), name="tcp-data-conn", daemon=True
            ).start()

    def _untrusted(self, conn: socket.socket, host: str) -> str | None:
        """Why a connection from ``host`` is closed unanswered, or None."""
        if self.accept is not None and not self.accept(host):
            return "not a trusted peer's host"
        if not self.admission.local_user_trusted(conn, host):
            return "a connection of a local user this server does not trust"
        return None

    def _serve(self, conn: socket.socket, host: str, key: str) -> None:
        pending, established = True, False
        try:
            grants = None
            try:
                grants = self._handshake(conn, time.monotonic() + self.handshake_s)
            except TimeoutError:
                log.warning(
                    "tcp data connection from %s closed: no handshake within %.1f s",
                    host,
                    self.handshake_s,
                )
            finally:
                established = self.admission.handshake_ended(key, grants is not None)
                pending = False
            if grants is None or not established:
                self.dropped += 1
                return
            conn.settimeout(None)
            tune(conn)
            self._requests(conn, grants, key)
        except CopyFault as exc:  # a source shrunk under its mapping by its client
            log.warning("tcp data connection from %s closed: %s", host, exc)
        except (OSError, ValueError, ProtocolError, msgspec.MsgspecError, struct.error):
            pass  # this connection only
        finally:
            if pending:
                self.admission.handshake_ended(key, False)
            if established:
                self.admission.closed()
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(
        self, conn: socket.socket, deadline: float
    ) -> collections.OrderedDict[int, Grant] | None:
        """The handshake, all of it by ``deadline`` (TimeoutError otherwise); the
        connection's grants, or None when it failed."""
        magic, ce, want, cn = HELLO.unpack(recv_exact(conn, HELLO.size, deadline))
        if magic != MAGIC:
            return None
        sn = os.urandom(16)
        conn.sendall(
            CHALLENGE.pack(
                self.incarnation, sn, server_proof(self.secret, cn, sn, ce, self.incarnation)
            )
        )
        if want != self.incarnation:
            return None  # the client asked for another life of this server
        (proof,) = PROOF.unpack(recv_exact(conn, PROOF.size, deadline))
        kind, size, number, _ = HEADER.unpack(recv_exact(conn, HEADER.size, deadline))
        if kind != Kind.GRANT or size > MAX_GRANT_BYTES:
            return None
        info = PeerInfo.decode(recv_exact(conn, size, deadline))
        want_proof = client_proof(self.secret, cn, sn, ce, self.incarnation, info.mac)
        if not hmac.compare_digest(proof, want_proof):
            return None
        grant = self._grant(info)
        if grant is None:
            return None
        conn.sendall(b"\x01")
        return collections.OrderedDict({number: grant})

    def _grant(self, info: PeerInfo) -> Grant | None:
        try:
            info.verify(self.secret)
            grant = Grant(info)
        except (ProtocolError, ValueError, msgspec.MsgspecError):
            return None
        if self.require_lease and not grant.scoped:
            return None
        return grant

    def _requests(
        self, conn: socket.socket, grants: collections.OrderedDict[int, Grant], key: str
    ) -> None:
        state = _Connection(conn)
        while True:
            try:
                head = recv_exact(conn, HEADER.size)
            except ConnectionError:
                return  # the client is done
            kind, a, b, rid = HEADER.unpack(head)
            if kind == Kind.GRANT:
                if a > MAX_GRANT_BYTES:
                    self.dropped += 1
                    return
                grant = self._grant(PeerInfo.decode(recv_exact(conn, a)))
                if grant is None:
                    self.dropped += 1
                    return
                grants[b] = grant
                while len(grants) > MAX_GRANTS:
                    grants.popitem(last=False)
            elif kind == Kind.READ:
                if a > MAX_READS or b not in grants:
                    self.dropped += 1
                    return
                rows = np.frombuffer(recv_exact(conn, a * READ_ROW.itemsize), READ_ROW)
                self._answer(state, grants[b], rid, rows, key)
            else:
                self.dropped += 1
                return

    def _answer(
        self, conn: _Connection, grant: Grant, rid: int, rows: np.ndarray, key: str
    ) -> None:
        why = self._refusal(grant, rows)
        if why is None and self.holds.pending(rows):
            # checked again after the wait: the lease may have ended, the region gone
            why = self.holds.wait(rows, key) or self._refusal(grant, rows)
        sock = conn.sock
        if why is not None:
            text = why.encode()
            send_all(sock, [HEADER.pack(Kind.REFUSED, len(text), 0, rid), text])
            return
        regions = self.regions
        n = rows["nbytes"]
        total = int(n.sum())
        if total <= GATHER_BYTES and bool((n < GATHER_PIECE).all()):
            # Small pieces: gathered by one batched copy (C, GIL released) into this
            # connection's buffer and sent in one go, no Python per piece.
            bounce = conn.buffer()
            src = np.fromiter(
                (regions[int(r)].address for r in rows["region"]), np.int64, len(rows)
            )
            src += rows["offset"]
            dst = int(bounce.ctypes.data) + np.cumsum(n) - n
            size = np.ascontiguousarray(n)
            copy_batch_guarded(dst, src, size)  # a client may shrink the source under us
            send_all(sock, [HEADER.pack(Kind.DATA, 0, 0, rid), bounce.data[:total]])
            return
        bufs: list[memoryview | bytes] = [HEADER.pack(Kind.DATA, 0, 0, rid)]
        for r, o, n in zip(
            rows["region"].tolist(), rows["offset"].tolist(), rows["nbytes"].tolist(), strict=True
        ):
            if n:
                bufs.append(regions[r].view[o : o + n])
        send_all(sock, bufs)

    def _refusal(self, grant: Grant, rows: np.ndarray) -> str | None:
        if grant.lease and self.authorize is not None and not self.authorize(grant.lease):
            return f"lease {grant.lease!r} is no longer live on this source"
        regions = dict(self.regions)
        bad = check_scope(
            grant,
            rows["region"],
            rows["offset"],
            rows["nbytes"],
            {k: v.generation for k, v in regions.items()},
            {k: v.size for k, v in regions.items()},
        )
        if bad is None:
            return None
        i, why = bad
        return f"read #{i} refused by the source: {why}"
