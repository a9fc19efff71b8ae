"""Who sees what is one rule, :meth:`Principal.sees`: every route that names one
tenant's object refuses another tenant (403 ``AccessDenied``), a region's record
excepted (answered without the segment name and process that reach its memory), and
every listing shows a tenant its own objects only.

The routes are read from the route table (:mod:`refitd.wire.routes`): a route added
later for a region, a pull or an expert pool is checked here without a line of this
file changing. Two tenants (two bearer tokens) share a real daemon on 127.0.0.1:0;
tenant ``a`` owns a published source region, a destination region, a pull that read
one into the other, and an expert pool; ``b`` owns nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import served, token_file

from refitd.config import ServerConfig
from refitd.daemon.access.auth import LOOPBACK, Principal
from refitd.wire import routes as api

pytestmark = pytest.mark.timeout(60)

NBYTES = 256
TOKENS = {"a": "token-of-a", "b": "token-of-b"}
MSGPACK = "application/msgpack"

OWNED = ("region_id", "pull_id", "pool")
"""Path parameters that name an object with an owner."""

SHOWN = {api.GET_REGION.path}
"""Routes that answer another tenant too, with less: a region's record is public, the
segment name and process that reach its memory are not."""

NOT_BY_OWNER = {api.PEER_DROP.path: "a staging region is its lease's to drop (the lease rule)"}
"""Routes naming an owned object whose rule is another one."""

BODIES: dict[str, dict[str, Any]] = {
    api.ENSURE.path: {"layer": 0, "routed": [0]},
    api.PREFETCH.path: {"layer": 0, "experts": [0]},
    api.INVALIDATE.path: {"layers": [0]},
}
"""A valid body for each route that decodes one before it looks the object up."""


def owned_routes() -> list[api.Route[Any]]:
    return [
        r for r in api.ROUTES if any(p in OWNED for p in r.params) and r.path not in NOT_BY_OWNER
    ]


@dataclass
class Tenant:
    session: aiohttp.ClientSession
    url: str
    token: str

    async def call(self, method: str, path: str, value: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if value is not None:
            data = msgspec.msgpack.encode(value)
            headers["Content-Type"] = MSGPACK
        async with self.session.request(method, self.url + path, data=data, headers=headers) as r:
            raw = await r.read()
            return r.status, (msgspec.json.decode(raw) if raw else None)

    async def ok(self, method: str, path: str, value: Any = None) -> Any:
        status, res = await self.call(method, path, value)
        assert 200 <= status < 300, (method, path, status, res)
        return res


@dataclass
class Objects:
    a: Tenant
    b: Tenant
    ids: dict[str, str]  # an object of a's per owned path parameter
    pool: str


@contextlib.asynccontextmanager
async def a_owns_everything(tmp: Path) -> AsyncIterator[Objects]:
    access = ServerConfig(port=0, token_file=token_file(tmp, TOKENS))
    async with (
        served(access=access, node_id="sees", transport="shm", max_bytes=1 << 30) as s,
        aiohttp.ClientSession() as session,
    ):
        a, b = (Tenant(session, s.url, TOKENS[n]) for n in ("a", "b"))
        src = await a.ok("POST", "/v1/regions", {"nbytes": NBYTES, "label": "src"})
        shard = [[0], [NBYTES], src["region_id"], 0]
        await a.ok("POST", "/v1/sources", {
            "model": "m", "version": 1, "part": 0, "expected_parts": 1,
            "tensors": [["w", [NBYTES], "uint8", [shard]]],
        })  # fmt: skip
        dst = await a.ok("POST", "/v1/regions", {"nbytes": NBYTES, "label": "dst"})
        lease = await a.ok("POST", "/v1/leases", {"model": "m", "version": 1, "ttl_s": 600})
        table = np.array(
            [[src["region_id"], 0, dst["region_id"], 0, NBYTES]], dtype="<i8"
        ).tobytes()
        pull = await a.ok("POST", "/v1/pulls", {
            "model": "m", "version": 1, "lease_id": lease["lease_id"],
            "descriptors": {"table": table},
        })  # fmt: skip
        done = await a.ok("GET", f"/v1/pulls/{pull['pull_id']}/wait?timeout=20")
        assert done["state"] == "done", done
        await a.ok("POST", "/v1/experts", {
            "name": "pool-of-a", "layers": 1, "experts": 2, "slots": 2, "row_bytes": [16],
        })  # fmt: skip
        ids = {"region_id": str(dst["region_id"]), "pull_id": pull["pull_id"], "pool": "pool-of-a"}
        yield Objects(a, b, ids, "pool-of-a")


@pytest.mark.parametrize("route", owned_routes(), ids=lambda r: f"{r.method} {r.path}")
async def test_another_tenant_is_refused_every_route_naming_a_tenants_object(
    tmp_path: Path, route: api.Route[Any]
) -> None:
    async with a_owns_everything(tmp_path) as o:
        path = route.url(**{p: o.ids[p] for p in route.params})
        status, res = await o.b.call(route.method, path, BODIES.get(route.path))
        if route.method == "GET" and route.path in SHOWN:
            assert status == 200, res
            assert res["owner"] == "a" and res["handle"] == "" and res["process"] == "", res
        else:
            assert status == 403, (status, res)
            assert res["error"] == "AccessDenied" and "b may not" in res["detail"], res
        # and its owner is answered
        status, res = await o.a.call(route.method, path, BODIES.get(route.path))
        assert status < 400, (status, res)


def test_every_route_naming_an_owned_object_is_checked() -> None:
    # The table above is the route table's: regions, pulls and pools are all there.
    names = {r.path for r in owned_routes()}
    assert api.DELETE_REGION.path in names and api.CANCEL_PULL.path in names
    assert api.ENSURE.path in names and api.GET_POOL.path in names
    assert {p for r in owned_routes() for p in r.params} == set(OWNED)


async def test_every_listing_shows_a_tenant_its_own_objects_only(tmp_path: Path) -> None:
    async with a_owns_everything(tmp_path) as o:
        regions = await o.b.ok("GET", "/v1/regions")
        assert regions and all(r["handle"] == "" and r["process"] == "" for r in regions)
        assert await o.b.ok("GET", "/v1/pulls") == []
        assert await o.b.ok("GET", "/v1/experts") == []
        mine = await o.a.ok("GET", "/v1/regions")
        assert all(r["handle"] for r in mine if r["label"] in ("src", "dst")), mine
        assert [p["pull_id"] for p in await o.a.ok("GET", "/v1/pulls")] == [o.ids["pull_id"]]
        assert [p["name"] for p in await o.a.ok("GET", "/v1/experts")] == [o.pool]


@pytest.mark.parametrize(
    ("who", "owners", "sees"),
    [
        (Principal("a", "token"), ("a",), True),
        (Principal("a", "token"), ("b",), False),
        (Principal("a", "token"), ("",), False),  # nobody's: nobody a could be
        (Principal("a", "token"), (), False),
        (Principal("a", "token"), ("b", "a"), True),  # one of a model's owners
        (Principal("uid:1000", "unix", 1000), ("uid:1001",), False),
        (Principal("uid:0", "unix", 0), ("b",), True),  # root
        (Principal("uid:0", "token", 0), ("b",), False),  # root only on the socket
        (LOOPBACK, ("b",), True),  # without authentication: one principal
        (LOOPBACK, (), True),
    ],
)
def test_a_principal_sees_its_own_and_root_and_loopback_see_all(
    who: Principal, owners: tuple[str, ...], sees: bool
) -> None:
    assert who.sees(*owners) is sees
    if len(owners) == 1:  # a refusal is that rule's answer, with its reason
        assert (who.refusal(owners[0], "read", "it") is None) is sees
