"""Who the ``tcp`` data server lets start a handshake, and how many at once.

A connection costs the server a thread and a slot from the moment it is admitted, and
proves nothing until its handshake shows the deployment secret. So admission runs in
the accepting thread, before either is spent, and counts a connection as *pending*
until its handshake succeeded:

- a connection from a process of this host (over loopback, or to one of the host's
  own addresses) is answered only for the uids in ``loopback_uids`` (by default the
  server's own and root: the only local users the threat model does not protect
  against, docs/trust.md). Its uid is the owner of the client's socket, as the kernel
  lists it in ``/proc/net/tcp`` (``tcp6``): a client socket found there is local,
  one not found is another host's; a loopback connection not found there (gone
  already) is refused;
- pending handshakes are bounded per source address and in all. Every loopback address
  is one address (a local user may connect from any of 127.0.0.0/8), an IPv4-mapped
  IPv6 address is its IPv4 address, and an IPv6 address counts by its /64 (what one
  host is usually given);
- established connections (a handshake succeeded) are bounded in all, apart from the
  pending ones: a flood of handshakes that never finish takes no established slot,
  and a new connection is admitted only while one is free.

:class:`Admission` holds the counts; the data server (`transports.tcp.serve`) asks it
and tells it when a handshake ends. A connection refused with a reason is closed by
:class:`Refuser`, which lets the client read that reason first.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Collection

from .frames import refusal

__all__ = ["Admission", "Refuser", "address_key", "default_loopback_uids", "local_peer_uid"]


def default_loopback_uids() -> frozenset[int]:
    """The server's own uid and root: local users the threat model trusts anyway."""
    return frozenset({os.getuid(), 0})


def address_key(host: str) -> str:
    """The address a connection from ``host`` is counted under (see the module
    docstring)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


def is_loopback(host: str) -> bool:
    return address_key(host) == "loopback"


def _proc_address(text: str) -> str:
    """An address of ``/proc/net/tcp[6]`` (hex words in host byte order) as text."""
    words = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return str(ipaddress.ip_address(socket.inet_ntop(family, raw)))


def local_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of ``sock``, an accepted connection, when that end
    is a socket of this host (of this network namespace); None when the kernel lists
    no such socket here (another host's, or closed already)."""
    here = sock.getsockname()
    there = sock.getpeername()
    me = (ipaddress.ip_address(here[0].split("%", 1)[0]), here[1])
    peer = (ipaddress.ip_address(there[0].split("%", 1)[0]), there[1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 8:
                continue
            local, remote = cols[1], cols[2]
            lport, rport = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
            # the client's socket: its local end is our peer, its remote end is us
            if lport != peer[1] or rport != me[1]:
                continue
            if _same(_proc_address(local.rsplit(":", 1)[0]), peer[0]) and _same(
                _proc_address(remote.rsplit(":", 1)[0]), me[0]
            ):
                return int(cols[7])
    return None


def _same(text: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    a = ipaddress.ip_address(text)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    b = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
    return a == b


class Admission:
    """The data server's counts of pending handshakes (per address key and in all) and
    of connections (pending and established); thread-safe."""

    def __init__(
        self,
        *,
        max_connections: int,
        max_pending: int,
        max_pending_per_address: int,
        loopback_uids: Collection[int] | None,
    ) -> None:
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.max_pending_per_address = max_pending_per_address
        self.loopback_uids = (
            default_loopback_uids() if loopback_uids is None else frozenset(loopback_uids)
        )
        self._pending: Counter[str] = Counter()
        self._established = 0
        self._lock = threading.Lock()

    def local_user_trusted(self, sock: socket.socket, host: str) -> bool:
        """False for a connection from a process of this host whose uid is not in
        ``loopback_uids`` (and for a loopback one the kernel no longer lists)."""
        try:
            uid = local_peer_uid(sock)
        except (OSError, ValueError):
            return False
        if uid is None:
            return not is_loopback(host)  # another host's, unless it came over loopback
        return uid in self.loopback_uids

    def admit(self, key: str) -> str | None:
        """Count a new connection from address ``key`` as pending; or why it is refused
        (short: it travels in a REFUSAL frame), counting nothing."""
        with self._lock:
            if self._pending[key] >= self.max_pending_per_address:
                return f"{self.max_pending_per_address} handshakes pending from this address"
            if sum(self._pending.values()) >= self.max_pending:
                return f"{self.max_pending} handshakes pending in all"
            if self._established >= self.max_connections:
                return f"all {self.max_connections} connections taken"
            self._pending[key] += 1
        return None

    def handshake_ended(self, key: str, proved: bool) -> bool:
        """The pending connection from ``key`` ended its handshake (``proved``: it
        succeeded). Whether it is now established: False when it failed, or when every
        connection slot was taken meanwhile."""
        with self._lock:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]
            if not proved or self._established >= self.max_connections:
                return False
            self._established += 1
            return True

    def closed(self) -> None:
        """An established connection closed."""
        with self._lock:
            self._established -= 1

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(self._pending.values())


class Refuser:
    """Closes refused connections gracefully, from one thread: the REFUSAL is sent, the
    write side shut, and what the client still sends (its HELLO) read and dropped until
    it closes or ``LINGER_S`` passes; closing with its HELLO unread would reset the
    connection, and the client could lose the reason. At most ``MAX_LINGERING`` at
    once: past that a refused connection is closed at once."""

    LINGER_S = 2.0
    MAX_LINGERING = 128

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._until: dict[socket.socket, float] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tcp-data-refuser", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def refuse(self, conn: socket.socket, why: str) -> None:
        """Answer ``conn`` with a REFUSAL saying ``why``; never waits on it."""
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(refusal(why))
            conn.shutdown(socket.SHUT_WR)
        with self._lock:
            if self._closed or len(self._until) >= self.MAX_LINGERING:
                conn.close()
                return
            self._until[conn] = time.monotonic() + self.LINGER_S
            self._selector.register(conn, selectors.EVENT_READ)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                for conn in [c for c, t in self._until.items() if t <= now]:
                    self._drop(conn)
                wait = min(self._until.values(), default=now + 1.0) - now
            for key, _ in self._selector.select(max(wait, 0.01)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        sock.recv(4096)
                    continue
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        self._drop(sock)

    def _drop(self, conn: socket.socket) -> None:
        if self._until.pop(conn, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for conn in list(self._until):
                self._drop(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread.is_alive():
            self._thread.join(5)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
