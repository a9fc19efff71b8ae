"""Every refusal leaves the daemon one way (:mod:`refitd.daemon.app.refusals`): the
``{"error", "detail"}`` body, in msgpack when the client asks for it, JSON otherwise,
whoever refused (a raised error, the access middleware, an owner check, aiohttp's
router), and a body past the limit is one 413 whichever middleware meets it.

Real daemons on 127.0.0.1:0 with the operator service (``refitd serve``'s auth) and
without it (a bare daemon), over real HTTP.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from support.daemons import served, token_file

from refitd.config import ServerConfig

pytestmark = pytest.mark.timeout(60)

LIMIT = 1024
MSGPACK = "application/msgpack"
TOO_LARGE = re.compile(
    r"^POST /v1/regions sent (a body of \d+ bytes|a larger body), too large: this daemon "
    rf"accepts at most {LIMIT} bytes \(server\.max_request_bytes\)$"
)


async def chunks() -> AsyncIterator[bytes]:
    for _ in range(4):
        yield b" " * (LIMIT // 2)


async def ask(
    s: aiohttp.ClientSession, method: str, url: str, accept: str, token: str = "", data: Any = None
) -> tuple[int, dict[str, Any]]:
    headers = {"Accept": accept, **({"Authorization": f"Bearer {token}"} if token else {})}
    async with s.request(method, url, headers=headers, data=data) as r:
        raw = await r.read()
        assert r.content_type == accept, (r.status, r.content_type, raw[:200])
    body = msgspec.msgpack.decode(raw) if accept == MSGPACK else msgspec.json.decode(raw)
    assert isinstance(body, dict) and set(body) == {"error", "detail"}, body
    assert isinstance(body["detail"], str) and body["detail"], body
    return r.status, body


@pytest.mark.parametrize("accept", ["application/json", MSGPACK])
async def test_every_refusal_has_one_shape_in_the_encoding_asked_for(
    tmp_path: Path, accept: str
) -> None:
    tokens = token_file(tmp_path, {"a": "token-of-a", "b": "token-of-b"})
    async with (
        served(
            wired=True, access=ServerConfig(port=0, token_file=tokens, max_request_bytes=LIMIT)
        ) as d,
        aiohttp.ClientSession() as s,
    ):
        url = d.url
        headers = {"Authorization": "Bearer token-of-a"}
        async with s.post(f"{url}/v1/regions", json={"nbytes": 64}, headers=headers) as r:
            assert r.status == 201
            rid = (await r.json())["region_id"]
        cases = [
            # raised by the core, mapped by the error middleware
            ("GET", "/v1/regions/999999", "token-of-a", None, 404, "NotFoundError"),
            # answered by the access middleware before any handler
            ("GET", "/v1/regions", "", None, 401, "Unauthenticated"),
            # raised by a handler's owner check
            ("DELETE", f"/v1/regions/{rid}", "token-of-b", None, 403, "AccessDenied"),
            # aiohttp's own router
            ("GET", "/v1/no-such-route", "token-of-a", None, 404, "NotFoundError"),
            ("PUT", "/v1/regions", "token-of-a", None, 405, "ProtocolError"),
            # a body past the limit: declared, and chunked (found as it is read)
            ("POST", "/v1/regions", "token-of-a", b" " * (LIMIT + 1), 413, "RequestTooLarge"),
            ("POST", "/v1/regions", "token-of-a", chunks(), 413, "RequestTooLarge"),
        ]
        for method, path, token, data, status, error in cases:
            got, body = await ask(s, method, url + path, accept, token, data)
            assert (got, body["error"]) == (status, error), (method, path, body)
            if status == 413:
                assert TOO_LARGE.match(body["detail"]), body["detail"]


async def test_a_bare_daemon_refuses_a_large_body_with_the_same_413() -> None:
    # No access middleware: aiohttp's own limit meets the body, the same 413 answers.
    async with served(max_request_bytes=LIMIT) as d, aiohttp.ClientSession() as s:
        for data in (b" " * (LIMIT + 1), chunks()):
            status, body = await ask(s, "POST", f"{d.url}/v1/regions", MSGPACK, data=data)
            assert (status, body["error"]) == (413, "RequestTooLarge"), body
            assert TOO_LARGE.match(body["detail"]), body["detail"]
