"""The ``tcp`` data plane: its trust rules at the source, and its faults.

Real sockets on loopback throughout. Where a test needs a client that breaks the
protocol (reads outside its grant, garbage frames, a wrong secret), it speaks the
wire itself with `transports.tcp.frames`: the real data server answers it. Sources
that hang or die are real processes (`transports.servepeer --scheme tcp`) stopped
with SIGSTOP or killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import numpy as np
import pytest
from support.peers import peer_process

from refitd.errors import TransportError
from transports.checks import LOCAL, REMOTE, Pair, expect, open_pair, shuffled_batch
from transports.interface import (
    AdvertisedRegion,
    PeerInfo,
    PeerLost,
    PullFailed,
    ReadRefused,
    UnauthenticatedPeer,
)
from transports.segments import SHM_DIR, SharedSegment
from transports.servepeer import REGION_ID, pattern
from transports.tcp import TcpPeer, TcpTransport, parse_address, scoped_grant
from transports.tcp.frames import (
    CHALLENGE,
    HEADER,
    HELLO,
    MAGIC,
    PROOF,
    READ_ROW,
    Kind,
    ScopeKey,
    client_proof,
    scope_key,
)
from transports.tcp.serve import recv_exact

pytestmark = pytest.mark.timeout(120)

SECRET = b"tcp-test-secret-0123456789abcdef"
SIZE = 4 << 20
DEADLINE_S = 3.0
# The deadline of the stopped-source test: healthy B's whole pull (connect, 4 MiB) must fit
# inside it on a loaded 2-core machine, or B itself times out. Generous by design; the test
# waits it out once, for stopped A.
STOPPED_SOURCE_DEADLINE_S = 10.0
PIECE = 64 << 10


def scoped(
    info: PeerInfo, lease: str, extents: list[tuple[int, int]], secret: bytes = SECRET
) -> PeerInfo:
    """``info`` with every region limited to ``extents`` under ``lease``, signed."""
    regions = tuple(msgspec.structs.replace(r, key=scope_key(lease, extents)) for r in info.regions)
    return msgspec.structs.replace(info, regions=regions, mac=b"").signed(secret)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    async with open_pair("tcp", SIZE, SIZE, secret=SECRET) as p:
        yield p


def raw_connect(
    info: PeerInfo, grant: PeerInfo, secret: bytes = SECRET, number: int = 0
) -> socket.socket:
    """A hand-made client: the handshake with ``secret``, opening with ``grant``.
    Returns the socket after the server's OK (ConnectionError if it closed instead)."""
    host, port, incarnation = parse_address(info.address)
    sock = socket.create_connection((host, port), timeout=10)
    cn = os.urandom(16)
    sock.sendall(HELLO.pack(MAGIC, 7, incarnation, cn))
    se, sn, _ = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size))
    body = grant.encode()
    proof = client_proof(secret, cn, sn, 7, se, grant.mac)
    sock.sendall(PROOF.pack(proof) + HEADER.pack(Kind.GRANT, len(body), number, 0) + body)
    recv_exact(sock, 1)
    return sock


def read_frame(region: int, offset: int, nbytes: int, grant: int = 0, rid: int = 1) -> bytes:
    rows = np.array([(region, offset, nbytes)], READ_ROW)
    return HEADER.pack(Kind.READ, 1, grant, rid) + rows.tobytes()


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` without sending anything more."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# ---------------------------------------------------------------- trust at the source


async def test_the_source_refuses_a_read_outside_the_granted_lease_scope_and_sends_no_byte_of_it(
    pair: Pair,
) -> None:
    grant = scoped(pair.source.advertise(), "lease-1", [(0, 8192)])
    sock = await asyncio.to_thread(raw_connect, pair.source.advertise(), grant)
    with sock:
        # inside the scope: served
        sock.sendall(read_frame(REMOTE, 4096, 4096))
        kind, _, _, _ = HEADER.unpack(recv_exact(sock, HEADER.size))
        assert kind == Kind.DATA
        assert recv_exact(sock, 4096) == pair.remote.numpy()[4096:8192].tobytes()
        # one byte past it: refused, by the source, naming the range; the connection stays
        sock.sendall(read_frame(REMOTE, 4096, 4097, rid=2))
        kind, n, _, rid = HEADER.unpack(recv_exact(sock, HEADER.size))
        assert (kind, rid) == (Kind.REFUSED, 2)
        why = recv_exact(sock, n).decode()
        assert "outside what the record's lease may read" in why and "[4096, 8193)" in why
        sock.sendall(read_frame(REMOTE, 0, 16, rid=3))
        kind, _, _, rid = HEADER.unpack(recv_exact(sock, HEADER.size))
        assert (kind, rid) == (Kind.DATA, 3)
        assert recv_exact(sock, 16) == pair.remote.numpy()[:16].tobytes()


async def test_a_scoped_connection_refuses_out_of_scope_reads_before_posting_them(
    pair: Pair,
) -> None:
    await pair.peer.update(scoped(pair.source.advertise(), "lease-1", [(0, 8192)]))
    pair.local.numpy()[:] = 0xA5
    with pytest.raises(ReadRefused, match="outside what the record's lease may read") as info:
        await pair.peer.get([(LOCAL, 0, REMOTE, 0, 4096), (LOCAL, 4096, REMOTE, 8192, 1)])
    assert info.value.index == 1
    assert (pair.local.numpy() == 0xA5).all()
    await pair.peer.get([(LOCAL, 0, REMOTE, 4096, 4096)])
    assert np.array_equal(pair.local.numpy()[:4096], pair.remote.numpy()[4096:8192])


async def test_a_lease_the_source_no_longer_holds_live_is_refused_at_the_source() -> None:
    live = {"lease-1"}
    with SharedSegment.create(SIZE, "dst") as dst, SharedSegment.create(SIZE, "src") as src:
        async with (
            TcpTransport(secret=SECRET, authorize=live.__contains__, require_lease=True) as source,
            TcpTransport(secret=SECRET) as puller,
        ):
            await source.register(REMOTE, src)
            await puller.register(LOCAL, dst)
            peer = await puller.connect(scoped(source.advertise(), "lease-1", [(0, SIZE)]))
            await peer.get([(LOCAL, 0, REMOTE, 0, SIZE)])
            live.clear()  # the lease expired or was released at the source
            with pytest.raises(PullFailed, match="lease 'lease-1' is no longer live"):
                await peer.get([(LOCAL, 0, REMOTE, 0, SIZE)])
            await peer.close()


async def test_a_source_that_requires_a_lease_refuses_a_connection_with_an_unscoped_record() -> (
    None
):
    with SharedSegment.create(SIZE, "src") as src:
        async with (
            TcpTransport(secret=SECRET, require_lease=True) as source,
            TcpTransport(secret=SECRET) as puller,
        ):
            await source.register(REMOTE, src)
            with pytest.raises(UnauthenticatedPeer, match="refused our proof or record"):
                await puller.connect(source.advertise())


async def test_a_read_of_a_region_registered_again_since_the_grant_is_refused_at_the_source(
    pair: Pair,
) -> None:
    await pair.source.register(REMOTE, pair.remote)  # a new generation under the same id
    with pytest.raises(PullFailed, match="registered again since"):
        await pair.peer.get([(LOCAL, 0, REMOTE, 0, 4096)])


async def test_a_client_without_the_deployment_secret_gets_no_answer_to_its_proof(
    pair: Pair,
) -> None:
    info = pair.source.advertise()
    with pytest.raises(ConnectionError):
        await asyncio.to_thread(raw_connect, info, info, b"another-secret-0123456789")
    # the real peer is unaffected
    await pair.peer.get([(LOCAL, 0, REMOTE, 0, 4096)])


async def test_a_host_the_source_does_not_trust_is_closed_unanswered() -> None:
    seen: list[str] = []

    def accept(host: str) -> bool:
        seen.append(host)
        return False

    async with TcpTransport(secret=SECRET, accept=accept) as source:
        host, port, incarnation = parse_address(source.advertise().address)

        def hello() -> bool:
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(HELLO.pack(MAGIC, 1, incarnation, os.urandom(16)))
                return closed(sock)

        assert await asyncio.to_thread(hello), "the source answered an untrusted host"
        assert seen == ["127.0.0.1"]
        async with TcpTransport(secret=SECRET) as puller:
            with pytest.raises(UnauthenticatedPeer, match="closed the connection unanswered"):
                await puller.connect(source.advertise())


@pytest.mark.parametrize(
    "garbage",
    [
        HEADER.pack(99, 0, 0, 1),  # unknown kind
        HEADER.pack(Kind.READ, 1 << 30, 0, 1),  # more reads than a frame may hold
        HEADER.pack(Kind.READ, 1, 5, 1) + bytes(24),  # a grant never sent
        HEADER.pack(Kind.GRANT, 1 << 30, 1, 0),  # a grant past the size bound
        HEADER.pack(Kind.GRANT, 3, 1, 0) + b"\x01\x02\x03",  # not a record
    ],
    ids=["unknown-kind", "too-many-reads", "unknown-grant", "huge-grant", "bad-grant"],
)
async def test_a_malformed_frame_closes_only_its_own_connection(pair: Pair, garbage: bytes) -> None:
    info = pair.source.advertise()
    sock = await asyncio.to_thread(raw_connect, info, info)
    with sock:
        sock.sendall(garbage)
        assert await asyncio.to_thread(closed, sock), "the server kept a malformed connection"
    await pair.peer.get([(LOCAL, 0, REMOTE, 0, SIZE)])  # the other lanes go on
    assert np.array_equal(pair.local.numpy(), pair.remote.numpy())


async def test_a_forged_grant_on_an_open_connection_closes_it(pair: Pair) -> None:
    info = pair.source.advertise()
    sock = await asyncio.to_thread(raw_connect, info, info)
    forged = scoped(info, "lease-x", [(0, SIZE)], secret=b"not-the-deployment-secret")
    body = forged.encode()
    with sock:
        sock.sendall(HEADER.pack(Kind.GRANT, len(body), 1, 0) + body)
        assert await asyncio.to_thread(closed, sock)


# ---------------------------------------------------------------- faults


def reads(local: int = LOCAL, remote: int = REGION_ID, seed: int = 0) -> np.ndarray:
    b = shuffled_batch(SIZE // PIECE, PIECE, seed=seed)
    b["local_region"], b["remote_region"] = local, remote
    return b


def landed(dst: SharedSegment, seed: int, batch: np.ndarray) -> bool:
    src = pattern(SIZE, seed)
    got = dst.numpy().reshape(-1, PIECE)[batch["local_offset"] // PIECE]
    want = src.reshape(-1, PIECE)[batch["remote_offset"] // PIECE]
    return bool(np.array_equal(got, want))


async def timed(peer: TcpPeer, batch: np.ndarray) -> tuple[float, BaseException | None]:
    try:
        await peer.get(batch)
    except Exception as exc:
        return time.monotonic(), exc
    return time.monotonic(), None


async def test_a_stopped_source_fails_only_its_pulls_at_the_deadline_naming_it_while_another_source_goes_on() -> (
    None
):
    async with AsyncExitStack() as stack:
        dst_a = stack.enter_context(SharedSegment.create(SIZE, "dst-a"))
        dst_b = stack.enter_context(SharedSegment.create(SIZE, "dst-b"))
        proc_a, info_a = await stack.enter_async_context(peer_process(1, SIZE, SECRET, "tcp"))
        _, info_b = await stack.enter_async_context(peer_process(2, SIZE, SECRET, "tcp"))
        puller = await stack.enter_async_context(
            TcpTransport(secret=SECRET, pull_timeout=STOPPED_SOURCE_DEADLINE_S)
        )
        await puller.register(LOCAL, dst_a)
        await puller.register(LOCAL + 1, dst_b)
        peer_a = await puller.connect(info_a)
        peer_b = await puller.connect(info_b)
        batch_a, batch_b = reads(LOCAL, seed=1), reads(LOCAL + 1, seed=2)
        os.kill(proc_a.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            task_a = asyncio.create_task(timed(peer_a, batch_a))
            await asyncio.sleep(0)  # A's pull is handed over first
            (_, err_b) = await timed(peer_b, batch_b)
            # an outcome, not a speed: B ended while A's pull was still pending
            a_pending_when_b_ended = not task_a.done()
            (end_a, err_a) = await task_a
        finally:
            os.kill(proc_a.pid, signal.SIGCONT)
        assert err_b is None, f"the pull from healthy B failed beside stopped A: {err_b}"
        assert landed(dst_b, 2, batch_b)
        assert a_pending_when_b_ended, "B's pull waited for stopped A"
        assert isinstance(err_a, PeerLost), err_a
        assert repr(info_a.peer_id) in str(err_a) and "pull deadline" in str(err_a)
        assert f"region {LOCAL} [0, {SIZE})" in str(err_a), "it names the suspect bytes"
        # the deadline never fires early (a lower bound: load can only lengthen it)
        assert end_a - t0 >= STOPPED_SOURCE_DEADLINE_S
        # A answers again: the next pull from it connects afresh and completes
        dst_a.numpy()[:] = 0
        await peer_a.get(batch_a)
        assert landed(dst_a, 1, batch_a)


async def test_a_killed_source_fails_the_pull_in_flight_with_peer_lost_and_suspect_ranges() -> None:
    async with AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst"))
        proc, info = await stack.enter_async_context(peer_process(3, SIZE, SECRET, "tcp"))
        puller = await stack.enter_async_context(TcpTransport(secret=SECRET, lanes=2))
        await puller.register(LOCAL, dst)
        peer = await puller.connect(info)
        batch = reads(seed=3)
        await peer.get(batch)
        assert landed(dst, 3, batch)
        os.kill(proc.pid, signal.SIGSTOP)  # the pull is surely in flight when it dies
        await _until_stopped(proc.pid)  # a busy machine may take a while to stop it
        task = asyncio.create_task(peer.get(batch))
        await asyncio.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(PeerLost, match=f"region {LOCAL} \\[0, {SIZE}\\)") as err:
            await task
        # noticed as a broken connection, not at the (120 s) deadline
        assert "broke mid-read" in str(err.value), str(err.value)
        assert repr(info.peer_id) in str(err.value)


def _state(pid: int) -> str:
    """Process ``pid``'s state letter in ``/proc`` (a read of no disk)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def _until_stopped(pid: int, safety_s: float = 30.0) -> None:
    """Return once process ``pid`` is stopped (its state in ``/proc`` is ``T``)."""
    deadline = time.monotonic() + safety_s  # a safety net, not a measure
    while time.monotonic() < deadline:
        if _state(pid) in ("T", "t"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {safety_s} s")


async def test_a_restarted_source_is_detected_by_its_new_incarnation_and_a_new_record_reconnects() -> (
    None
):
    with SharedSegment.create(SIZE, "dst") as dst, SharedSegment.create(SIZE, "src") as src:
        src.numpy()[:] = pattern(SIZE, 4)
        async with TcpTransport(secret=SECRET) as puller:
            await puller.register(LOCAL, dst)
            first = TcpTransport(secret=SECRET, peer_id="S")
            await first.start()
            await first.register(REMOTE, src)
            host, port, _ = parse_address(first.advertise().address)
            peer = await puller.connect(first.advertise())
            await peer.get([(LOCAL, 0, REMOTE, 0, SIZE)])
            await first.close()
            # the same address, a new life
            second = TcpTransport(secret=SECRET, peer_id="S", host=host, port=port)
            async with second:
                await second.register(REMOTE, src)
                with pytest.raises(PeerLost, match="the source restarted"):
                    await peer.get([(LOCAL, 0, REMOTE, 0, SIZE)])
                await peer.close()
                dst.numpy()[:] = 0
                async with await puller.connect(second.advertise()) as fresh:
                    await fresh.get([(LOCAL, 0, REMOTE, 0, SIZE)])
                assert np.array_equal(dst.numpy(), src.numpy())


async def test_reads_spread_over_every_lane_and_large_reads_are_cut_across_them(pair: Pair) -> None:
    assert isinstance(pair.peer, TcpPeer)
    assert len(pair.peer.lanes) == 4
    before = pair.source.server.connections
    assert before == 4, f"the source holds {before} data connections, not one per lane"
    await pair.peer.get([(LOCAL, 0, REMOTE, 0, SIZE)])
    assert np.array_equal(pair.local.numpy(), pair.remote.numpy())


async def test_pulls_under_two_leases_share_the_lanes_each_checked_against_its_own_grant(
    pair: Pair,
) -> None:
    assert isinstance(pair.peer, TcpPeer)
    advert = pair.source.advertise()
    first = pair.peer.with_grant(scoped(advert, "lease-1", [(0, SIZE // 2)]))
    second = pair.peer.with_grant(scoped(advert, "lease-2", [(SIZE // 2, SIZE)]))
    half = SIZE // 2
    batch1 = shuffled_batch(half // 4096, 4096, seed=5)
    batch2 = shuffled_batch(half // 4096, 4096, seed=6, local_base=half)
    batch2["remote_offset"] += half
    await asyncio.gather(*(first.get(batch1) for _ in range(3)), second.get(batch2))
    for b, lo in ((batch1, 0), (batch2, half)):
        got = pair.local.numpy()[lo : lo + half].reshape(-1, 4096)
        want = pair.remote.numpy().reshape(-1, 4096)[b["remote_offset"] // 4096]
        assert np.array_equal(got, want)
    with pytest.raises(ReadRefused, match="outside what the record's lease may read"):
        await first.get(batch2)
    with pytest.raises(ReadRefused, match="outside what the record's lease may read"):
        await second.get(batch1)


# ---------------------------------------------------------------- memory a client resizes


def _truncate(seg: SharedSegment, nbytes: int) -> None:
    """What a client may do to a segment file it owns: resize it under every mapping."""
    fd = os.open(SHM_DIR / seg.name, os.O_RDWR)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


@pytest.mark.parametrize("piece", [4096, 1 << 20], ids=["gathered", "zero-copy"])
@pytest.mark.parametrize("side", ["source", "destination"])
async def test_a_segment_shrunk_under_a_tcp_read_fails_that_read_and_both_ends_serve_on(
    pair: Pair, side: str, piece: int
) -> None:
    """Small pieces are gathered at the source and scattered at the reader by the C
    copy, large ones sent from and received into the mappings: a shrunk file on
    either side fails the read; no bus error kills the process holding the mapping
    (here both ends live in the test process, so a bus error would end the test run)."""
    batch = shuffled_batch(4, piece)
    seg = pair.remote if side == "source" else pair.local
    _truncate(seg, 0)
    with pytest.raises(PullFailed):
        await pair.peer.get(batch)
    # The file grows back (as zeros); the same transports serve the next read exactly.
    _truncate(seg, SIZE)
    if side == "source":
        pair.remote.numpy()[:] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    await pair.peer.get(batch)
    expect(pair, batch)


def test_a_scoped_grant_keys_each_region_to_its_lease_ranges_and_refuses_one_not_advertised() -> (
    None
):
    regions = (AdvertisedRegion(1, 7, 0, 100), AdvertisedRegion(2, 8, 0, 50))
    advert = PeerInfo("tcp", "src", b"addr", regions).signed(SECRET)
    grant = scoped_grant(advert, "lease-1", {2: [(10, 20)]}, SECRET)
    grant.verify(SECRET)
    assert [(r.region_id, r.generation, r.size) for r in grant.regions] == [(2, 8, 50)]
    assert ScopeKey.decode(grant.regions[0].key) == ScopeKey("lease-1", [(10, 20)])
    with pytest.raises(TransportError, match="region 3 of 'src' is not in its tcp advertisement"):
        scoped_grant(advert, "lease-1", {3: [(0, 1)]}, SECRET)
