"""The lease grant is the credential: a reader presents what the source granted, and
every way of presenting something else is refused (issue 50).

``POST /v1/leases`` answers the source's signed records of everything the lease may
read, with the credential the source itself made for each of its data planes (the
``tcp`` grant: its data server reads nothing outside it, and nothing once the lease
is gone). A pull presents them (``PullRequest.grant``); the pulling daemon verifies
them and reads with them as given, never making one of its own.

Real daemons in this process, real HTTP and the real ``tcp`` data plane
(:mod:`support.granthosts`): each daemon is given its own boot id, so each is
"another host" to the other (the one thing two daemons on one machine cannot
otherwise be made to show).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from support.daemons import served
from support.granthosts import (
    NBYTES,
    SECRET,
    acquainted,
    destination,
    host_daemon,
    presenting,
    published,
    two_hosts,
)

from refitd.errors import AccessDenied, ConflictError, ProtocolError, RefitError
from refitd.wire import PullState
from transports.interface import PeerInfo
from transports.tcp import scoped_grant

pytestmark = pytest.mark.timeout(60)


async def test_the_lease_answer_carries_the_sources_own_tcp_grant_scoped_to_the_lease(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1, manifest=True)
        rec = lease.records
        assert rec is not None and lease.manifest is not None
        rec.verify(SECRET)
        assert rec.lease_id == lease.lease_id and rec.scope == {region: [(0, NBYTES)]}
        tcp = PeerInfo.decode(rec.adverts["tcp"])
        tcp.verify(SECRET)
        advert = h.source.plane.by_scheme["tcp"].advertise()
        # the source's own grant: its advertisement keyed to this lease's ranges
        assert tcp == scoped_grant(advert, lease.lease_id, {region: [(0, NBYTES)]}, SECRET)
        async with destination(h) as (dst, seg):
            res = await h.engine.pull(
                presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
            )
            assert res.state is PullState.DONE and res.path == "tcp"
            assert (seg.numpy() == 7).all()


async def test_a_grant_whose_scope_a_reader_widened_is_refused_and_nothing_moves(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        other = await published(h.a, "mx", 9)
        lease = await h.a.acquire_lease("ma", 1)
        assert lease.records is not None
        widened = msgspec.structs.replace(
            lease.records, scope={**lease.records.scope, other: [(0, NBYTES)]}
        )
        forged = msgspec.structs.replace(lease, records=widened)
        async with destination(h) as (dst, seg):
            with pytest.raises(ProtocolError, match="MAC does not verify"):
                await h.engine.pull(
                    presenting(forged, (other, 0, dst, 0, NBYTES), url=h.source_url)
                )
            # nor a tcp credential swapped for a wider one the reader made itself
            advert = h.source.plane.by_scheme["tcp"].advertise()
            mine = scoped_grant(
                advert,
                lease.lease_id,
                {region: [(0, NBYTES)], other: [(0, NBYTES)]},
                b"not-the-deployment-secret",
            )
            swapped = msgspec.structs.replace(
                lease.records, adverts={**lease.records.adverts, "tcp": mine.encode()}
            )
            forged = msgspec.structs.replace(lease, records=swapped)
            with pytest.raises(ProtocolError, match="MAC does not verify"):
                await h.engine.pull(
                    presenting(forged, (other, 0, dst, 0, NBYTES), url=h.source_url)
                )
            assert not seg.numpy().any()
            assert await h.engine.pulls() == []


async def test_a_grant_presented_after_its_lease_was_released_reads_nothing(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        await h.a.release_lease(lease.lease_id)
        async with destination(h) as (dst, seg):
            with pytest.raises(RefitError, match=f"lease '{lease.lease_id}' is no longer live"):
                await h.engine.pull(
                    presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
                )
            assert not seg.numpy().any()


async def test_a_released_grant_on_a_path_without_lease_checks_is_refused_before_any_read(
    tmp_path: Path,
) -> None:
    # Same boot id: the engine's daemon maps the source's segments (shm), whose reads
    # no data server checks, so the daemon checks the lease at the source first.
    async with two_hosts(tmp_path, engine_boot="host-a") as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        await h.a.release_lease(lease.lease_id)
        async with destination(h) as (dst, seg):
            with pytest.raises(ConflictError, match=lease.lease_id):
                await h.engine.pull(
                    presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
                )
            assert not seg.numpy().any()
            assert [p.pull_id for p in await h.engine.pulls()] == ["p1"]  # acquainted's


async def test_one_leases_grant_is_refused_under_another_lease(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        first = await h.a.acquire_lease("ma", 1)
        second = await h.a.acquire_lease("ma", 1)
        async with destination(h) as (dst, seg):
            req = presenting(second, (region, 0, dst, 0, NBYTES), url=h.source_url)
            with pytest.raises(AccessDenied, match="a pull reads only with its own lease's grant"):
                await h.engine.pull(msgspec.structs.replace(req, grant=first.records))
            assert not seg.numpy().any()


async def test_one_tenants_grant_reads_no_region_of_another_tenant(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h:
        await acquainted(h, await published(h.a, "ma", 7))
        theirs = await published(h.b, "mb", 9)
        lease = await h.a.acquire_lease("ma", 1)
        assert lease.records is not None and theirs not in lease.records.scope
        async with destination(h) as (dst, seg):
            with pytest.raises(ProtocolError, match=f"region {theirs}.*not recorded"):
                await h.engine.pull(
                    presenting(lease, (theirs, 0, dst, 0, NBYTES), url=h.source_url)
                )
            assert not seg.numpy().any()
            assert [p.pull_id for p in await h.engine.pulls()] == ["p1"]  # acquainted's


async def test_a_grant_of_another_daemon_is_not_read_with_its_source_is_asked(
    tmp_path: Path,
) -> None:
    # Records a third daemon signed, presented for a pull from the source: the engine's
    # daemon reads nothing with them, and the source refuses the lease it never made.
    other = host_daemon("other", "host-c")
    async with two_hosts(tmp_path) as h, served(other) as o:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        theirs = await published(o.client, "ma", 9)
        lease = await o.client.acquire_lease("ma", 1)
        assert lease.records is not None and lease.records.node_id == "other"
        async with destination(h) as (dst, seg):
            with pytest.raises(ConflictError, match=lease.lease_id):
                await h.engine.pull(
                    presenting(lease, (theirs, 0, dst, 0, NBYTES), url=h.source_url)
                )
            assert not seg.numpy().any()
            assert [p.pull_id for p in await h.engine.pulls()] == ["p1"]  # acquainted's
