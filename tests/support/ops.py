"""Helpers of the ops tests: a daemon wired as ``refitd serve`` wires it (with the
operator service) requiring tenants' tokens (:func:`serving_tenants`, a named use of
:func:`support.daemons.served`), and the ``refitd`` command run as a child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from support.daemons import Served, served, token_file

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


@contextlib.asynccontextmanager
async def serving_tenants(
    directory: Path, tokens: Mapping[str, str]
) -> AsyncIterator[tuple[Served, dict[str, RefitClient]]]:
    """A daemon :func:`~support.daemons.served` wired as ``refitd serve`` wires it,
    requiring ``tokens`` (principal -> bearer token, their token file written in
    ``directory``); yields it and a client of each principal."""
    access = ServerConfig(port=0, token_file=token_file(directory, tokens))
    async with (
        served(wired=True, access=access) as daemon,
        contextlib.AsyncExitStack() as stack,
    ):
        clients = {
            name: await stack.enter_async_context(RefitClient(daemon.url, token=token))
            for name, token in tokens.items()
        }
        yield daemon, clients
