"""The route table (``refitd.wire.routes``) is the one declaration of the HTTP API:
the daemon serves exactly its routes, the OpenAPI document lists exactly them, and
the client's paths are filled in from it."""

from __future__ import annotations

import aiohttp
import pytest
from support.daemons import served

from refitd.daemon.app.openapi import OPENAPI_PATH, documented_paths, route_table
from refitd.wire import routes as api


def _table() -> set[tuple[str, str]]:
    return {(r.method, r.path) for r in api.ROUTES}


async def test_the_daemon_serves_and_documents_exactly_the_routes_of_the_table() -> None:
    async with (
        served(wired=True) as daemon,
        aiohttp.ClientSession() as s,
        s.get(daemon.url + OPENAPI_PATH) as resp,
    ):
        assert resp.status == 200
        doc = await resp.json()
    routes = set(route_table(daemon.app))
    assert routes == _table(), (
        f"served only: {sorted(routes - _table())}; table only: {sorted(_table() - routes)}"
    )
    assert set(documented_paths(doc)) == _table()
    for route in api.ROUTES:
        entry = doc["paths"][route.path][route.method.lower()]
        assert entry["summary"] == route.summary
        assert str(route.status) in entry["responses"]
        assert ("requestBody" in entry) == (route.request is not None)


def test_each_route_is_declared_once_with_a_summary_and_a_tag() -> None:
    keys = [(r.method, r.path) for r in api.ROUTES]
    assert len(keys) == len(set(keys))
    assert all(r.summary and r.tag for r in api.ROUTES)
    assert len(api.ROUTES) >= 40


def test_a_route_fills_its_path_parameters_and_refuses_missing_or_unknown_ones() -> None:
    assert api.MANIFEST.params == ("model", "version")
    assert api.MANIFEST.url(model="llama", version=3) == "/v1/sources/llama/versions/3/manifest"
    assert api.NODE.url() == "/v1/node"
    with pytest.raises(TypeError, match="model"):
        api.MANIFEST.url(model="llama")
    with pytest.raises(TypeError, match="pool"):
        api.NODE.url(pool="p")
