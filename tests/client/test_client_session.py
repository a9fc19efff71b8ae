"""The one HTTP session under both clients: the public ``RefitClient`` and the daemon's
``PeerClient`` answer a redirect, a refusal and a dead peer the same way, because they
are the same code (``refitd.client.session.ApiSession``).

Each case runs against a real aiohttp server on 127.0.0.1:0, through both clients'
own call for the same route (checking a lease).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
from aiohttp import web
from support.daemons import serving_app

from refitd.client.http import RefitClient
from refitd.client.session import ApiSession
from refitd.daemon.pull.peerclient import PeerClient
from refitd.errors import ConflictError, ProtocolError, QuotaExceeded, RefitError, TransportError
from refitd.wire import routes as api

pytestmark = pytest.mark.timeout(30)

CheckLease = Callable[[str], Awaitable[object]]


async def _via_refit_client(url: str) -> object:
    async with RefitClient(url, token="t") as c:
        return await c.check_lease("lease-1", "m", 3)


async def _via_peer_client(url: str) -> object:
    c = PeerClient(url, token="t")
    try:
        return await c.check_lease("lease-1", "m", 3)
    finally:
        await c.close()


CLIENTS = pytest.mark.parametrize(
    "check_lease", [_via_refit_client, _via_peer_client], ids=["RefitClient", "PeerClient"]
)


@contextlib.asynccontextmanager
async def _serve_one(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with serving_app(app) as url:
        yield url


@CLIENTS
async def test_a_redirect_is_refused_by_both_clients_and_never_followed(
    check_lease: CheckLease,
) -> None:
    followed: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        followed.append(request.path_qs)
        return web.Response()

    async with _serve_one(elsewhere) as other:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(other + request.path_qs)

        async with _serve_one(redirect) as url:
            with pytest.raises(ProtocolError, match=rf"daemon at {url} answered a redirect"):
                await check_lease(url)
    assert followed == []


@CLIENTS
@pytest.mark.parametrize(
    ("status", "name", "expected"),
    [
        (409, "ConflictError", ConflictError),  # by the class the body names
        (429, "NoSuchClass", QuotaExceeded),  # else by the status
        (599, "NoSuchClass", RefitError),  # else the root
    ],
)
async def test_a_refusal_comes_back_as_the_same_class_through_both_clients(
    check_lease: CheckLease, status: int, name: str, expected: type[RefitError]
) -> None:
    async def refuse(request: web.Request) -> web.Response:
        assert request.path == api.CHECK_LEASE.url(lease_id="lease-1")
        assert request.query == {"model": "m", "version": "3"}
        assert request.headers["Authorization"] == "Bearer t"
        body = msgspec.msgpack.encode({"error": name, "detail": "lease-1 expired"})
        return web.Response(status=status, body=body, content_type="application/msgpack")

    async with _serve_one(refuse) as url:
        with pytest.raises(expected, match="lease-1 expired") as caught:
            await check_lease(url)
    assert type(caught.value) is expected


@CLIENTS
async def test_a_peer_that_is_not_there_is_a_transport_error_through_both_clients(
    check_lease: CheckLease,
) -> None:
    async def nothing(request: web.Request) -> web.Response:
        return web.Response()

    async with _serve_one(nothing) as url:
        pass  # the server is gone: its port refuses
    with pytest.raises(TransportError, match="failed"):
        await check_lease(url)


async def test_the_session_refuses_a_query_parameter_its_route_does_not_declare() -> None:
    session = ApiSession("http://127.0.0.1:9")
    with pytest.raises(TypeError, match=r"declares no query \['ttl'\]"):
        await session.send(api.CHECK_LEASE, params={"ttl": "3"}, lease_id="x")
    await session.close()
