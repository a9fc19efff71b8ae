"""Access control on real sockets: loopback default, bearer tokens, Unix-socket uids,
region ownership and the request size limit."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.daemons import serving_app

from refitd.config import ServerConfig
from refitd.daemon.access.auth import (
    TokenBook,
    check_owner,
    check_startup,
    owner_for,
    principal_of,
    setup_auth,
)
from refitd.daemon.app.handlers import error_middleware
from refitd.daemon.app.metrics import setup_metrics
from refitd.errors import ConfigError

NOBODY = 65534


def token_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def small_app(server: ServerConfig) -> web.Application:
    """A small app of the access parts (not a daemon): regions created, read and
    deleted with ownership checks, served by ``serving_app``."""
    owners: dict[str, str] = {}

    async def whoami(request: web.Request) -> web.Response:
        who = principal_of(request)
        return web.json_response({"name": who.name, "via": who.via})

    async def create(request: web.Request) -> web.Response:
        body = await request.json()
        region_id = f"r{len(owners)}"
        owners[region_id] = owner_for(request, body.get("owner", ""))
        return web.json_response({"region_id": region_id, "owner": owners[region_id]})

    async def delete(request: web.Request) -> web.Response:
        region_id = request.match_info["region_id"]
        check_owner(request, owners[region_id], "delete", f"region {region_id}")
        del owners[region_id]
        return web.json_response({"deleted": region_id})

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"nbytes": len(await request.read())})

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/v1/whoami", whoami)
    app.router.add_post("/v1/regions", create)
    app.router.add_delete("/v1/regions/{region_id}", delete)
    app.router.add_post("/v1/echo", echo)
    setup_metrics(app)
    setup_auth(app, check_startup(server))
    return app


async def test_loopback_clients_are_served_without_credentials_by_default() -> None:
    async with (
        serving_app(small_app(ServerConfig(port=0))) as base,
        aiohttp.ClientSession() as s,
        s.get(f"{base}/v1/whoami") as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {"name": "loopback", "via": "loopback"}


def test_a_non_loopback_bind_without_a_token_file_refuses_to_start() -> None:
    with pytest.raises(ConfigError, match=r"not a loopback address .* refusing to start"):
        check_startup(ServerConfig(host="0.0.0.0"))


def test_a_token_file_readable_by_others_refuses_to_start(tmp_path: Path) -> None:
    path = token_file(tmp_path, "alice s3cret\n", mode=0o644)
    with pytest.raises(ConfigError, match="mode 0644; expected no access for group or others"):
        check_startup(ServerConfig(host="0.0.0.0", token_file=path))


def test_a_missing_or_empty_token_file_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        check_startup(ServerConfig(host="0.0.0.0", token_file=str(tmp_path / "none")))
    with pytest.raises(ConfigError, match="holds no tokens"):
        check_startup(ServerConfig(token_file=token_file(tmp_path, "# nothing\n\n")))


def test_token_lines_are_named_or_numbered() -> None:
    book = TokenBook({"alice": "a1", "token2": "b2"})
    assert book.lookup("a1") == "alice"
    assert book.lookup("b2") == "token2"
    assert book.lookup("a") is None


async def test_with_tokens_a_request_without_a_valid_bearer_token_gets_401(
    tmp_path: Path,
) -> None:
    server = ServerConfig(port=0, token_file=token_file(tmp_path, "alice s3cret\n"))
    async with serving_app(small_app(server)) as base, aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/whoami") as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            body = await resp.json()
            assert body["error"] == "Unauthenticated"
            assert "Authorization: Bearer" in body["detail"]
        bad = {"Authorization": "Bearer nope"}
        async with s.get(f"{base}/v1/whoami", headers=bad) as resp:
            assert resp.status == 401
        good = {"Authorization": "Bearer s3cret"}
        async with s.get(f"{base}/v1/whoami", headers=good) as resp:
            assert resp.status == 200
            assert await resp.json() == {"name": "alice", "via": "token"}
        async with s.get(f"{base}/metrics") as resp:
            text = await resp.text()
        assert resp.status == 401
        async with s.get(f"{base}/metrics", headers=good) as resp:
            text = await resp.text()
        assert 'refitd_refusals_total{reason="Unauthenticated"} 3.0' in text


async def test_a_client_can_delete_only_the_regions_it_owns(tmp_path: Path) -> None:
    server = ServerConfig(port=0, token_file=token_file(tmp_path, "alice a1\nbob b2\n"))
    alice = {"Authorization": "Bearer a1"}
    bob = {"Authorization": "Bearer b2"}
    async with serving_app(small_app(server)) as base, aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/regions", json={}, headers=alice) as resp:
            created = await resp.json()
        assert created["owner"] == "alice"
        async with s.post(f"{base}/v1/regions", json={"owner": "alice"}, headers=bob) as resp:
            assert resp.status == 403
            assert "bob may not create a region owned by 'alice'" in (await resp.json())["detail"]
        url = f"{base}/v1/regions/{created['region_id']}"
        async with s.delete(url, headers=bob) as resp:
            assert resp.status == 403
            body = await resp.json()
        assert body == {
            "error": "AccessDenied",
            "detail": "bob may not delete region r0: it belongs to alice",
        }
        async with s.delete(url, headers=alice) as resp:
            assert resp.status == 200
        async with s.get(f"{base}/metrics", headers=alice) as resp:
            text = await resp.text()
    assert 'refitd_refusals_total{reason="AccessDenied"} 2.0' in text


async def test_a_declared_content_length_over_the_limit_gets_413_before_the_body_is_read() -> None:
    app = small_app(ServerConfig(port=0, max_request_bytes=1000))
    async with serving_app(app) as base, aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/echo", data=b"x" * 1000) as resp:
            assert resp.status == 200
            assert await resp.json() == {"nbytes": 1000}
        async with s.post(f"{base}/v1/echo", data=b"x" * 1001) as resp:
            assert resp.status == 413
            body = await resp.json()
    assert body["error"] == "RequestTooLarge"
    assert "a body of 1001 bytes" in body["detail"]
    assert "at most 1000 bytes (server.max_request_bytes)" in body["detail"]


async def test_a_chunked_body_over_the_limit_gets_413_as_it_is_read() -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(5):
            yield b"y" * 512

    app = small_app(ServerConfig(port=0, max_request_bytes=1000))
    async with (
        serving_app(app) as base,
        aiohttp.ClientSession() as s,
        s.post(f"{base}/v1/echo", data=chunks()) as resp,
    ):
        assert resp.status == 413
        body = await resp.json()
    assert body["error"] == "RequestTooLarge"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="refitd-ops-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_the_unix_socket_identifies_the_peer_by_uid(shared_dir: Path) -> None:
    sock = str(shared_dir / "refitd.sock")
    async with serving_app(small_app(ServerConfig(port=0)), unix_path=sock):
        conn = aiohttp.UnixConnector(path=sock)
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.get("http://refitd/v1/whoami") as resp,
        ):
            assert await resp.json() == {"name": f"uid:{os.getuid()}", "via": "unix"}


CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"GET /v1/whoami HTTP/1.0\\r\\nHost: refitd\\r\\n\\r\\n")
data = b""
while chunk := s.recv(65536):
    data += chunk
sys.stdout.write(data.decode())
"""


async def run_as(uid: int, sock: str) -> str:
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(python, os.X_OK):
        pytest.skip("needs root and a system python3 to connect as another uid")
    proc = await asyncio.create_subprocess_exec(
        python, "-c", CLIENT, sock, user=uid, stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return out.decode()


async def test_a_uid_not_admitted_on_the_unix_socket_gets_403(shared_dir: Path) -> None:
    sock = str(shared_dir / "refitd.sock")
    async with serving_app(small_app(ServerConfig(port=0)), unix_path=sock):
        os.chmod(sock, 0o777)
        reply = await run_as(NOBODY, sock)
    assert reply.startswith("HTTP/1.0 403")
    assert f"uid {NOBODY} may not use this daemon's Unix socket" in reply


async def test_an_allowed_uid_is_admitted_on_the_unix_socket(shared_dir: Path) -> None:
    sock = str(shared_dir / "refitd.sock")
    app = small_app(ServerConfig(port=0, allowed_uids=(NOBODY,)))
    async with serving_app(app, unix_path=sock):
        os.chmod(sock, 0o777)
        reply = await run_as(NOBODY, sock)
    assert reply.startswith("HTTP/1.0 200")
    assert f'"name": "uid:{NOBODY}"' in reply
