"""Access and size refusals come back to the client as their own RefitError classes."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from aiohttp import web
from support.daemons import served, serving_app

from refitd import errors
from refitd.client.http import RefitClient, error_from_body
from refitd.config import ServerConfig
from refitd.daemon.app.handlers import error_middleware
from refitd.errors import (
    AccessDenied,
    AccessError,
    ProtocolError,
    RefitError,
    RequestTooLarge,
    Unauthenticated,
)
from refitd.wire import STATUS_OF, ErrorBody


@pytest.fixture
def tokens(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text("trainer t-secret\nengine e-secret\n")
    path.chmod(0o600)
    return str(path)


async def test_the_client_raises_unauthenticated_without_a_valid_token(tokens: str) -> None:
    async with served(wired=True, access=ServerConfig(port=0, token_file=tokens)) as daemon:
        for token in (None, "wrong"):
            async with RefitClient(daemon.url, token=token) as c:
                with pytest.raises(Unauthenticated, match="needs 'Authorization: Bearer"):
                    await c.regions()


async def test_the_client_raises_access_denied_on_another_principals_region(tokens: str) -> None:
    async with (
        served(wired=True, access=ServerConfig(port=0, token_file=tokens)) as daemon,
        RefitClient(daemon.url, token="t-secret") as trainer,
        RefitClient(daemon.url, token="e-secret") as engine,
    ):
        region = await engine.create_region(4096)
        with pytest.raises(AccessDenied, match=f"trainer may not delete region {region.region_id}"):
            await trainer.delete_region(region.region_id)
        with pytest.raises(AccessError):  # the branch catches both kinds
            await trainer.create_region(64, owner="engine")


async def test_the_client_raises_request_too_large_for_a_body_over_the_limit() -> None:
    async with (
        served(wired=True, access=ServerConfig(port=0, max_request_bytes=1024)) as daemon,
        RefitClient(daemon.url) as c,
    ):
        with pytest.raises(RequestTooLarge, match="at most 1024 bytes") as refused:
            await c.create_region(64, label="x" * 4096)
    assert isinstance(refused.value, ProtocolError)  # a malformed request, to a catch-all


async def test_the_bare_daemon_answers_an_oversized_body_as_request_too_large() -> None:
    # Without the access middleware, aiohttp's own limit refuses the body as it is read.
    async with served(max_request_bytes=1024) as daemon, RefitClient(daemon.url) as c:
        with pytest.raises(RequestTooLarge, match="too large"):
            await c.create_region(64, label="x" * 4096)


async def test_the_error_middleware_maps_access_errors_to_401_and_403() -> None:
    async def raising(request: web.Request) -> web.Response:
        raise {"401": Unauthenticated, "403": AccessDenied, "413": RequestTooLarge}[
            request.match_info["code"]
        ]("refused here")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/v1/raise/{code}", raising)
    async with serving_app(app) as base, RefitClient(base) as c:
        for code, cls in (
            ("401", Unauthenticated),
            ("403", AccessDenied),
            ("413", RequestTooLarge),
        ):
            with pytest.raises(cls, match="refused here"):
                await c.request("GET", f"/v1/raise/{code}", dict)
    assert dict(STATUS_OF)[Unauthenticated] == 401
    assert dict(STATUS_OF)[AccessError] == 403


def test_a_refusal_without_a_known_class_name_maps_by_status() -> None:
    assert type(error_from_body(401, None, "x")) is Unauthenticated
    assert type(error_from_body(403, None, "x")) is AccessDenied
    assert type(error_from_body(413, None, "x")) is RequestTooLarge
    named = error_from_body(403, ErrorBody("Unauthenticated", "who?"), "x")
    assert type(named) is Unauthenticated and str(named) == "who?"


def test_every_error_class_is_exported_and_drawn_in_the_tree() -> None:
    public = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, RefitError)
    }
    assert set(errors.__all__) == public
    tree = errors.__doc__ or ""
    for name in public:
        assert f"── {name} " in tree or f"{name}  " in tree, name
