"""The OpenAPI document: generated from the router and the msgspec schemas."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from support.daemons import serving_app

from refitd.daemon.app.handlers import error_middleware
from refitd.daemon.app.metrics import setup_metrics
from refitd.daemon.app.openapi import (
    OPENAPI_PATH,
    Operation,
    documented_paths,
    operation,
    route_table,
    setup_openapi,
)
from refitd.errors import NotFoundError
from refitd.wire import LeaseInfo, LeaseRequest, PullProgress, PullRequest, RegionInfo


@operation(summary="Grant a lease", request=LeaseRequest, response=LeaseInfo, tags=("leases",))
async def grant(request: web.Request) -> web.Response:
    body = msgspec.json.decode(await request.read(), type=LeaseRequest)
    return web.Response(
        body=msgspec.json.encode(LeaseInfo("l1", body.model, body.version, 30.0)),
        content_type="application/json",
    )


async def list_regions(request: web.Request) -> web.Response:
    """List regions."""
    return web.json_response([])


async def get_pull(request: web.Request) -> web.Response:
    raise NotFoundError(f"pull {request.match_info['pull_id']} does not exist")


async def post_pull(request: web.Request) -> web.Response:
    raise NotFoundError("no such lease")


def small_app() -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/v1/leases", grant)
    app.router.add_get("/v1/regions", list_regions)
    app.router.add_get("/v1/pulls/{pull_id}", get_pull)
    app.router.add_post("/v1/pulls", post_pull)
    setup_metrics(app)
    setup_openapi(
        app,
        {
            ("GET", "/v1/regions"): Operation(summary="List regions", response=list[RegionInfo]),
            ("GET", "/v1/pulls/{pull_id}"): Operation(response=PullProgress),
            ("POST", "/v1/pulls"): Operation(
                request=PullRequest,
                response=PullProgress,
                status=202,
                media=("application/json", "application/msgpack"),
            ),
            ("GET", "/metrics"): Operation(response_media="text/plain"),
        },
    )
    return app


async def fetch(base: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(base + OPENAPI_PATH) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        doc: dict[str, Any] = await resp.json()
        return doc


def refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                found.add(value)
            else:
                found |= refs(value)
    elif isinstance(node, list):
        for item in node:
            found |= refs(item)
    return found


async def test_every_route_is_in_the_document_and_every_documented_route_exists() -> None:
    app = small_app()
    async with serving_app(app) as base:
        doc = await fetch(base)
        listed = set(documented_paths(doc))
        assert listed == set(route_table(app))
        assert ("POST", "/v1/leases") in listed and ("GET", OPENAPI_PATH) in listed
        # Each documented operation reaches a handler over real HTTP: the router never
        # answers it with its own "no such route" (405, or a 404 that is not our JSON).
        async with aiohttp.ClientSession() as s:
            for method, path in sorted(listed):
                url = base + path.replace("{pull_id}", "p-unknown")
                async with s.request(method, url, json={"model": "m", "version": 1}) as resp:
                    assert resp.status != 405, (method, path)
                    if resp.status == 404:
                        assert (await resp.json())["error"] == "NotFoundError", (method, path)


async def test_bodies_are_the_msgspec_schemas_the_handlers_decode_with() -> None:
    async with serving_app(small_app()) as base:
        doc = await fetch(base)
    schemas = doc["components"]["schemas"]
    lease = doc["paths"]["/v1/leases"]["post"]
    assert lease["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/LeaseRequest"
    }
    assert (
        schemas["LeaseRequest"] == msgspec.json.schema_components([LeaseRequest])[1]["LeaseRequest"]
    )
    assert set(schemas["LeaseRequest"]["required"]) == {"model", "version"}
    pulls = doc["paths"]["/v1/pulls"]["post"]
    assert set(pulls["requestBody"]["content"]) == {"application/json", "application/msgpack"}
    assert "202" in pulls["responses"]
    regions = doc["paths"]["/v1/regions"]["get"]["responses"]["200"]
    assert regions["content"]["application/json"]["schema"]["type"] == "array"
    # Every $ref resolves to a component.
    for ref in refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


async def test_path_parameters_and_error_bodies_are_declared() -> None:
    async with serving_app(small_app()) as base:
        doc = await fetch(base)
    get_pull_op = doc["paths"]["/v1/pulls/{pull_id}"]["get"]
    assert get_pull_op["parameters"] == [
        {"name": "pull_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    for status in ("400", "404", "409", "413"):
        content = get_pull_op["responses"][status]["content"]["application/json"]
        assert content["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert doc["openapi"].startswith("3.")
    ids = [op["operationId"] for methods in doc["paths"].values() for op in methods.values()]
    assert len(ids) == len(set(ids))


async def test_an_undeclared_route_is_listed_with_its_docstring_summary() -> None:
    app = web.Application()
    app.router.add_get("/v1/regions", list_regions)
    setup_openapi(app)
    async with serving_app(app) as base:
        doc = await fetch(base)
    assert doc["paths"]["/v1/regions"]["get"]["summary"] == "List regions."
