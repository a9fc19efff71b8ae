"""Hostile input to HTTP API v1 fails closed: manifests, leases and expert pools.

The same contract as ``test_daemon_hostile.py``: each request is refused with a 4xx in
the ``{"error", "detail"}`` shape, and afterwards the daemon still serves a valid pull
byte-exact with nothing written by the refused requests (checked by the ``env``
fixture, ``support.hostile``, when each test ends).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from support.hostile import (
    W_BYTES,
    Env,
    pull_body,
    rows,
)

pytestmark = pytest.mark.timeout(60)

LEASES = "/v1/leases"
PULLS = "/v1/pulls"


# ---------------------------------------------------------------- manifests

SOURCES = "/v1/sources"


def manifest(
    region: int, *tensors: list[Any], version: int = 2, part: int = 0, parts: int = 1
) -> dict[str, Any]:
    return {
        "model": "toy",
        "version": version,
        "part": part,
        "expected_parts": parts,
        "tensors": list(tensors),
    }


def _bad_tensors(r: int) -> dict[str, list[Any]]:
    return {
        "shard outside the global shape": ["w", [4, 8], "float32", [[[2, 0], [4, 8], r, 0]]],
        "shard at a negative offset": ["w", [4, 8], "float32", [[[-1, 0], [4, 8], r, 0]]],
        "shard of negative shape": ["w", [4, 8], "float32", [[[0, 0], [-4, 8], r, 0]]],
        "shard overrunning its region": ["w", [8, 8], "float32", [[[0, 0], [8, 8], r, 0]]],
        "shard at a byte offset past its region": ["w", [1], "float32", [[[0], [1], r, 2**63]]],
        "shard of a huge shape": ["w", [2**62, 2**62], "float32", [[[0, 0], [2**62, 2**62], r, 0]]],
        "unknown dtype": ["w", [4, 8], "float33", [[[0, 0], [4, 8], r, 0]]],
        "rank mismatch": ["w", [4, 8], "float32", [[[0], [4], r, 0]]],
        "unknown region": ["w", [4, 8], "float32", [[[0, 0], [4, 8], 999, 0]]],
        "negative global shape": ["w", [-4, 8], "float32", []],
        "huge global shape": ["w", [2**64 - 1], "float32", []],
    }


MANIFEST_CASES = list(_bad_tensors(0))


@pytest.mark.parametrize("case", MANIFEST_CASES)
async def test_a_hostile_manifest_is_refused_and_publishes_nothing(env: Env, case: str) -> None:
    await env.refused("POST", SOURCES, manifest(env.src, _bad_tensors(env.src)[case]))
    assert [v.version for v in await env.client.versions("toy")] == [1]


async def test_a_manifest_naming_one_tensor_twice_is_refused(env: Env) -> None:
    t = ["w", [4, 8], "float32", [[[0, 0], [4, 8], env.src, 0]]]
    await env.refused("POST", SOURCES, manifest(env.src, t, t), status=(400, 409))
    assert [v.version for v in await env.client.versions("toy")] == [1]


async def test_a_publisher_part_published_twice_counts_once(env: Env) -> None:
    """A retried publish replaces its part: it never counts as a second part, so a
    two-part version stays pending until part 1 publishes."""
    t = ["w", [4, 8], "float32", [[[0, 0], [2, 8], env.src, 0]]]
    for _ in range(2):
        code, body = await env.send(
            "POST", SOURCES, msgspec.msgpack.encode(manifest(env.src, t, parts=2))
        )
        assert code == 201, body
    assert body["published_parts"] == [0] and body["state"] == "pending"
    await env.refused("GET", "/v1/sources/toy/versions/2/manifest", raw=b"", ctype=None, status=409)


@pytest.mark.parametrize(
    "field",
    [
        {"part": 2, "expected_parts": 2},
        {"expected_parts": 0},
        {"part": -1},
        {"expected_parts": 2**64 - 1, "part": 2**63},
    ],
)
async def test_a_part_outside_the_expected_parts_is_refused(
    env: Env, field: dict[str, int]
) -> None:
    t = ["w", [4, 8], "float32", [[[0, 0], [4, 8], env.src, 0]]]
    body = manifest(env.src, t)
    body.update(field)
    await env.refused("POST", SOURCES, body)


async def test_republishing_a_leased_version_is_refused(env: Env) -> None:
    t = ["w", [4, 8], "float32", [[[0, 0], [4, 8], env.src, 0]]]
    await env.refused("POST", SOURCES, manifest(env.src, t, version=1), status=409)


async def test_a_zero_size_tensor_publishes_and_its_manifest_is_served(env: Env) -> None:
    """Zero-size shapes are legal (an empty expert bank): no 5xx on publish or fetch."""
    t = ["e", [0, 8], "float32", [[[0, 0], [0, 8], env.src, W_BYTES]]]
    code, body = await env.send("POST", SOURCES, msgspec.msgpack.encode(manifest(env.src, t)))
    assert code == 201, body
    merged = await env.client.manifest("toy", 2)
    assert [(x.name, x.shape) for x in merged.tensors] == [("e", (0, 8))]


async def test_an_older_version_after_a_newer_one_does_not_become_latest(env: Env) -> None:
    """Versions out of order: publishing v0 after v1 is refused or leaves v1 latest."""
    t = ["w", [4, 8], "float32", [[[0, 0], [4, 8], env.src, 0]]]
    code, body = await env.send(
        "POST", SOURCES, msgspec.msgpack.encode(manifest(env.src, t, version=0))
    )
    assert code < 500, body
    assert (await env.client.version("toy", "latest")).version == 1


# ---------------------------------------------------------------- leases


@pytest.mark.parametrize("ttl", ["0", "-1", "nan", "inf", "-inf", "1e308", "abc", ""])
async def test_renewing_with_a_ttl_that_is_not_a_sane_duration_is_refused(
    env: Env, ttl: str
) -> None:
    detail = await env.refused(
        "POST", f"{LEASES}/{env.lease}/renew?ttl={ttl}", raw=b"", ctype=None, status=400
    )
    assert "ttl" in detail
    # The lease still holds, so the pull the fixture runs at the end can use it.
    await env.client.check_lease(env.lease, "toy", 1)


@pytest.mark.parametrize("lease", ["l0-unknown", "x" * 5000, "%00", "..%2F.."])
async def test_renewing_an_unknown_lease_is_refused_with_409(env: Env, lease: str) -> None:
    await env.refused("POST", f"{LEASES}/{lease}/renew", raw=b"", ctype=None, status=(404, 409))


async def test_a_released_lease_cannot_be_renewed_or_pulled_under(env: Env) -> None:
    grant = await env.client.acquire_lease("toy", 1, ttl_s=30)
    await env.client.release_lease(grant.lease_id)
    await env.refused("POST", f"{LEASES}/{grant.lease_id}/renew", raw=b"", ctype=None, status=409)
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 8]))
    body["lease_id"] = grant.lease_id
    await env.refused("POST", PULLS, body, status=409)


async def test_an_expired_lease_cannot_be_renewed_or_pulled_under(env: Env) -> None:
    grant = await env.client.acquire_lease("toy", 1, ttl_s=5)
    env.clock.now += 6
    detail = await env.refused(
        "POST", f"{LEASES}/{grant.lease_id}/renew", raw=b"", ctype=None, status=409
    )
    assert "expired" in detail
    body = pull_body(env, rows([env.src, 0, env.dst, 0, 8]))
    body["lease_id"] = grant.lease_id
    await env.refused("POST", PULLS, body, status=409)


async def test_releasing_an_unknown_lease_is_404_and_leaves_live_leases_alone(
    env: Env,
) -> None:
    code, _ = await env.send("DELETE", f"{LEASES}/l0-unknown", None, None)
    assert code == 404
    await env.client.check_lease(env.lease, "toy", 1)


async def test_a_lease_on_a_version_that_does_not_exist_is_refused(env: Env) -> None:
    await env.refused("POST", LEASES, {"model": "toy", "version": 7}, status=404)
    await env.refused("POST", LEASES, {"model": "nope", "version": 1}, status=404)


@pytest.mark.parametrize("seconds", ["nan", "-1", "abc", "inf"])
async def test_a_drain_or_wait_with_a_nonsense_timeout_is_refused(env: Env, seconds: str) -> None:
    await env.refused(
        "POST",
        f"/v1/sources/toy/versions/1/drain?timeout={seconds}",
        raw=b"",
        ctype=None,
        status=400,
    )
    await env.refused("GET", f"/v1/pulls/p0/wait?timeout={seconds}", raw=b"", ctype=None)


# ---------------------------------------------------------------- expert pools

EXPERTS = "/v1/experts"


def pool(**kw: Any) -> dict[str, Any]:
    return {"name": "p", "layers": 2, "experts": 4, "slots": 4, "row_bytes": [16], **kw}


@pytest.mark.parametrize(
    "kw",
    [
        {"layers": 0},
        {"layers": -1},
        {"experts": 0},
        {"slots": 0},
        {"row_bytes": [0]},
        {"row_bytes": [-16]},
        {"row_bytes": []},
        {"slots": 3},  # smaller than one layer's experts
        {"layers": 2**62, "experts": 2**62, "slots": 2**62},  # bytes overflow int64
        {"row_bytes": [2**40], "slots": 2**30, "experts": 4},  # no host maps that
        {"name": "../etc"},
        {"name": ""},
        {"residency": ["pageable", "pinned"]},  # a pageable layer not in cpu_layers
        {"cpu_layers": [5]},
    ],
)
async def test_a_pool_geometry_no_memory_can_hold_is_refused(env: Env, kw: dict[str, Any]) -> None:
    before = len(env.daemon.store.regions)
    await env.refused("POST", EXPERTS, pool(**kw))
    assert len(env.daemon.store.regions) == before, "a refused pool left a region behind"
    assert await env.client.pools() == []


@pytest.mark.parametrize(
    "req",
    [
        {"layer": 2, "routed": [0]},
        {"layer": 2**63, "routed": [0]},
        {"layer": -1, "routed": [0]},
        {"layer": 0, "routed": [4]},
        {"layer": 0, "routed": [2**63]},
        {"layer": 0, "routed": [-1]},
        {"layer": 0, "routed": [0, 1, 2, 3, 4]},
        {"layer": 0},
    ],
)
async def test_an_ensure_outside_the_pool_is_refused(env: Env, req: dict[str, Any]) -> None:
    code, body = await env.send("POST", EXPERTS, msgspec.msgpack.encode(pool()))
    assert code == 201, body
    await env.refused("POST", f"{EXPERTS}/p/ensure", req)
    assert (await env.client.pool("p")).copied_bytes == 0


async def test_duplicate_routes_in_one_ensure_share_one_slot(env: Env) -> None:
    code, body = await env.send("POST", EXPERTS, msgspec.msgpack.encode(pool()))
    assert code == 201, body
    res = await env.client.ensure("p", 0, [1, 1, 1, 2])
    assert res.slots[0] == res.slots[1] == res.slots[2] != res.slots[3]


@pytest.mark.parametrize(
    "req", [{"experts": [[0, 4]]}, {"experts": [[2, 0]]}, {"layers": [9]}, {"experts": [[0]]}]
)
async def test_invalidating_experts_outside_the_pool_is_refused(
    env: Env, req: dict[str, Any]
) -> None:
    code, body = await env.send("POST", EXPERTS, msgspec.msgpack.encode(pool()))
    assert code == 201, body
    await env.refused("POST", f"{EXPERTS}/p/invalidate", req)


async def test_an_unknown_pool_is_refused_with_404(env: Env) -> None:
    await env.refused("POST", f"{EXPERTS}/nope/ensure", {"layer": 0, "routed": [0]}, status=404)
