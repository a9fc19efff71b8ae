"""The lease grant is the credential on the same-host path too (issue 50): a daemon
reading a source on its own host maps the source's segments with the ``shm`` grant
the source made for the lease, as given, and makes none of its own.

``POST /v1/leases`` answers the source's signed records, and in them its ``shm``
grant: the lease's regions, each keyed to the lease and its byte ranges, signed by
the source (:meth:`transports.shm.ShmTransport.grant`). The reading daemon checks it
names the pull's lease and every region it reads, and connects with it; a grant
widened by a reader, or of another lease, is refused before any byte moves.

Real daemons in this process on one host (one boot id), real HTTP, real shared memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
from support.daemons import daemon_config, served
from support.toy import publish_tensor, pull_rows

from refitd.client.http import RefitClient
from refitd.daemon.app.handlers import PULLS
from refitd.daemon.app.node import Daemon
from refitd.daemon.pull.pulls import PullManager
from refitd.errors import AccessDenied, ProtocolError
from refitd.wire import LeaseInfo, PeerRegions, PullRequest, PullState
from transports.interface import LeaseScope, PeerInfo, UnauthenticatedPeer
from transports.segments import SharedSegment
from transports.shm import SegmentKey

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
NBYTES = 4096


@dataclass
class SameHost:
    """A source daemon and an engine's daemon on its host, which reads it over ``shm``."""

    source: Daemon
    src: RefitClient
    engine: RefitClient
    pulls: PullManager
    source_url: str


@contextlib.asynccontextmanager
async def same_host() -> AsyncIterator[SameHost]:
    allow = ("http://127.0.0.1:*",)
    src = Daemon(daemon_config(node_id="src", allow=allow), secret=SECRET)
    eng = Daemon(daemon_config(node_id="eng", allow=allow), secret=SECRET)
    async with served(src) as s, served(eng) as e:
        yield SameHost(src, s.client, e.client, e.app[PULLS], s.url)


async def published(c: RefitClient, model: str, fill: int, nbytes: int = NBYTES) -> int:
    """``model`` v1 published from the first ``nbytes`` bytes of a new NBYTES-byte
    region, every byte ``fill``; the region."""
    info = await c.create_region(NBYTES, label=model)
    with SharedSegment.attach(info.handle, info.nbytes) as seg:
        seg.numpy()[:] = fill
    await publish_tensor(c, model, 1, info.region_id, nbytes)
    return info.region_id


def presenting(lease: LeaseInfo, *rows: tuple[int, int, int, int, int], url: str) -> PullRequest:
    req = pull_rows(lease.model, lease.version, lease.lease_id, *rows, source=url)
    return msgspec.structs.replace(req, grant=lease.records)


def shm_grant(rec: PeerRegions) -> PeerInfo:
    return PeerInfo.decode(rec.adverts["shm"])


def with_shm(rec: PeerRegions, grant: PeerInfo) -> PeerRegions:
    """``rec`` carrying ``grant`` as its ``shm`` credential (its own MAC left as it was:
    what the pulling daemon's ``shm`` path is handed is checked on its own)."""
    return msgspec.structs.replace(rec, adverts={**rec.adverts, "shm": grant.encode()})


async def test_a_same_host_pull_reads_with_the_shm_grant_the_source_made_for_its_lease() -> None:
    async with same_host() as h:
        region = await published(h.src, "m", 7, nbytes=NBYTES // 2)
        lease = await h.src.acquire_lease("m", 1)
        rec = lease.records
        assert rec is not None
        grant = shm_grant(rec)
        grant.verify(SECRET)
        # the source's own grant: the lease's region, keyed to it and to the half its
        # version publishes (before, the source's advertisement: whole regions, no lease)
        scope = LeaseScope(lease.lease_id, {region: [(0, NBYTES // 2)]})
        assert grant == h.source.plane.shm.grant(scope)
        key = SegmentKey.decode(grant.regions[0].key)
        assert (key.lease, key.extents) == (lease.lease_id, [(0, NBYTES // 2)])
        # ... which the pulling daemon reads with as given
        assert h.pulls.paths.shm_credential(rec) == grant
        seg = SharedSegment.create(NBYTES, "dst")
        with seg:
            dst = (await h.engine.attach_region(seg.name, NBYTES)).region_id
            res = await h.engine.pull(
                presenting(lease, (region, 0, dst, 0, NBYTES // 2), url=h.source_url)
            )
            assert res.state is PullState.DONE and res.path == "shm"
            assert (seg.numpy()[: NBYTES // 2] == 7).all() and not seg.numpy()[NBYTES // 2 :].any()


async def test_a_same_host_grant_a_reader_widened_is_refused_before_anything_is_mapped() -> None:
    async with same_host() as h:
        region = await published(h.src, "m", 7, nbytes=NBYTES // 2)
        other = await published(h.src, "x", 9)
        lease = await h.src.acquire_lease("m", 1)
        rec = lease.records
        assert rec is not None
        grant = shm_grant(rec)
        (mine,) = grant.regions
        theirs = SegmentKey.decode(h.source.plane.shm.regions[other].info.key)
        wider = SegmentKey.decode(mine.key)._replace(extents=[(0, NBYTES)])
        stolen = theirs._replace(lease=lease.lease_id, extents=[(0, NBYTES)])
        for key in (wider, stolen):
            region_rec = msgspec.structs.replace(mine, key=key.encode())
            forged = msgspec.structs.replace(grant, regions=(region_rec,))
            for bad in (forged, forged.signed(b"a-reader-is-not-the-source-0123")):
                with pytest.raises(UnauthenticatedPeer):
                    h.pulls.paths.shm_credential(with_shm(rec, bad))
                # presented with the pull, the records' own MAC refuses it first
                swapped = msgspec.structs.replace(lease, records=with_shm(rec, bad))
                with pytest.raises(ProtocolError, match="MAC does not verify"):
                    await h.engine.pull(
                        presenting(swapped, (region, 0, 1, 0, 16), url=h.source_url)
                    )
        assert h.pulls.plane.shm.mapped == 0 and await h.engine.pulls() == []


async def test_one_leases_same_host_grant_is_not_read_with_under_another_lease() -> None:
    async with same_host() as h:
        region = await published(h.src, "m", 7)
        first = await h.src.acquire_lease("m", 1)
        second = await h.src.acquire_lease("m", 1)
        assert first.records is not None and second.records is not None
        # records of the first lease presented with the second: refused (403)
        seg = SharedSegment.create(NBYTES, "dst")
        with seg:
            dst = (await h.engine.attach_region(seg.name, NBYTES)).region_id
            req = presenting(second, (region, 0, dst, 0, NBYTES), url=h.source_url)
            with pytest.raises(AccessDenied, match="a pull reads only with its own lease's grant"):
                await h.engine.pull(msgspec.structs.replace(req, grant=first.records))
            assert not seg.numpy().any()
        # the first lease's shm grant in the second's records: not the second's
        # credential (before, a same-host record named no lease: any lease's served)
        mixed = with_shm(second.records, shm_grant(first.records))
        with pytest.raises(ProtocolError, match=f"granted to lease '{first.lease_id}'"):
            h.pulls.paths.shm_credential(mixed)
        assert h.pulls.plane.shm.mapped == 0
