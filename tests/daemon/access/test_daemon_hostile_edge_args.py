"""A hostile tenant, holding its own token, against the route parameters decoded at
the edge (:mod:`refitd.wire.args`) and the one memory kind (:class:`MemoryKind`): odd
spellings of integers, floats and flags, a parameter given twice or in the path and
the query at once, path parameters with encoded slashes, and old kind spellings.

Each test is one attack, and each is refused. Three got through when they were
written (a 4301-digit integer answered 500; region ids and floats read Unicode
digits, signs, blanks and underscores) and were fixed in :mod:`refitd.wire.args`. Real daemons on 127.0.0.1:0, real HTTP, spelled by hand
(a bare aiohttp session, not the client, which spells each parameter one way).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.granthosts import (
    NBYTES,
    published,
    raw_session,
    status_of,
    two_hosts,
)

from refitd.wire import MemoryKind

pytestmark = pytest.mark.timeout(60)

# ---------------------------------------------------------------- the args at the edge


async def test_an_integer_parameter_of_thousands_of_digits_is_refused_as_the_callers_mistake(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h) as s:
        for digits in (20, 4300, 4301, 6000):
            got = [
                await status_of(s, "GET", "/v1/regions/" + "9" * digits),
                await status_of(s, "GET", "/v1/sources/ma/versions/" + "9" * digits),
                await status_of(s, "GET", "/v1/leases/x?model=ma&version=" + "9" * digits),
            ]
            assert got == [400, 400, 400], digits


async def test_integer_parameters_spelled_other_ways_are_refused(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h) as s:
        await published(h.a, "ma", 7)
        for text in ("١", "1e0", "0x1", "+1", " 1", "1_0", "", "%EF%BC%91", "1%00", "--1"):
            assert await status_of(s, "GET", f"/v1/sources/ma/versions/{text}") in (400, 404), text
        # negative zero is the number 0, not a negative version: answered as 0 is
        assert await status_of(s, "GET", "/v1/sources/ma/versions/-0") == 404
        assert await status_of(s, "GET", "/v1/sources/ma/versions/1") == 200


async def test_region_ids_of_peer_records_spelled_other_ways_are_refused(tmp_path: Path) -> None:
    # ``ids`` is a comma-separated list the route reads itself (not an args field).
    async with two_hosts(tmp_path) as h, raw_session(h) as s:
        await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        q = f"lease={lease.lease_id}&model=ma&version=1"
        got = {
            text: await status_of(s, "GET", f"/v1/peer/regions?ids={text}&{q}")
            for text in ("١", "+1", "%201", "1_0", "1e0", "0x1")
        }
        assert got == dict.fromkeys(got, 400)


async def test_float_parameters_spelled_other_ways_are_refused(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h) as s:
        await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        for text in ("nan", "inf", "-inf", "1e400", "", "0x1p0", "-1"):
            got = await status_of(s, "POST", f"/v1/leases/{lease.lease_id}/renew?ttl={text}")
            assert got == 400, text


async def test_float_parameters_in_unicode_digits_or_underscores_are_refused(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h) as s:
        await published(h.a, "ma", 7)
        lease = await h.a.acquire_lease("ma", 1)
        got = {
            text: await status_of(s, "POST", f"/v1/leases/{lease.lease_id}/renew?ttl={text}")
            for text in ("١٠", "1_0", "%201%20")
        }
        assert got == dict.fromkeys(got, 400)


async def test_a_flag_spelled_oddly_is_refused_and_of_two_the_first_counts(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h) as s:
        for text in ("True", "yes", "on", "2", "", "1%00", "%31%30", "t"):
            assert await status_of(s, "POST", f"/v1/gc?dry_run={text}") == 400, text
        info = await h.a.create_region(NBYTES, label="loose")
        # of dry_run=1&dry_run=0 the first counts: nothing is freed
        async with s.post("/v1/gc?dry_run=1&dry_run=0") as resp:
            assert resp.status == 200
        assert info.region_id in [r.region_id for r in await h.a.regions()]


async def test_path_parameters_with_encoded_slashes_reach_no_other_model(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h, "b") as s:
        await published(h.a, "ma", 7)
        await published(h.b, "mb", 9)
        for model in ("mb%2F..%2Fma", "..%2Fma", "ma%00", "%2e%2e", "mb%2F"):
            got = await status_of(s, "GET", f"/v1/sources/{model}/versions/1/manifest")
            assert got in (400, 403, 404), model


# ---------------------------------------------------------------- the memory kind


async def test_a_region_asked_in_an_old_or_odd_memory_kind_is_refused(tmp_path: Path) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h, "b") as s:
        for kind in ("shm", "cuda_ipc", "HOST", "Host", " host", "host\x00", "", "gpu", 0, None):
            async with s.post("/v1/regions", json={"nbytes": 64, "kind": kind}) as resp:
                assert resp.status == 400, kind
        async with s.post("/v1/regions", json={"nbytes": 64, "kind": "host"}) as resp:
            assert resp.status in (200, 201)
        assert [r.kind for r in await h.b.regions()] == [MemoryKind.HOST]


async def test_a_path_parameter_is_not_overridden_by_a_query_parameter_of_its_name(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as h, raw_session(h, "b") as s:
        mine = await h.b.create_region(64, label="mine")
        theirs = await h.a.create_region(64, label="theirs")
        url = f"/v1/regions/{mine.region_id}?region_id={theirs.region_id}"
        async with s.get(url) as resp:
            assert resp.status == 200
            assert (await resp.json())["region_id"] == mine.region_id
        url = f"/v1/regions/{theirs.region_id}?region_id={mine.region_id}"
        assert await status_of(s, "DELETE", url) in (403, 404)
        assert theirs.region_id in [r.region_id for r in await h.a.regions()]
