"""The lease-scoped ``shm`` record, attacked (issue 36's standard: fail closed).

A reader connects to a same-host source with the record its own ``shm`` transport
makes (:meth:`~transports.shm.ShmTransport.credential`) of the source's signed
advertisement and the lease scope; the credential is signed with the deployment
secret, so whatever it lists the reader maps. It must therefore list only what the
source itself advertised: a tampered or unsigned advertisement gets no credential,
and a record of another life of the source does not replace a connection's.

Real ``shm`` transports and real shared segments.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from refitd.errors import ProtocolError
from transports.interface import LeaseScope
from transports.segments import SharedSegment
from transports.shm import ShmTransport

SECRET = b"shm-credential-hostile-0123456789"
SIZE = 4096
SCOPED, OTHER, LOCAL = 1, 2, 9


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


async def test_an_advertisement_tampered_to_name_another_segment_gets_no_credential() -> None:
    """The advertisement's entry for the scoped region is made to name the other
    region's segment (its name, file and size), and its MAC left as it was, or
    dropped: no credential is made of it. Before, the reader signed what it was
    handed, connected, and read region 2's bytes as region 1's."""
    async with _two_regions() as (puller, source):
        advert = source.advertise()
        by_id = {r.region_id: r for r in advert.regions}
        swapped = msgspec.structs.replace(by_id[SCOPED], key=by_id[OTHER].key)
        tampered = msgspec.structs.replace(advert, regions=(swapped,))
        scope = LeaseScope("lease", {SCOPED: [(0, SIZE)]})
        for forged in (tampered, msgspec.structs.replace(tampered, mac=b"")):
            with pytest.raises(ProtocolError):
                puller.credential(forged, scope)
        # the genuine advertisement still reads the scoped region's own bytes
        async with await puller.connect(puller.credential(advert, scope)) as peer:
            await peer.get([(LOCAL, 0, SCOPED, 0, SIZE)])
        assert (puller.regions[LOCAL].segment.numpy() == SCOPED).all()


async def test_a_record_of_another_life_of_the_source_does_not_update_a_connection() -> None:
    """A connection made to the source's life 7 is handed a credential of its life 8
    (a record kept across a restart, or a restarted source's): refused, the
    connection keeps what it had."""
    async with _two_regions(incarnation=7) as (puller, source):
        scope = LeaseScope("lease", {SCOPED: [(0, SIZE)]})
        peer = await puller.connect(puller.credential(source.advertise(), scope))
        with SharedSegment.create(SIZE, "reborn") as seg:
            seg.numpy()[:] = 0xEE
            async with ShmTransport(secret=SECRET, incarnation=8) as reborn, peer:
                await reborn.register(SCOPED, seg)
                with pytest.raises(ProtocolError, match="another peer"):
                    await peer.update(puller.credential(reborn.advertise(), scope))
                await peer.get([(LOCAL, 0, SCOPED, 0, SIZE)])
                assert (puller.regions[LOCAL].segment.numpy() == SCOPED).all()
