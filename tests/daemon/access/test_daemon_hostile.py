"""Hostile input to HTTP API v1 fails closed: malformed bodies and descriptor payloads.

Every request here is a client mistake or an attack: it must be refused with a 4xx
in the ``{"error", "detail"}`` shape (never a 5xx; the one 502 is a peer that does
not answer, see its test), and afterwards the daemon must
still answer health and execute a valid local pull byte-exact, with nothing written
into the destination region by the refused requests. The ``env`` fixture
(``support.hostile``) checks that last part once per test, when the test ends.
Manifests, leases and expert pools: ``test_daemon_hostile_state.py``.

A real daemon serves on 127.0.0.1:0 (shared-memory data plane, no UCX), and raw
bodies go through a real aiohttp session so malformed bytes reach the server as is.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.daemons import daemon_config, served, token_file
from support.hostile import (
    W_BYTES,
    Env,
    pull_body,
    rows,
    toy_manifest,
)

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.errors import AccessError
from refitd.wire import (
    MSGPACK,
    DescriptorTable,
    PullRequest,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- malformed bodies

JSON = "application/json"
LEASES = "/v1/leases"


@pytest.mark.parametrize(
    ("raw", "ctype"),
    [
        (b"{not json", JSON),
        (b"\xc1\xc1\xc1", MSGPACK),  # 0xc1 is never used in msgpack
        (b"", JSON),
        (b"", MSGPACK),
        (b"[]", JSON),
        (b"null", JSON),
        (b'{"model": "toy"', JSON),
        (b"\xff\xfe\x00", JSON),
        # A valid body under the other encoding's content type.
        (b'{"model": "toy", "version": 1}', MSGPACK),
        (msgspec.msgpack.encode({"model": "toy", "version": 1}), JSON),
        (b"\x00" * 64, "application/octet-stream"),
    ],
)
async def test_an_undecodable_lease_body_is_refused_with_400(
    env: Env, raw: bytes, ctype: str
) -> None:
    detail = await env.refused("POST", LEASES, raw=raw, ctype=ctype, status=400)
    assert "body refused" in detail


@pytest.mark.parametrize(
    "value",
    [
        {"model": 1, "version": 1},
        {"model": "toy", "version": "1"},
        {"model": "toy"},
        {"version": 1},
        {"model": "toy", "version": 1, "ttl_s": "long"},
        {"model": "toy", "version": 2**64 - 1},
        {"model": "toy", "version": -1},
        {"model": "", "version": 1},
        {"model": "x" * 10_000, "version": 1},
        {"model": ["toy"], "version": 1},
    ],
)
async def test_a_lease_request_of_the_wrong_shape_is_refused(env: Env, value: Any) -> None:
    await env.refused("POST", LEASES, value, status=(400, 404))


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 2.0**63])
async def test_a_lease_ttl_that_is_not_a_sane_positive_duration_is_refused(
    env: Env, ttl: float
) -> None:
    detail = await env.refused(
        "POST", LEASES, {"model": "toy", "version": 1, "ttl_s": ttl}, status=400
    )
    assert "ttl_s" in detail


async def test_nan_in_a_json_body_is_refused(env: Env) -> None:
    raw = b'{"model": "toy", "version": 1, "ttl_s": NaN}'
    await env.refused("POST", LEASES, raw=raw, ctype=JSON, status=400)


async def test_a_number_too_large_for_64_bits_is_refused(env: Env) -> None:
    raw = b'{"model": "toy", "version": 18446744073709551616}'  # 2**64
    await env.refused("POST", LEASES, raw=raw, ctype=JSON, status=400)


@pytest.mark.parametrize(
    "value",
    [
        {"nbytes": -1},
        {"nbytes": 0},
        {"nbytes": 2**63},
        {"nbytes": 2**64 - 1},
        {"nbytes": 2**62},  # no host can map 4 EiB
        {"nbytes": 64, "kind": "tape"},
        {"nbytes": "64"},
        {"nbytes": 64.5},
        {},
    ],
)
async def test_a_region_create_that_no_memory_can_satisfy_is_refused(env: Env, value: Any) -> None:
    before = len(env.daemon.store.regions)
    await env.refused("POST", "/v1/regions", value)
    assert len(env.daemon.store.regions) == before


@pytest.mark.parametrize(
    "value",
    [
        {"handle": "../../etc/passwd", "nbytes": 64},
        {"handle": "no-such-segment", "nbytes": 64},
        {"handle": "", "nbytes": 64},
        {"handle": "x/y", "nbytes": 64},
        {"handle": "no-such-segment", "nbytes": 2**63},
    ],
)
async def test_attaching_a_segment_that_is_not_ours_to_map_is_refused(env: Env, value: Any) -> None:
    await env.refused("POST", "/v1/regions/attach", value)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/regions/abc",
        "/v1/regions/99999999999999999999999",
        "/v1/regions/-1",
        "/v1/sources/toy/versions/abc",
        "/v1/sources/toy/versions/99999999999999999999999999",
        "/v1/pulls/nope",
        "/v1/leases/nope?version=x",
        "/v1/peer/regions?ids=a,b",
        "/v1/peer/regions?ids=99999999999999999999999",
        "/v1/no/such/route",
    ],
)
async def test_a_malformed_or_unknown_path_is_refused(env: Env, path: str) -> None:
    await env.refused("GET", path, raw=b"", ctype=None)


# ---------------------------------------------------------------- descriptor payloads

PULLS = "/v1/pulls"


async def test_a_descriptor_table_that_is_not_whole_rows_is_refused(env: Env) -> None:
    table = rows([env.src, 0, env.dst, 0, W_BYTES])[:-3]
    detail = await env.refused("POST", PULLS, pull_body(env, table), status=400)
    assert "40-byte rows" in detail


async def test_a_descriptor_table_sent_as_a_list_of_dicts_is_refused(env: Env) -> None:
    body = pull_body(env, b"")
    body["descriptors"] = [{"src_region": env.src}]
    await env.refused("POST", PULLS, body, status=400)


def _bad_rows(env: Env) -> dict[str, list[int]]:
    s, d, big = env.src, env.dst, 2**63 - 1
    return {
        "offset+nbytes overflows int64": [s, big, d, 0, big],
        "dst offset+nbytes overflows int64": [s, 0, d, big, 16],
        "nbytes near int64 max": [s, 0, d, 0, big],
        "negative source offset": [s, -8, d, 0, 8],
        "negative destination offset": [s, 0, d, -8, 8],
        "negative length": [s, 8, d, 8, -8],
        "most negative length": [s, 0, d, 0, -(2**63)],
        "source range past the region": [s, 120, d, 0, 16],
        "destination range past the region": [s, 0, d, 120, 16],
        "unknown source region": [12345, 0, d, 0, 8],
        "unknown destination region": [s, 0, 12345, 0, 8],
        "negative region id": [-1, 0, d, 0, 8],
    }


BAD_ROW_CASES = [
    "offset+nbytes overflows int64",
    "dst offset+nbytes overflows int64",
    "nbytes near int64 max",
    "negative source offset",
    "negative destination offset",
    "negative length",
    "most negative length",
    "source range past the region",
    "destination range past the region",
    "unknown source region",
    "unknown destination region",
    "negative region id",
]


@pytest.mark.parametrize("case", BAD_ROW_CASES)
async def test_a_plan_with_one_bad_descriptor_moves_no_byte(env: Env, case: str) -> None:
    """The bad row comes after a good one: the good one must not have been copied."""
    good = [env.src, 0, env.dst, 0, 8]
    detail = await env.refused("POST", PULLS, pull_body(env, rows(good, _bad_rows(env)[case])))
    assert "descriptor 1" in detail or "region" in detail


async def test_a_plan_with_only_zero_length_rows_moves_nothing(env: Env) -> None:
    """Zero-length reads inside both regions are legal and move no byte."""
    body = pull_body(
        env, rows([env.src, 0, env.dst, 0, 0], [env.src, W_BYTES, env.dst, W_BYTES, 0])
    )
    code, res = await env.send("POST", PULLS, msgspec.msgpack.encode(body))
    assert code == 202, res
    done = await env.client.wait_pull(res["pull_id"])
    assert done.bytes_done == 0


async def test_a_plan_writing_one_destination_byte_twice_is_refused(env: Env) -> None:
    """Two reads landing on overlapping destination bytes leave the result up to the
    order the copies ran in: such a plan is refused whole."""
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 16], [env.src, 32, env.dst, 8, 16]))
    detail = await env.refused("POST", PULLS, body, status=400)
    assert "overlap" in detail


async def test_a_pack_spec_landing_on_a_descriptors_bytes_is_refused(env: Env) -> None:
    spec = [env.src, 0, [4], [1], 4, env.dst, 8]  # 16 packed bytes at dst+8
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 16]), pack_specs=[spec])
    detail = await env.refused("POST", PULLS, body, status=400)
    assert "descriptor 0 and pack spec 0" in detail


async def test_an_exact_duplicate_descriptor_is_refused(env: Env) -> None:
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 16], [env.src, 0, env.dst, 0, 16]))
    await env.refused("POST", PULLS, body, status=400)


async def test_a_pull_into_a_region_of_another_owner_is_refused(tmp_path: Path) -> None:
    """With bearer tokens on, bob may not pull into alice's region, even under his own
    valid lease and with in-bounds descriptors; alice's bytes stay untouched."""
    tokens = token_file(tmp_path, {"alice": "a1", "bob": "b2"})
    opts = daemon_config(node_id="auth", transport="shm", shutdown_grace_s=0.5)
    daemon = Daemon(opts)
    async with (
        served(daemon, access=ServerConfig(port=0, token_file=tokens)) as s,
        RefitClient(s.url, token="a1") as alice,
        RefitClient(s.url, token="b2") as bob,
    ):
        src = await bob.create_region(W_BYTES)
        await bob.publish(toy_manifest(src.region_id))
        lease = await bob.acquire_lease("toy", 1)
        mine = await alice.create_region(W_BYTES)
        req = PullRequest(
            "toy",
            1,
            lease.lease_id,
            DescriptorTable(rows([src.region_id, 0, mine.region_id, 0, 8])),
        )
        with pytest.raises(AccessError, match=f"region {mine.region_id}"):
            await bob.submit_pull(req)
        assert await bob.pulls() == []
        with SharedSegment.attach(mine.handle, W_BYTES) as seg:
            assert not seg.numpy(np.uint8).any()


async def test_a_pull_into_a_leased_versions_own_bytes_is_refused(env: Env) -> None:
    """Writing into the source region of 'toy' v1 while it is leased would tear what
    the leaseholder reads: refused, and the source bytes are unchanged."""
    body = pull_body(env, rows([env.src, 0, env.src, 64, 16]))
    detail = await env.refused("POST", PULLS, body, status=409)
    assert f"region {env.src}" in detail and "leased" in detail
    info = env.daemon.store.regions.get(env.src)
    with SharedSegment.attach(info.handle, W_BYTES) as seg:
        assert np.array_equal(seg.numpy(np.float32), env.expected)


async def test_a_million_descriptor_rows_are_refused_as_too_large(env: Env) -> None:
    table = np.zeros((1_000_000, 5), dtype="<i8").tobytes()
    detail = await env.refused("POST", PULLS, pull_body(env, table), status=413)
    assert "too large" in detail


@pytest.mark.parametrize(
    "spec",
    [
        [0, 0, [2**62, 2**62], [1, 1], 4, 0, 0],  # shape product overflows int64
        [0, 0, [4], [2**62], 4, 0, 0],  # strides reach past any region
        [0, 0, [4], [-1], 4, 0, 0],  # negative stride reaches before the region
        [0, 0, [-4], [1], 4, 0, 0],
        [0, 0, [4, 4], [1], 4, 0, 0],  # rank mismatch
        [0, 0, [4], [1], 0, 0, 0],  # zero itemsize
        [0, 2**63, [4], [1], 4, 0, 0],
        [0, 0, [8], [1], 4, 0, 2**63],
    ],
)
async def test_a_hostile_pack_spec_is_refused(env: Env, spec: list[Any]) -> None:
    spec = list(spec)
    spec[0], spec[5] = env.src, env.dst
    await env.refused("POST", PULLS, pull_body(env, b"", pack_specs=[spec]))


async def test_a_pull_under_an_unknown_lease_is_refused(env: Env) -> None:
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 8]))
    body["lease_id"] = "l0-forged"
    await env.refused("POST", PULLS, body, status=409)


async def test_a_pull_naming_an_unreachable_source_fails_as_a_gateway_error(env: Env) -> None:
    """The one 5xx here on purpose: the request is well formed, but the peer it names
    does not answer, which is 502 (the daemon's upstream failed), in the error shape."""
    env.daemon.peers.trust("http://127.0.0.1:1")  # trusted, so it is contacted
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 8]), source="http://127.0.0.1:1")
    code, res = await env.send("POST", PULLS, msgspec.msgpack.encode(body))
    assert code == 502 and res["error"] == "TransportError", res
    assert "127.0.0.1:1" in res["detail"]
    assert await env.client.pulls() == []


# Mostly in range (so accepted plans occur), else just past the edges or int64's.
_value = st.one_of(
    st.integers(0, W_BYTES // 2),
    st.integers(-8, W_BYTES + 8),
    st.sampled_from([2**31, 2**63 - 1, -(2**63), -(2**63) + 1]),
)
_known = st.sampled_from([True, True, True, True, False])  # False: region 999, unrecorded
_row = st.tuples(_known, _value, _known, _value, _value)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(_row, min_size=1, max_size=4))
async def test_a_plan_is_accepted_exactly_when_every_row_is_in_bounds_and_disjoint(
    env: Env, drawn: list[tuple[bool, int, bool, int, int]]
) -> None:
    """Rows near and far past the region edges (and int64's): the daemon accepts the
    plan iff every row lies in its regions and no two write the same byte; a refused
    plan is a 4xx and writes nothing, an accepted one writes exactly its ranges."""
    table = [
        [env.src if s else 999, so, env.dst if d else 999, do, nb] for s, so, d, do, nb in drawn
    ]

    def fits(off: int, nb: int) -> bool:
        return off >= 0 and nb >= 0 and off + nb <= W_BYTES

    ok = all(s and d and fits(so, nb) and fits(do, nb) for s, so, d, do, nb in drawn)
    spans = sorted((do, do + nb) for *_, do, nb in drawn if nb > 0)
    ok = ok and all(b[0] >= a[1] for a, b in itertools.pairwise(spans))
    event("accepted" if ok else "refused")
    # The daemon serves every example: each starts from zeros, whatever the one before
    # left (one that failed halfway included), so it never meets an earlier one's bytes.
    dst = env.dseg.numpy(np.uint8)
    dst[:] = 0
    code, body = await env.send("POST", PULLS, msgspec.msgpack.encode(pull_body(env, rows(*table))))
    if not ok:
        assert 400 <= code < 500 and body["error"] and body["detail"], (table, code, body)
        assert not dst.any(), table
        return
    assert code == 202, (table, body)
    done = await env.client.wait_pull(body["pull_id"])
    assert done.bytes_done == sum(r[4] for r in table)
    want = np.zeros(W_BYTES, np.uint8)
    src = env.expected.view(np.uint8)
    for _, so, _, do, nb in table:
        want[do : do + nb] = src[so : so + nb]
    assert np.array_equal(dst, want), table
    dst[:] = 0  # the fixture's last check starts from zeros


async def test_a_client_region_labelled_staging_cannot_be_released_into_the_pool(
    env: Env,
) -> None:
    """Only staging regions the daemon made for pack specs may join its reuse pool; a
    client's region named "staging" would otherwise be packed over later."""
    code, info = await env.send(
        "POST", "/v1/regions", msgspec.msgpack.encode({"nbytes": 64, "label": "staging"})
    )
    assert code == 201, info
    rid = info["region_id"]
    detail = await env.refused("DELETE", f"/v1/peer/staging/{rid}", raw=b"", ctype=None, status=409)
    assert f"region {rid}" in detail
    assert env.daemon.store.regions.get(rid).label == "staging"


@pytest.mark.parametrize(
    "case",
    ["forged lease", "unknown source region", "source past its region", "negative stride"],
)
async def test_a_hostile_peer_pack_request_packs_nothing(env: Env, case: str) -> None:
    spec = {
        "unknown source region": [999, 0, [4], [1], 4, 0, 0],
        "source past its region": [env.src, 120, [4], [1], 4, 0, 0],
        "negative stride": [env.src, 0, [4], [-1], 4, 0, 0],
    }.get(case, [env.src, 0, [4], [1], 4, 0, 0])
    lease = "l0-forged" if case == "forged lease" else env.lease
    body = {"model": "toy", "version": 1, "lease_id": lease, "specs": [spec]}
    before = len(env.daemon.store.regions)
    await env.refused("POST", "/v1/peer/pack", body)
    assert len(env.daemon.store.regions) == before, "a refused pack made a staging region"


async def test_a_pack_request_naming_no_spec_is_refused(env: Env) -> None:
    before = len(env.daemon.store.regions)
    body = {"model": "toy", "version": 1, "lease_id": env.lease, "specs": []}
    detail = await env.refused("POST", "/v1/peer/pack", body, status=400)
    assert "no pack spec" in detail
    assert len(env.daemon.store.regions) == before, "an empty pack made a staging region"


async def test_staging_a_reader_never_released_is_reclaimed_when_its_lease_ends(
    env: Env,
) -> None:
    def pack_body(lease_id: str) -> bytes:
        spec = [env.src, 0, [4], [1], 4, 0, 0]
        return msgspec.msgpack.encode(
            {"model": "toy", "version": 1, "lease_id": lease_id, "specs": [spec]}
        )

    careless = await env.client.acquire_lease("toy", 1, ttl_s=60)
    before = len(env.daemon.store.regions)
    for _ in range(3):  # a careless reader: packs, never calls DELETE /peer/staging
        code, _ = await env.send("POST", "/v1/peer/pack", pack_body(careless.lease_id))
        assert code == 201
    assert len(env.daemon.store.regions) == before + 3
    await env.client.release_lease(careless.lease_id)
    # The next pack, under any lease, first frees what the ended lease held (deleted,
    # never repacked: that reader may still be reading it).
    code, _ = await env.send("POST", "/v1/peer/pack", pack_body(env.lease))
    assert code == 201
    assert len(env.daemon.store.regions) == before + 1, "the ended lease's staging was not freed"
