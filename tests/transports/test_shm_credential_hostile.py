"""The lease-scoped ``shm`` grant, attacked (issue 36's standard: fail closed).

A same-host source makes each lease's grant itself (:meth:`~transports.shm.ShmTransport.grant`):
the lease's regions, each keyed to the lease and its byte ranges, signed with the
deployment secret. A reader connects with it as given; its ``shm`` transport has no
way to make or narrow one. So every way of presenting something else is refused: a
grant tampered to name another segment or to widen its ranges, one signed outside the
deployment, one of another lease, one of another life of the source, one from
another kernel boot.

Real ``shm`` transports and real shared segments.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from refitd.errors import ProtocolError, TransportError
from transports.interface import LeaseScope, PeerInfo, Transport, UnauthenticatedPeer
from transports.segments import SharedSegment
from transports.shm import SegmentKey, ShmTransport

SECRET = b"shm-credential-hostile-0123456789"
SIZE = 4096
SCOPED, OTHER, LOCAL = 1, 2, 9
HALF = LeaseScope("lease", {SCOPED: [(0, SIZE // 2)]})


@contextlib.asynccontextmanager
async def _two_regions(
    incarnation: int = 7,
) -> AsyncIterator[tuple[ShmTransport, ShmTransport]]:
    """A started puller with region 9, and a started source (life ``incarnation``)
    with regions 1 (filled with 1, the lease's) and 2 (filled with 2, another's)."""
    with contextlib.ExitStack() as stack:
        segs = [stack.enter_context(SharedSegment.create(SIZE, f"r{i}")) for i in (1, 2)]
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst"))
        async with (
            ShmTransport(secret=SECRET) as puller,
            ShmTransport(secret=SECRET, incarnation=incarnation) as source,
        ):
            for rid, seg in zip((SCOPED, OTHER), segs, strict=True):
                seg.numpy()[:] = rid
                await source.register(rid, seg)
            await puller.register(LOCAL, dst)
            yield puller, source


def _keyed(grant: PeerInfo, **fields: object) -> PeerInfo:
    """``grant`` with its one region's key changed, its MAC left as it was."""
    (region,) = grant.regions
    key = SegmentKey.decode(region.key)._replace(**fields).encode()
    return msgspec.structs.replace(grant, regions=(msgspec.structs.replace(region, key=key),))


async def test_a_grant_tampered_to_name_another_segment_or_wider_ranges_is_refused() -> None:
    """The grant's entry for the scoped region is made to name the other region's
    segment, or the whole region, its MAC left as it was, dropped, or made outside the
    deployment: neither checked nor connected with. (Before, the reader made and
    signed the same-host record itself, so a record it widened was one it could sign.)"""
    async with _two_regions() as (puller, source):
        grant = source.grant(HALF)
        other = SegmentKey.decode(source.advertise().regions[1].key)
        forged = [
            _keyed(grant, name=other.name, dev=other.dev, ino=other.ino),
            _keyed(grant, extents=[(0, SIZE)]),
            _keyed(grant, extents=None, lease=""),
        ]
        for tampered in forged:
            for bad in (
                tampered,
                msgspec.structs.replace(tampered, mac=b""),
                tampered.signed(b"not-the-deployment-secret-0123"),
            ):
                with pytest.raises(UnauthenticatedPeer):
                    puller.check_grant(bad, HALF)
                with pytest.raises(UnauthenticatedPeer):
                    await puller.connect(bad)
        assert puller.mapped == 0
        # the genuine grant reads the scoped region's own bytes, and only its half
        async with await puller.connect(grant) as peer:
            await peer.get([(LOCAL, 0, SCOPED, 0, SIZE // 2)])
            with pytest.raises(ProtocolError, match="outside what lease 'lease' was granted"):
                await peer.get([(LOCAL, SIZE // 2, SCOPED, SIZE // 2, 1)])
        dst = puller.regions[LOCAL].segment.numpy()
        assert (dst[: SIZE // 2] == SCOPED).all() and not dst[SIZE // 2 :].any()


def test_a_reader_has_no_way_to_make_a_same_host_credential() -> None:
    """The source makes the grant (``grant``); a reader's transport only checks one
    (``check_grant``). Before, ``credential`` made and signed one at the reader."""
    assert not hasattr(ShmTransport, "credential") and not hasattr(Transport, "credential")
    assert ShmTransport.grant is not Transport.grant  # its own, lease-scoped


async def test_one_leases_grant_is_refused_for_another_leases_reads() -> None:
    """A grant of lease ``a`` is not checked as lease ``b``'s, and a connection made
    with one takes no update of the other's, nor of the source's whole-region
    advertisement (before, a same-host record named no lease, so any lease's
    advertisement served)."""
    async with _two_regions() as (puller, source):
        a = source.grant(LeaseScope("a", {SCOPED: [(0, SIZE)]}))
        b = source.grant(LeaseScope("b", {SCOPED: [(0, SIZE)], OTHER: [(0, SIZE)]}))
        with pytest.raises(ProtocolError, match="granted to lease 'a', not 'b'"):
            puller.check_grant(a, LeaseScope("b", {SCOPED: []}))
        async with await puller.connect(a) as peer:
            with pytest.raises(ProtocolError, match=r"grant is of lease 'b'.* lease 'a'"):
                await peer.update(b)
            with pytest.raises(ProtocolError, match=r"grant is of lease ''.* lease 'a'"):
                await peer.update(source.advertise())  # nor widened to whole regions
            with pytest.raises(ProtocolError, match="remote region 2 is not in"):
                await peer.get([(LOCAL, 0, OTHER, 0, SIZE)])
            await peer.get([(LOCAL, 0, SCOPED, 0, SIZE)])
        assert (puller.regions[LOCAL].segment.numpy() == SCOPED).all()


async def test_a_grant_of_another_life_of_the_source_does_not_update_a_connection() -> None:
    """A connection made to the source's life 7 is handed the grant of its life 8
    (one kept across a restart, or a restarted source's): refused, the connection
    keeps what it had."""
    async with _two_regions(incarnation=7) as (puller, source):
        scope = LeaseScope("lease", {SCOPED: [(0, SIZE)]})
        peer = await puller.connect(source.grant(scope))
        with SharedSegment.create(SIZE, "reborn") as seg:
            seg.numpy()[:] = 0xEE
            async with ShmTransport(secret=SECRET, incarnation=8) as reborn, peer:
                await reborn.register(SCOPED, seg)
                with pytest.raises(ProtocolError, match="another peer"):
                    await peer.update(reborn.grant(scope))
                await peer.get([(LOCAL, 0, SCOPED, 0, SIZE)])
                assert (puller.regions[LOCAL].segment.numpy() == SCOPED).all()


async def test_a_grant_from_another_kernel_boot_maps_nothing() -> None:
    """A source under another boot id (another host: its segment names are not this
    host's) grants as any source does; the reader's connect refuses it."""
    async with _two_regions() as (puller, _):
        with SharedSegment.create(SIZE, "far") as seg:
            async with ShmTransport(secret=SECRET, boot_id="another-boot") as far:
                await far.register(SCOPED, seg)
                with pytest.raises(TransportError, match="another kernel"):
                    await puller.connect(far.grant(HALF))
        assert puller.mapped == 0


async def test_a_signed_grant_naming_its_lease_but_no_byte_ranges_is_refused() -> None:
    """A key with the lease and no ranges would map the whole region: even signed
    with the deployment secret (a source's bug, or a peer holding the secret), it is
    refused before anything is mapped, not read as the whole region."""
    async with _two_regions() as (puller, source):
        whole = _keyed(source.grant(HALF), extents=None).signed(SECRET)
        with pytest.raises(ProtocolError, match="names no byte ranges"):
            puller.check_grant(whole, HALF)
        assert puller.mapped == 0
