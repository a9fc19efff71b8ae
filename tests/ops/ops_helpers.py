"""Shared helpers for the ops tests: serve an aiohttp app on real loopback sockets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from refitd.errors import ConflictError, NotFoundError, RefitError

STATUS = {ConflictError: 409, NotFoundError: 404}


@web.middleware
async def error_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """The daemon's contract in miniature: a RefitError becomes {"error", "detail"}."""
    try:
        return await handler(request)
    except RefitError as exc:
        status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 400)
        return web.json_response({"error": type(exc).__name__, "detail": str(exc)}, status=status)


@contextlib.asynccontextmanager
async def serving(app: web.Application, unix_path: str | None = None) -> AsyncIterator[str]:
    """Run ``app`` on 127.0.0.1:0 (and ``unix_path`` if given); yield its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    if unix_path is not None:
        await web.UnixSite(runner, unix_path).start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
