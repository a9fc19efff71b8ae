"""A hostile tenant against "the lease grant is the credential" (issue 50): with a
valid token of its own, never the deployment secret, it presents grants that are
garbled, stretched past their lease, put under another tenant's model, or replayed,
and crams the source's plan cache. Each attack is refused. Two got through when
they were first written, and fail without their fixes: a grant of another life of the
source (read from that life's data server), and pack specs of very long shapes (kept
past the plan cache's byte budget).

Real daemons in this process on 127.0.0.1:0 with real HTTP and the real ``tcp``
data plane, as in :mod:`test_daemon_grants` (:mod:`support.granthosts`): each daemon
has its own boot id, so each is "another host" to the other.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from support.daemons import served
from support.granthosts import (
    NBYTES,
    TOKENS,
    acquainted,
    destination,
    host_daemon,
    presenting,
    published,
    tenants_access,
    two_hosts,
)
from support.toy import publish_tensor

from refitd.client.http import RefitClient
from refitd.daemon.delta.plans import Plans, plan_digest
from refitd.daemon.pull.plancheck import check_runs
from refitd.errors import AccessDenied, NotFoundError, ProtocolError, RefitError
from refitd.wire import (
    DeltaPackRequest,
    DeltaStreamRequest,
    DescriptorTable,
    PackSpec,
    PullState,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)


async def test_garbled_grants_are_refused_and_the_daemon_still_serves_honest_pulls(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        rec = lease.records
        assert rec is not None
        garbled = [
            msgspec.structs.replace(rec, mac=b""),  # unsigned
            msgspec.structs.replace(rec, mac=b"\x00" * 4096),  # a MAC of any length
            msgspec.structs.replace(rec, adverts={"tcp": b"\xff not msgpack"}),
            msgspec.structs.replace(rec, scope={region: [(NBYTES, -1)]}),
            msgspec.structs.replace(rec, incarnation=rec.incarnation + 1),
            msgspec.structs.replace(rec, node_id="eng"),  # names the reader itself
        ]
        async with destination(h) as (dst, seg):
            for bad in garbled:
                req = presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
                with pytest.raises(ProtocolError, match="MAC does not verify"):
                    await h.engine.pull(msgspec.structs.replace(req, grant=bad))
            # a grant under no lease at all (as records given without one are)
            unleased = h.source.leases.peer_regions([region])
            req = presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
            with pytest.raises(AccessDenied, match="its own lease's grant"):
                await h.engine.pull(msgspec.structs.replace(req, grant=unleased))
            assert not seg.numpy().any()
            # and none of that wedged either daemon: the honest pull still reads
            res = await h.engine.pull(
                presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
            )
            assert res.state is PullState.DONE and (seg.numpy() == 7).all()


async def test_a_grant_reads_nothing_of_its_region_past_the_published_shard(
    tmp_path: Path,
) -> None:
    # The version's shard is the first NBYTES of a region twice that size: the tail
    # is the tenant's own memory but not part of the version, so not of the lease.
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7, size=2 * NBYTES)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        assert lease.records is not None and lease.records.scope == {region: [(0, NBYTES)]}
        async with destination(h) as (dst, seg):
            for row in [(region, NBYTES, dst, 0, NBYTES), (region, NBYTES - 1, dst, 0, 2)]:
                with pytest.raises(RefitError, match=r"outside|lease"):
                    await h.engine.pull(presenting(lease, row, url=h.source_url))
            assert not seg.numpy().any()


async def test_a_grant_put_under_another_tenants_model_reads_none_of_its_bytes(
    tmp_path: Path,
) -> None:
    # The records name no model: a pull that says it reads b's model under a's own
    # lease and grant still reads only what that grant scopes.
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        theirs = await published(h.b, "mb", 9)
        lease = await h.a.acquire_lease("ma", 1)
        async with destination(h) as (dst, seg):
            req = presenting(lease, (theirs, 0, dst, 0, NBYTES), url=h.source_url)
            with pytest.raises(ProtocolError, match=f"region {theirs}.*not recorded"):
                await h.engine.pull(msgspec.structs.replace(req, model="mb"))
            assert not (seg.numpy() == 9).any()


async def test_a_v1_grant_reads_nothing_of_v2_published_since(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        info = await h.a.create_region(NBYTES, label="ma2")
        with SharedSegment.attach(info.handle, info.nbytes) as seg2:
            seg2.numpy()[:] = 8
        await publish_tensor(h.a, "ma", 2, info.region_id, NBYTES)
        async with destination(h) as (dst, seg):
            with pytest.raises(ProtocolError, match="not recorded"):
                await h.engine.pull(
                    presenting(lease, (info.region_id, 0, dst, 0, NBYTES), url=h.source_url)
                )
            req = presenting(lease, (info.region_id, 0, dst, 0, NBYTES), url=h.source_url)
            # nor when the pull says it reads v2
            with pytest.raises(ProtocolError, match="not recorded"):
                await h.engine.pull(msgspec.structs.replace(req, version=2))
            assert not seg.numpy().any()


async def test_a_grant_replayed_after_the_version_is_retired_reads_nothing(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        lease = await h.a.acquire_lease("ma", 1)
        await h.a.release_lease(lease.lease_id)
        await h.a.wait_drain("ma", 1, 5.0, retire=True)
        async with destination(h) as (dst, seg):
            with pytest.raises(RefitError, match=f"lease '{lease.lease_id}' is no longer live"):
                await h.engine.pull(
                    presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url)
                )
            assert not seg.numpy().any()


async def test_a_plan_of_long_pack_spec_shapes_is_not_kept_past_the_byte_budget() -> None:
    # A spec of shape (1,)*N makes one run (check_runs admits it), but its decoded
    # shape and strides hold ~16 N bytes of pointers alone. Over HTTP the routes run
    # check_runs and then Plans.resolve, so such a plan is kept there likewise: a
    # 64 MiB request (server.max_request_bytes) of one-byte ones decodes to ~512 MiB
    # of tuples counted as 128 bytes, 64 of them per principal (KEEP_PER_PRINCIPAL).
    n = 200_000
    spec = PackSpec(1, 0, (1,) * n, (1,) * n, 1, 9, 0)
    assert check_runs(0, [spec], 1 << 22, "delta stream") == 1
    budget = 1 << 20
    plans = Plans(keep_bytes=budget)
    req = DeltaStreamRequest("m", 2, "l1", 1, "d" * 32, DescriptorTable(b""), [spec])
    held = sys.getsizeof(spec.shape) + sys.getsizeof(spec.strides)
    assert held > budget  # what the kept plan holds, decoded (~2 bytes a dimension on the wire)
    _, name = await plans.resolve(req, "a")
    assert name == ""  # not kept: larger than the principal's budget


async def test_a_grant_of_another_life_of_the_source_is_not_read_as_this_ones(
    tmp_path: Path,
) -> None:
    # Two lives of node "src" (as across a restart; here both up at once, so the
    # earlier life's data server still answers): the engine's daemon knows the later
    # one, and a grant the earlier one made is presented for a pull from the later.
    old = host_daemon("src", "host-a")
    async with (
        two_hosts(tmp_path) as h,
        served(old, access=tenants_access(tmp_path)) as o,
        RefitClient(o.url, token=TOKENS["a"]) as a_old,
    ):
        assert old.incarnation != h.source.incarnation
        region = await published(h.a, "ma", 7)
        await acquainted(h, region)
        stale = await published(a_old, "ma", 5)
        lease = await a_old.acquire_lease("ma", 1)
        assert lease.records is not None and lease.records.node_id == "src"
        async with destination(h) as (dst, seg):
            # the source named (the later life) does not know the lease: the pull is
            # refused, but only after the earlier life's bytes were written
            with pytest.raises(RefitError, match=lease.lease_id):
                await h.engine.pull(presenting(lease, (stale, 0, dst, 0, NBYTES), url=h.source_url))
            assert not seg.numpy().any()


async def test_a_tenant_naming_another_tenants_plan_at_the_source_gets_nothing(
    tmp_path: Path,
) -> None:
    # a sends its delta plan once (kept under a, whatever the delta answers); b, with
    # a live lease of its own, names it by its digest: not found, nothing read.
    async with two_hosts(tmp_path) as h:
        region = await published(h.a, "ma", 7)
        await published(h.b, "mb", 9)
        rows = DescriptorTable.pack(np.array([[region, 0, 1, 0, NBYTES]], dtype=np.int64))
        mine = await h.a.acquire_lease("ma", 1)
        sent = DeltaPackRequest("ma", 1, mine.lease_id, 0, "0" * 32, rows)
        name = plan_digest(rows, [])
        with contextlib.suppress(RefitError):  # no delta of v1: the plan is kept anyway
            await h.a.delta_pack(sent)
        own = msgspec.structs.replace(sent, descriptors=DescriptorTable(b""), plan=name)
        with pytest.raises(RefitError) as kept:
            await h.a.delta_pack(own)
        assert not isinstance(kept.value, NotFoundError)  # a's own name is found
        lease = await h.b.acquire_lease("mb", 1)
        named = DeltaPackRequest(
            "mb", 1, lease.lease_id, 0, "0" * 32, DescriptorTable(b""), plan=name
        )
        with pytest.raises(NotFoundError, match="not kept on this daemon"):
            await h.b.delta_pack(named)
