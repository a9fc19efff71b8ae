"""A hostile tenant, holding its own token, against the same-host ``shm`` grant the
source makes for a lease (and, beside it, the ``tcp`` one), and against the staging
pool's count of who holds its regions.

Each test is one attack, and each is refused. Two got through when they were
written, both from a staging region handed back and pooled: it was reused for
another lease as the same region, so records kept past its release read another
tenant's repack (over shm and tcp), and it stayed charged to its first tenant. A
pooled region is now reused only for the lease it was last packed for
(:mod:`refitd.daemon.state.staging`).

Real daemons in this process on 127.0.0.1:0 (:mod:`support.granthosts`), real HTTP,
real shared memory: the engine's daemon is given the source's boot id, so it reads
the source's segments over ``shm`` with the grant in the lease's records.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
from support.daemons import daemon_config, served
from support.granthosts import (
    NBYTES,
    SECRET,
    TOKENS,
    acquainted,
    destination,
    presenting,
    published,
    raw_session,
    status_of,
    tenants_access,
    two_hosts,
)

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.chunks import Mirror
from refitd.errors import ProtocolError, QuotaExceeded, RefitError
from refitd.wire import MemoryKind, PackSpec, PeerRegions, RegionInfo
from transports.interface import PeerInfo
from transports.segments import SharedSegment
from transports.shm import SegmentKey

pytestmark = pytest.mark.timeout(60)

SAME_HOST = "host-a"
"""The source's boot id: an engine's daemon given it reads the source over ``shm``."""


def whole(region: int) -> PackSpec:
    """A pack spec of the first NBYTES bytes of ``region``, one byte a row."""
    return PackSpec(region, 0, (NBYTES,), (1,), 1, 0, 0)


def shm_grant(rec: PeerRegions) -> PeerInfo:
    return PeerInfo.decode(rec.adverts["shm"])


# ---------------------------------------------------------------- the shm grant


async def test_a_staging_grant_kept_past_its_release_reads_nothing_packed_for_another_tenant(
    tmp_path: Path,
) -> None:
    # a packs its own model into staging and asks the records of that staging region
    # under its lease (the grant scopes it to the bytes packed for that lease); it
    # hands the region back, keeps the records, and b packs (before the fix, into the
    # very region: the pool reused it for b's lease). a's
    # lease is still live, so the records still verify: over shm, nothing but the
    # grant in them limits what the engine's daemon maps.
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h:
        region = await published(h.a, "ma", 7)
        theirs = await published(h.b, "mb", 9)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        staged = await h.a.peer_pack("ma", 1, lease.lease_id, [whole(region)])
        staging = staged.region.region_id
        kept = await h.a.peer_regions([staging], lease.lease_id, "ma", 1)
        assert kept.scope == {staging: [(0, NBYTES)]}
        await h.a.peer_drop(staging, lease.lease_id)
        b_lease = await h.b.acquire_lease("mb", 1)
        b_staged = await h.b.peer_pack("mb", 1, b_lease.lease_id, [whole(theirs)])
        assert b_staged.region.region_id != staging  # pooled for a's lease alone
        async with destination(h) as (dst, seg):
            req = presenting(lease, (staging, 0, dst, 0, NBYTES), url=h.source_url)
            with contextlib.suppress(RefitError):
                res = await h.engine.pull(msgspec.structs.replace(req, grant=kept))
                assert res.path == "shm"
            assert not (seg.numpy() == 9).any(), "a read b's packed bytes"


async def test_a_staging_grant_kept_past_its_release_is_refused_by_the_tcp_data_server(
    tmp_path: Path,
) -> None:
    # The same attack from another host, through the tcp data server.
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        theirs = await published(h.b, "mb", 9)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        staged = await h.a.peer_pack("ma", 1, lease.lease_id, [whole(region)])
        staging = staged.region.region_id
        kept = await h.a.peer_regions([staging], lease.lease_id, "ma", 1)
        await h.a.peer_drop(staging, lease.lease_id)
        b_lease = await h.b.acquire_lease("mb", 1)
        b_staged = await h.b.peer_pack("mb", 1, b_lease.lease_id, [whole(theirs)])
        assert b_staged.region.region_id != staging
        async with destination(h) as (dst, seg):
            req = presenting(lease, (staging, 0, dst, 0, NBYTES), url=h.source_url)
            with contextlib.suppress(RefitError):
                res = await h.engine.pull(msgspec.structs.replace(req, grant=kept))
                assert res.path == "tcp"
            assert not (seg.numpy() == 9).any()


async def test_two_leases_shm_grants_spliced_into_one_record_are_refused(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h:
        region = await published(h.a, "ma", 7)
        theirs = await published(h.b, "mb", 9)
        await acquainted(h, region)
        mine = await h.a.acquire_lease("ma", 1)
        other = await h.b.acquire_lease("mb", 1)
        assert mine.records is not None and other.records is not None
        a_grant, b_grant = shm_grant(mine.records), shm_grant(other.records)
        # b's region keyed to b's lease, next to a's in a's grant; and relabelled to a's
        (b_region,) = b_grant.regions
        relabelled = msgspec.structs.replace(
            b_region,
            key=SegmentKey.decode(b_region.key)._replace(lease=mine.lease_id).encode(),
        )
        splices = [
            msgspec.structs.replace(a_grant, regions=(*a_grant.regions, b_region)),
            msgspec.structs.replace(a_grant, regions=(*a_grant.regions, relabelled)),
        ]
        async with destination(h) as (dst, seg):
            for spliced in splices:
                rec = msgspec.structs.replace(
                    mine.records,
                    adverts={**mine.records.adverts, "shm": spliced.encode()},
                    scope={**mine.records.scope, theirs: [(0, NBYTES)]},
                )
                req = presenting(mine, (theirs, 0, dst, 0, NBYTES), url=h.source_url)
                with pytest.raises(ProtocolError, match="MAC does not verify"):
                    await h.engine.pull(msgspec.structs.replace(req, grant=rec))
            assert not (seg.numpy() == 9).any()


async def test_zero_length_reads_at_a_grants_edges_move_no_byte_past_it(
    tmp_path: Path,
) -> None:
    # The version is the first NBYTES of a region twice that size; its tail is 5s.
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h:
        region = await published(h.a, "ma", 7, size=2 * NBYTES)
        with SharedSegment.attach((await h.a.regions())[0].handle, 2 * NBYTES) as src:
            src.numpy()[NBYTES:] = 5
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        async with destination(h) as (dst, seg):
            # zero bytes at the grant's end and at the region's end read nothing: let
            # through or refused, no byte of the tail lands
            for off in (NBYTES, 2 * NBYTES):
                with contextlib.suppress(RefitError):
                    await h.engine.pull(
                        presenting(
                            lease,
                            (region, 0, dst, 0, 16),
                            (region, off, dst, 16, 0),
                            url=h.source_url,
                        )
                    )
            assert not (seg.numpy() == 5).any()
            # zero bytes past the region's end: refused (fail closed), nothing lands
            seg.numpy()[:] = 0
            for off in (2 * NBYTES + 1, 2**62):
                with pytest.raises(RefitError, match="ends past the source region"):
                    await h.engine.pull(
                        presenting(
                            lease,
                            (region, 0, dst, 0, 16),
                            (region, off, dst, 16, 0),
                            url=h.source_url,
                        )
                    )
            assert not seg.numpy().any()
            # one byte over the grant's end, alone or behind a granted read: refused
            for rows in [
                [(region, NBYTES, dst, 0, 1)],
                [(region, 0, dst, 0, 16), (region, NBYTES, dst, 16, 1)],
            ]:
                with pytest.raises(RefitError, match=r"outside|lease"):
                    await h.engine.pull(presenting(lease, *rows, url=h.source_url))
            assert not (seg.numpy() == 5).any()


async def test_a_released_leases_same_host_grant_reads_nothing_of_a_region_made_since(
    tmp_path: Path,
) -> None:
    # a's lease ends and its version's region is deleted; a new region (b's) may take
    # the segment name or the id. The old grant names the old file (dev, ino) and a
    # lease no longer live: refused, and b's bytes never land.
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        await h.a.release_lease(lease.lease_id)
        theirs = await published(h.b, "mb", 9)
        async with destination(h) as (dst, seg):
            for src, why in ((region, "unknown or was released"), (theirs, "not recorded")):
                with pytest.raises(RefitError, match=why):
                    await h.engine.pull(
                        presenting(lease, (src, 0, dst, 0, NBYTES), url=h.source_url)
                    )
            assert not (seg.numpy() == 9).any()


async def test_a_grant_of_a_previous_source_life_reads_nothing_of_the_new_life(
    tmp_path: Path,
) -> None:
    # The source stops and starts again as the same node, on the same host, with the
    # same deployment secret: the engine's daemon is handed the old life's records.
    eng = Daemon(
        daemon_config(node_id="eng", allow=("http://127.0.0.1:*",)),
        secret=SECRET,
        boot_id=SAME_HOST,
    )
    async with served(eng, token=TOKENS["daemons"]) as e:
        old = Daemon(
            daemon_config(node_id="src", allow=("http://127.0.0.1:*",)),
            secret=SECRET,
            boot_id=SAME_HOST,
        )
        async with (
            served(old, access=tenants_access(tmp_path)) as s,
            RefitClient(s.url, token=TOKENS["a"]) as a,
        ):
            await published(a, "ma", 7)
            stale = await a.acquire_lease("ma", 1)
        new = Daemon(
            daemon_config(node_id="src", allow=("http://127.0.0.1:*",)),
            secret=SECRET,
            boot_id=SAME_HOST,
        )
        async with served(new, access=tenants_access(tmp_path)) as s2:
            async with RefitClient(s2.url, token=TOKENS["b"]) as b:
                theirs = await published(b, "mb", 9)
            seg = SharedSegment.create(NBYTES, "dst")
            with seg:
                dst = (await e.client.attach_region(seg.name, NBYTES)).region_id
                # not read from the old life's records: the lease is asked of the new life
                with pytest.raises(RefitError, match="unknown or was released"):
                    await e.client.pull(presenting(stale, (theirs, 0, dst, 0, NBYTES), url=s2.url))
                assert not (seg.numpy() == 9).any()


# ---------------------------------------------------------------- a mirror still filling


async def test_a_same_host_grant_of_a_version_still_filling_reads_none_of_its_incomplete_chunks(
    tmp_path: Path,
) -> None:
    # The version's region is in the daemon's own table of mirrors still filling, its
    # first half complete, its second not (its bytes, 5s, not yet what the source
    # holds). The grant the lease's records carry is cut to the complete half; the
    # engine's daemon on the same host reads through it and maps the whole segment.
    half = NBYTES // 2
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        info = next(r for r in await h.a.regions() if r.region_id == region)
        with SharedSegment.attach(info.handle, NBYTES) as src:
            src.numpy()[half:] = 5
        m = Mirror("http://source", "ma", 1)
        m.regions = {region: RegionInfo(region, MemoryKind.HOST, "", NBYTES, 0)}
        m.chunks = np.array([[region, 0, half], [region, half, half]], dtype=np.int64)
        m.done = np.array([True, False])
        h.source.filling.add(m)
        try:
            lease = await h.a.acquire_lease("ma", 1)
            assert lease.records is not None
            assert lease.records.scope == {region: [(0, half)]}
            (granted,) = shm_grant(lease.records).regions
            assert SegmentKey.decode(granted.key).extents == [(0, half)]
            async with destination(h) as (dst, seg):
                for row in [
                    (region, half, dst, 0, 16),
                    (region, half - 1, dst, 0, 2),
                    (region, 0, dst, 0, NBYTES),
                ]:
                    with pytest.raises(RefitError, match=r"outside|lease"):
                        await h.engine.pull(presenting(lease, row, url=h.source_url))
                assert not (seg.numpy() == 5).any()
                # the chunk completes: the grant made before still reads only what it
                # named; a lease taken now reads the whole version
                m.mark(np.array([1]))
                with pytest.raises(RefitError, match=r"outside|lease"):
                    await h.engine.pull(
                        presenting(lease, (region, half, dst, 0, 16), url=h.source_url)
                    )
                h.source.filling.remove(m)
                later = await h.a.acquire_lease("ma", 1)
                res = await h.engine.pull(
                    presenting(later, (region, 0, dst, 0, NBYTES), url=h.source_url)
                )
                assert res.path == "shm" and (seg.numpy()[half:] == 5).all()
        finally:
            h.source.filling.remove(m)


# ---------------------------------------------------------------- staging counted


async def test_a_staging_region_handed_back_and_reused_by_another_tenant_is_not_charged_to_the_first(
    tmp_path: Path,
) -> None:
    # a may hold two regions: its published one and one staging region. It hands the
    # staging region back (pooled: it holds memory for nobody) and b packs (before the
    # fix, into that region, which stayed charged to a too). a holds one region now,
    # so it may make one more.
    allow = ("http://127.0.0.1:*",)
    src = Daemon(
        daemon_config(node_id="src", allow=allow, max_regions_per_principal=2),
        secret=SECRET,
        boot_id=SAME_HOST,
    )
    async with (
        served(src, access=tenants_access(tmp_path)) as s,
        RefitClient(s.url, token=TOKENS["a"]) as a,
        RefitClient(s.url, token=TOKENS["b"]) as b,
    ):
        region = await published(a, "ma", 7)
        theirs = await published(b, "mb", 9)
        lease = await a.acquire_lease("ma", 1)
        staging = (await a.peer_pack("ma", 1, lease.lease_id, [whole(region)])).region.region_id
        with pytest.raises(QuotaExceeded):  # a holds two: its cap
            await a.create_region(NBYTES)
        await a.peer_drop(staging, lease.lease_id)
        assert not src.store.holds_memory(staging)  # pooled: nobody's
        b_lease = await b.acquire_lease("mb", 1)
        packed = await b.peer_pack("mb", 1, b_lease.lease_id, [whole(theirs)])
        assert packed.region.region_id != staging and not src.store.holds_memory(staging)
        await a.create_region(NBYTES)  # a holds its version's region alone


async def test_a_staging_region_handed_back_is_reused_by_its_own_lease_only(
    tmp_path: Path,
) -> None:
    # The pool still serves the lease that packed a region (its pages faulted in);
    # another tenant's lease gets a region of its own, and a lease's end deletes it.
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        theirs = await published(h.b, "mb", 9)
        lease = await h.a.acquire_lease("ma", 1)
        staging = (await h.a.peer_pack("ma", 1, lease.lease_id, [whole(region)])).region.region_id
        await h.a.peer_drop(staging, lease.lease_id)
        b_lease = await h.b.acquire_lease("mb", 1)
        other = (await h.b.peer_pack("mb", 1, b_lease.lease_id, [whole(theirs)])).region.region_id
        assert other != staging
        again = (await h.a.peer_pack("ma", 1, lease.lease_id, [whole(region)])).region.region_id
        assert again == staging
        await h.a.peer_drop(staging, lease.lease_id)
        await h.a.release_lease(lease.lease_id)
        await h.b.peer_drop(other, b_lease.lease_id)  # any take reclaims ended leases'
        await h.b.peer_pack("mb", 1, b_lease.lease_id, [whole(theirs)])
        assert staging not in h.source.store.regions


async def test_another_tenant_cannot_hand_back_a_staging_region_a_lease_still_reads(
    tmp_path: Path,
) -> None:
    # b tries to put a's held staging region in the pool (to have it reused, or
    # reaped, under a's reader): with its own lease, with none, with a's lease id
    # spelled with an encoded blank; and to drop a's own region as if it were staging.
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h, raw_session(h, "b") as s:
        region = await published(h.a, "ma", 7)
        await published(h.b, "mb", 9)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        b_lease = await h.b.acquire_lease("mb", 1)
        staging = (await h.a.peer_pack("ma", 1, lease.lease_id, [whole(region)])).region.region_id
        store, pool = h.source.store, h.source.staging
        for spelled in (b_lease.lease_id, "", f"{lease.lease_id}%20", f"%20{lease.lease_id}"):
            got = await status_of(s, "DELETE", f"/v1/peer/staging/{staging}?lease={spelled}")
            assert got in (400, 403, 409), spelled
        assert await status_of(s, "DELETE", f"/v1/peer/staging/{region}") in (403, 409)
        assert pool.is_held(staging) and store.holds_memory(staging)
        # a reads it still, whole, under its lease
        rec = await h.a.peer_regions([staging], lease.lease_id, "ma", 1)
        async with destination(h) as (dst, seg):
            req = presenting(lease, (staging, 0, dst, 0, NBYTES), url=h.source_url)
            res = await h.engine.pull(msgspec.structs.replace(req, grant=rec))
            assert res.path == "shm" and (seg.numpy() == 7).all()
        # handed back by a, the region is pooled (held for nobody, counted for nobody)
        # and its records under a's lease are refused from then on
        await h.a.peer_drop(staging, lease.lease_id)
        assert not pool.is_held(staging) and not store.holds_memory(staging)
        with pytest.raises(RefitError):
            await h.a.peer_regions([staging], lease.lease_id, "ma", 1)


async def test_packs_at_once_after_a_lease_ended_delete_its_pooled_regions_once(
    tmp_path: Path,
) -> None:
    # Each pack first deletes the pooled regions of ended leases, with awaits between:
    # packs at once must not delete one region twice (a pack answered 500, and a
    # TP 2 engine's refit failed, while the lease-only pool was being written).
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        first = await asyncio.gather(
            *(h.a.peer_pack("ma", 1, lease.lease_id, [whole(region)]) for _ in range(4))
        )
        for staged in first:
            await h.a.peer_drop(staged.region.region_id, lease.lease_id)
        await h.a.release_lease(lease.lease_id)
        again = await h.a.acquire_lease("ma", 1)
        packs = await asyncio.gather(
            *(h.a.peer_pack("ma", 1, again.lease_id, [whole(region)]) for _ in range(4))
        )
        ids = {p.region.region_id for p in packs}
        pooled = {s.region.region_id for s in first}
        assert len(ids) == 4 and not ids & pooled
        assert not pooled & {r.region_id for r in h.source.store.regions}
