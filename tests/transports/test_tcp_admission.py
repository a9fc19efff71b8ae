"""Who the ``tcp`` data server admits, and when it counts a connection.

A connection is counted as pending until its handshake proves the deployment secret,
and a pending one has a deadline for the whole handshake, not per byte. Pending
handshakes are bounded per source address (every loopback address is one) and in all;
a loopback connection is answered only for the uids the threat model does not protect
against (the server's own, and root). A refusal for room says so, so a puller's error
names what happened instead of blaming trust.

Real sockets and real data servers throughout; the hostile clients speak the wire by
hand with `transports.tcp.frames`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import numpy as np
import pytest

from transports.interface import TransportError, UnauthenticatedPeer
from transports.segments import SharedSegment
from transports.tcp import TcpTransport, parse_address
from transports.tcp.frames import CHALLENGE, HEADER, HELLO, MAGIC, PROOF, Kind

pytestmark = pytest.mark.timeout(120)

SECRET = b"tcp-admission-secret-0123456789ab"
SIZE = 1 << 20
SAFETY_S = 60.0
"""Safety net of a wait on the server (never what a test measures)."""


def non_loopback_address() -> str | None:
    """An address of this host that is not loopback (a connection to it from here is
    seen from that address), or None when the host has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        host: str = s.getsockname()[0]
    return None if host.startswith("127.") or host == "0.0.0.0" else host


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (reads end) within the safety net, having sent
    nothing."""
    sock.settimeout(SAFETY_S)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def hold(host: str, port: int, source: str = "") -> socket.socket:
    """A connection that never says a word (a pending handshake)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source:
        s.bind((source, 0))
    s.settimeout(SAFETY_S)
    s.connect((host, port))
    return s


def first_answer(host: str, port: int, incarnation: int, source: str = "") -> bytes:
    """What the server sends to a well-formed HELLO (from address ``source``): a
    CHALLENGE, a refusal, or b""."""
    where = (source, 0) if source else None
    with socket.create_connection((host, port), timeout=SAFETY_S, source_address=where) as s:
        s.sendall(HELLO.pack(MAGIC, 1, incarnation, os.urandom(16)))
        got = b""
        while len(got) < CHALLENGE.size:
            try:
                part = s.recv(CHALLENGE.size - len(got))
            except ConnectionResetError:  # closed with our HELLO unread
                break
            if not part:
                break
            got += part
        return got


async def test_a_handshake_sent_one_byte_at_a_time_is_cut_at_the_handshake_deadline() -> None:
    async with TcpTransport(secret=SECRET, handshake_s=1.0) as source:
        host, port, incarnation = parse_address(source.advertise().address)
        # a well-formed start that never ends: HELLO, a proof, a grant of 100 kB
        endless = (
            HELLO.pack(MAGIC, 1, incarnation, os.urandom(16))
            + bytes(PROOF.size)
            + HEADER.pack(Kind.GRANT, 100_000, 0, 0)
            + bytes(100_000)
        )

        def trickle() -> int:
            """Bytes sent before the server cut the connection (each one well within
            any per-byte timeout), or -1 when it never did."""
            with socket.create_connection((host, port), timeout=SAFETY_S) as s:
                for i in range(int(SAFETY_S / 0.1)):
                    try:
                        s.sendall(endless[i : i + 1])
                    except OSError:
                        return i
                    time.sleep(0.1)
                    if _peer_closed(s):
                        return i + 1
            return -1

        sent = await asyncio.to_thread(trickle)
        assert sent != -1, "the server kept a connection that never finished its handshake"
        assert source.server.connections == 0


def _peer_closed(s: socket.socket) -> bool:
    """Whether the other end closed ``s`` (what it sent before is read and dropped)."""
    s.setblocking(False)
    try:
        while True:
            if s.recv(4096) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)
        s.settimeout(SAFETY_S)


async def test_pending_handshakes_past_the_per_address_limit_are_refused_naming_the_limit() -> None:
    # the held connections stay pending for the whole test (a long handshake deadline)
    async with TcpTransport(
        secret=SECRET, max_pending_per_address=3, handshake_s=SAFETY_S
    ) as source:
        host, port, incarnation = parse_address(source.advertise().address)
        with contextlib.ExitStack() as held:
            for _ in range(3):
                held.enter_context(await asyncio.to_thread(hold, host, port))
            # another loopback address is the same address: a local user picks any of them
            answer = await asyncio.to_thread(first_answer, host, port, incarnation, "127.0.0.2")
            assert answer[:8] == bytes(8), "a fourth pending handshake from loopback was answered"
            assert b"handshakes pending from this address" in answer
            async with TcpTransport(secret=SECRET) as puller:
                with pytest.raises(TransportError, match="handshakes pending") as err:
                    await puller.connect(source.advertise())
                assert "trusted" not in str(err.value)


async def test_a_peer_at_another_address_connects_and_reads_while_loopback_is_saturated() -> None:
    elsewhere = non_loopback_address()
    if elsewhere is None:
        pytest.skip("this host has no address but loopback")
    with (
        SharedSegment.create(SIZE, "src") as src,
        SharedSegment.create(SIZE, "dst") as dst,
    ):
        src.numpy()[:] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
        async with TcpTransport(
            secret=SECRET,
            host="0.0.0.0",
            advertise_host=elsewhere,
            max_pending_per_address=4,
            max_connections=8,
            handshake_s=SAFETY_S,
        ) as source:
            await source.register(11, src)
            port = source.server.address[1]
            with contextlib.ExitStack() as held:
                for _ in range(4):
                    held.enter_context(await asyncio.to_thread(hold, "127.0.0.1", port))
                async with TcpTransport(secret=SECRET, lanes=2) as puller:
                    await puller.register(7, dst)
                    async with await puller.connect(source.advertise()) as peer:
                        await peer.get([(7, 0, 11, 0, SIZE)])
                assert np.array_equal(dst.numpy(), src.numpy())


async def test_a_full_data_server_says_it_is_full_instead_of_blaming_trust() -> None:
    async with (
        TcpTransport(secret=SECRET, max_connections=2) as source,
        TcpTransport(secret=SECRET, lanes=2) as first,
        TcpTransport(secret=SECRET, lanes=1) as second,
    ):
        peer = await first.connect(source.advertise())
        with pytest.raises(TransportError, match="connections") as err:
            await second.connect(source.advertise())
        assert "not a trusted peer" not in str(err.value)
        await peer.close()


def _connect_as(uid: int, host: str, port: int, incarnation: int) -> bytes:
    """From a child process running as ``uid``: what the server answers a HELLO."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, ask, report, exit without cleanup
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, first_answer(host, port, incarnation) or b"<closed>")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return got


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
async def test_a_loopback_connection_of_another_uid_is_closed_unanswered_and_holds_no_slot() -> (
    None
):
    async with TcpTransport(secret=SECRET, max_pending_per_address=2) as source:
        host, port, incarnation = parse_address(source.advertise().address)
        for _ in range(4):  # more than the pending limit: none of them counted
            answer = await asyncio.to_thread(_connect_as, 65534, host, port, incarnation)
            assert answer == b"<closed>"
        # the daemon's own uid is answered with a challenge
        answer = await asyncio.to_thread(first_answer, host, port, incarnation)
        assert len(answer) == CHALLENGE.size and answer[:8] != bytes(8)
        async with TcpTransport(secret=SECRET, lanes=1) as puller:  # one handshake
            peer = await puller.connect(source.advertise())
            await peer.close()


async def test_a_connection_refused_for_trust_says_the_host_or_user_is_not_trusted() -> None:
    async with (
        TcpTransport(secret=SECRET, accept=lambda host: False) as source,
        TcpTransport(secret=SECRET) as puller,
    ):
        with pytest.raises(UnauthenticatedPeer, match="not a trusted peer"):
            await puller.connect(source.advertise())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
async def test_a_local_user_reaching_the_hosts_own_address_is_closed_unanswered_too() -> None:
    """Not only loopback: a local process that connects to one of this host's own
    addresses is still a local user, whose uid decides."""
    elsewhere = non_loopback_address()
    if elsewhere is None:
        pytest.skip("this host has no address but loopback")
    async with TcpTransport(secret=SECRET, host="0.0.0.0", advertise_host=elsewhere) as source:
        _, port, incarnation = parse_address(source.advertise().address)
        answer = await asyncio.to_thread(_connect_as, 65534, elsewhere, port, incarnation)
        assert answer == b"<closed>"
        assert source.server.refused >= 1
        answer = await asyncio.to_thread(first_answer, elsewhere, port, incarnation)
        assert len(answer) == CHALLENGE.size and answer[:8] != bytes(8)
