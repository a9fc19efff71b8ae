"""Helpers of the ops tests: a daemon wired as ``refitd serve`` wires it (with the
operator service: auth, metrics, the API document), started the one way
(:func:`serving_wired`), and with tenants' tokens (:func:`serving_tenants`); a test's
own small aiohttp app served on loopback
(:func:`serving`); and the ``refitd`` command run as a child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from refitd.client.http import RefitClient
from refitd.config import load_config
from refitd.daemon.access.auth import check_startup
from refitd.daemon.app.sdnotify import Notifier
from refitd.daemon.app.service import Service
from refitd.errors import ConflictError, NotFoundError, RefitError
from support.daemons import Served, served, token_file

STATUS = {ConflictError: 409, NotFoundError: 404}
ROOT = Path(__file__).resolve().parents[2]


async def refitd(
    *argv: str, columns: int = 200, env: dict[str, str] | None = None, stdin: bytes | None = None
) -> tuple[int, str, str]:
    """``refitd ARGV`` in a child process with its output piped, laid out for a
    terminal ``columns`` wide, ``env`` added to this environment, ``stdin`` fed to
    it (else none): ``(exit status, stdout, stderr)``."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "refitd.cli",
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**inherited, "COLUMNS": str(columns), **(env or {})},
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


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


@contextlib.asynccontextmanager
async def serving_wired(**server: Any) -> AsyncIterator[Served]:
    """A daemon started the one way (:func:`support.daemons.served`) with the
    operator service (auth, metrics, OpenAPI, the shm group) set up as ``refitd
    serve`` does; ``server`` overrides ``[server]`` config keys."""
    config = load_config(env={}, overrides={f"server.{k}": v for k, v in server.items()})
    service = Service(config, check_startup(config.server), Notifier({}))
    async with served(setup=[service.setup]) as daemon:
        yield daemon


@contextlib.asynccontextmanager
async def serving_tenants(
    directory: Path, tokens: Mapping[str, str]
) -> AsyncIterator[tuple[Served, dict[str, RefitClient]]]:
    """:func:`serving_wired` requiring ``tokens`` (principal -> bearer token, their
    token file written in ``directory``); yields it and a client of each principal."""
    async with (
        serving_wired(token_file=token_file(directory, tokens)) as daemon,
        contextlib.AsyncExitStack() as stack,
    ):
        clients = {
            name: await stack.enter_async_context(RefitClient(daemon.url, token=token))
            for name, token in tokens.items()
        }
        yield daemon, clients
