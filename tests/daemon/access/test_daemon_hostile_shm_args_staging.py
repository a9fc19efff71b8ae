"""A hostile tenant, holding its own token, against the same-host ``shm`` grant the
source makes for a lease, the route parameters decoded at the edge, and the staging
pool's count of who holds its regions.

Each test is one attack. An attack refused passes; one that gets through is marked
``xfail(strict=True)`` with the hole in its reason, so it fails once the hole is
closed (then the mark goes).

Real daemons in this process on 127.0.0.1:0 (:mod:`support.granthosts`), real HTTP,
real shared memory: the engine's daemon is given the source's boot id, so it reads
the source's segments over ``shm`` with the grant in the lease's records.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
from support.daemons import daemon_config, served
from support.granthosts import (
    NBYTES,
    SECRET,
    TOKENS,
    Hosts,
    acquainted,
    destination,
    presenting,
    published,
    tenants_access,
    two_hosts,
)

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import ProtocolError, QuotaExceeded, RefitError
from refitd.wire import PackSpec, PeerRegions
from transports.interface import PeerInfo
from transports.segments import SharedSegment
from transports.shm import SegmentKey

pytestmark = pytest.mark.timeout(60)

SAME_HOST = "host-a"
"""The source's boot id: an engine's daemon given it reads the source over ``shm``."""


STAGED_GRANT_OUTLIVES_RELEASE = (
    "hole: a staging region handed back (DELETE /v1/peer/staging) while its lease "
    "lives is pooled and reused for another lease as the same region (same id, data "
    "plane generation, segment name, dev, ino: refitd/daemon/state/staging.py _take); "
    "the records and grants made for the first lease (leasing.peer_regions) still "
    "verify, the lease is still live, and neither the tcp data server (grant scope) nor "
    "the shm connection (SegmentKey extents) asks what is packed for it now"
)


def whole(region: int) -> PackSpec:
    """A pack spec of the first NBYTES bytes of ``region``, one byte a row."""
    return PackSpec(region, 0, (NBYTES,), (1,), 1, 0, 0)


def shm_grant(rec: PeerRegions) -> PeerInfo:
    return PeerInfo.decode(rec.adverts["shm"])


# ---------------------------------------------------------------- the shm grant


@pytest.mark.xfail(strict=True, reason=STAGED_GRANT_OUTLIVES_RELEASE)
async def test_a_staging_grant_kept_past_its_release_reads_nothing_packed_for_another_tenant(
    tmp_path: Path,
) -> None:
    # a packs its own model into staging and asks the records of that staging region
    # under its lease (the grant scopes it to the bytes packed for that lease); it
    # hands the region back, keeps the records, and b's pack reuses the region. a's
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
        assert b_staged.region.region_id == staging  # the pool handed b the same region
        async with destination(h) as (dst, seg):
            req = presenting(lease, (staging, 0, dst, 0, NBYTES), url=h.source_url)
            with contextlib.suppress(RefitError):
                res = await h.engine.pull(msgspec.structs.replace(req, grant=kept))
                assert res.path == "shm"
            assert not (seg.numpy() == 9).any(), "a read b's packed bytes"


@pytest.mark.xfail(strict=True, reason=STAGED_GRANT_OUTLIVES_RELEASE)
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
        assert b_staged.region.region_id == staging
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
                with pytest.raises(RefitError):
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
            for src in (region, theirs):
                with pytest.raises(RefitError):
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
                with pytest.raises(RefitError):
                    await e.client.pull(presenting(stale, (theirs, 0, dst, 0, NBYTES), url=s2.url))
                assert not (seg.numpy() == 9).any()


# ---------------------------------------------------------------- the args at the edge


@contextlib.asynccontextmanager
async def raw(h: Hosts, who: str = "a") -> AsyncIterator[aiohttp.ClientSession]:
    """A bare HTTP session to the source as tenant ``who`` (no client spelling)."""
    headers = {"Authorization": f"Bearer {TOKENS[who]}"}
    async with aiohttp.ClientSession(h.source_url, headers=headers) as session:
        yield session


async def status_of(session: aiohttp.ClientSession, method: str, url: str) -> int:
    async with session.request(method, url) as resp:
        await resp.read()
        return resp.status


@pytest.mark.xfail(
    strict=True,
    reason="hole: an int parameter of more than 4300 digits matches _INT, and int() "
    "raises ValueError (Python's digit limit), which _read (refitd/wire/args.py:266) "
    "does not turn into _Refused: 500, not 400",
)
async def test_an_integer_parameter_of_thousands_of_digits_is_refused_as_the_callers_mistake(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h, raw(h) as s:
        for digits in (20, 4300, 4301, 6000):
            got = [
                await status_of(s, "GET", "/v1/regions/" + "9" * digits),
                await status_of(s, "GET", "/v1/sources/ma/versions/" + "9" * digits),
                await status_of(s, "GET", "/v1/leases/x?model=ma&version=" + "9" * digits),
            ]
            assert got == [400, 400, 400], digits


async def test_integer_parameters_spelled_other_ways_are_refused(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw(h) as s:
        await published(h.a, "ma", 7)
        for text in ("١", "1e0", "0x1", "+1", " 1", "1_0", "", "%EF%BC%91", "1%00", "--1"):
            assert await status_of(s, "GET", f"/v1/sources/ma/versions/{text}") in (400, 404), text
        # negative zero is the number 0, not a negative version: answered as 0 is
        assert await status_of(s, "GET", "/v1/sources/ma/versions/-0") == 404
        assert await status_of(s, "GET", "/v1/sources/ma/versions/1") == 200


@pytest.mark.xfail(
    strict=True,
    reason="hole: PeerRegionsArgs.region_ids (refitd/wire/args.py:203) reads each id "
    "with int(), which takes Unicode digits, a sign, blanks and underscores: the one "
    "spelling of an integer the module promises is not kept for ids",
)
async def test_region_ids_of_peer_records_spelled_other_ways_are_refused(tmp_path: Path) -> None:
    # ``ids`` is a comma-separated list the route reads itself (not an args field).
    async with two_hosts(tmp_path) as h, raw(h) as s:
        await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        q = f"lease={lease.lease_id}&model=ma&version=1"
        got = {
            text: await status_of(s, "GET", f"/v1/peer/regions?ids={text}&{q}")
            for text in ("١", "+1", "%201", "1_0", "1e0", "0x1")
        }
        assert got == dict.fromkeys(got, 400)


async def test_float_parameters_spelled_other_ways_are_refused(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw(h) as s:
        await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        for text in ("nan", "inf", "-inf", "1e400", "", "0x1p0", "-1"):
            got = await status_of(s, "POST", f"/v1/leases/{lease.lease_id}/renew?ttl={text}")
            assert got == 400, text


@pytest.mark.xfail(
    strict=True,
    reason="hole: _read (refitd/wire/args.py:268) reads a float parameter with float(), "
    "which takes Unicode digits, underscores and surrounding blanks, not only 'a finite "
    "decimal number' as the module says",
)
async def test_float_parameters_in_unicode_digits_or_underscores_are_refused(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h, raw(h) as s:
        await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        got = {
            text: await status_of(s, "POST", f"/v1/leases/{lease.lease_id}/renew?ttl={text}")
            for text in ("١٠", "1_0", "%201%20")
        }
        assert got == dict.fromkeys(got, 400)


async def test_a_flag_spelled_oddly_is_refused_and_of_two_the_first_counts(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw(h) as s:
        for text in ("True", "yes", "on", "2", "", "1%00", "%31%30", "t"):
            assert await status_of(s, "POST", f"/v1/gc?dry_run={text}") == 400, text
        info = await h.a.create_region(NBYTES, label="loose")
        # of dry_run=1&dry_run=0 the first counts: nothing is freed
        async with s.post("/v1/gc?dry_run=1&dry_run=0") as resp:
            assert resp.status == 200
        assert info.region_id in [r.region_id for r in await h.a.regions()]


async def test_path_parameters_with_encoded_slashes_reach_no_other_model(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw(h, "b") as s:
        await published(h.a, "ma", 7)
        await published(h.b, "mb", 9)
        for model in ("mb%2F..%2Fma", "..%2Fma", "ma%00", "%2e%2e", "mb%2F"):
            got = await status_of(s, "GET", f"/v1/sources/{model}/versions/1/manifest")
            assert got in (400, 403, 404), model


# ---------------------------------------------------------------- staging counted


@pytest.mark.xfail(
    strict=True,
    reason="hole: a pooled staging region reused for another principal stays in the "
    "first's region (and byte) cap: StagingPool._take/take_for charge the new principal "
    "(RegionStore.charge) without discarding the id from the old one's Cap._held, and "
    "Cap.admit sweeps only ids not alive (RegionStore._alive: holds_memory), which the "
    "reused region is: b's staging counts against a (a cross-tenant denial of a's cap)",
)
async def test_a_staging_region_handed_back_and_reused_by_another_tenant_is_not_charged_to_the_first(
    tmp_path: Path,
) -> None:
    # a may hold two regions: its published one and one staging region. It hands the
    # staging region back (pooled: it holds memory for nobody) and b's pack reuses
    # it. a holds one region now, so it may make one more.
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
        reused = await b.peer_pack("mb", 1, b_lease.lease_id, [whole(theirs)])
        assert reused.region.region_id == staging and src.store.holds_memory(staging)
        await a.create_region(NBYTES)  # a holds its version's region alone


async def test_another_tenant_cannot_hand_back_a_staging_region_a_lease_still_reads(
    tmp_path: Path,
) -> None:
    # b tries to put a's held staging region in the pool (to have it reused, or
    # reaped, under a's reader): with its own lease, with none, with a's lease id
    # spelled with an encoded blank; and to drop a's own region as if it were staging.
    async with two_hosts(tmp_path, engine_boot=SAME_HOST) as h, raw(h, "b") as s:
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
