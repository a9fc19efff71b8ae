"""Bounded work and loose edges: what one request may cost the daemon, and the
refusals at its edges (issue 20, class 4)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web
from support.hostile import Env, hostile_daemon

from refitd.client.http import RefitClient
from refitd.errors import ProtocolError
from transports.shm import SHM_DIR

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with hostile_daemon() as e:
        yield e


def _symlink(p: Path) -> None:
    p.symlink_to("/etc/hostname")


def _directory(p: Path) -> None:
    p.mkdir()


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def _fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


@pytest.mark.parametrize("make", [_symlink, _directory, _socket, _fifo])
async def test_attaching_a_name_that_is_not_a_regular_file_is_a_400_in_the_error_shape(
    env: Env, make: Callable[[Path], None]
) -> None:
    name = f"refitd-test-{make.__name__[1:]}-{os.getpid()}"
    path = SHM_DIR / name
    make(path)
    try:
        detail = await env.refused(
            "POST", "/v1/regions/attach", {"handle": name, "nbytes": 64}, status=400
        )
        assert "not a regular file" in detail, detail
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


async def test_the_peer_client_never_follows_a_redirect_and_names_the_peer() -> None:
    """A peer (here a fake: a real daemon never redirects) answers 307 to a host no
    one listed; the client refuses, naming the peer, and the other host sees nothing."""
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path_qs} {request.headers.get('Authorization')}")
        return web.Response(status=200)

    async with _serve(web.route("*", "/{tail:.*}", record)) as unlisted:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(unlisted + request.path_qs)

        async with (
            _serve(web.route("*", "/{tail:.*}", redirect)) as peer,
            RefitClient(peer, token="secret-token") as c,
        ):
            with pytest.raises(ProtocolError, match=rf"daemon at {peer} answered a redirect"):
                await c.peer_regions(lease_id="lease-1", model="m", version=3)
    assert seen == []


@contextlib.asynccontextmanager
async def _serve(route: web.RouteDef) -> AsyncIterator[str]:
    app = web.Application()
    app.add_routes([route])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
