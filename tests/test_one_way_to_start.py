"""One way to start a daemon in the tests (docs/testing.md, issue 50).

A daemon in the test's process starts through ``support.daemons.served`` (or a named
use of it); a server that is not a daemon through ``support.daemons.serving_app``,
which refuses a daemon's app. So no test module outside ``tests/support/daemons.py``
builds an aiohttp runner or site, calls the daemon's ``listening`` or wires the
operator service (``Service``) by hand: each is a second way to start a daemon, one
that would drift from how ``refitd serve`` starts it. A ``refitd serve`` process
starts through ``refitd.client.spawn``.

The scan reads the source with :mod:`ast`, so a name in a comment or a string does
not count, and a call through a module (``web.AppRunner``) counts as much as one
through an imported name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.daemons import serving_app

from refitd.daemon.app.handlers import create_app
from refitd.daemon.app.node import Daemon

TESTS = Path(__file__).resolve().parent
ENTRY = TESTS / "support" / "daemons.py"

#: What starts a server, or a daemon, other than through the entry point: aiohttp's
#: runners and sites (and its test servers), the daemon's own ``listening``, and the
#: operator service ``refitd serve`` wires a daemon with.
STARTERS = frozenset(
    {
        "AppRunner",
        "ServerRunner",
        "TCPSite",
        "UnixSite",
        "SockSite",
        "NamedPipeSite",
        "run_app",
        "TestServer",
        "RawTestServer",
        "listening",
        "Service",
    }
)


def starts(source: str) -> list[tuple[int, str]]:
    """Each call in ``source`` of one of :data:`STARTERS`: its line and name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in STARTERS:
                found.append((node.lineno, name))
    return sorted(found)


def test_the_scan_finds_each_way_round_the_entry_point() -> None:
    source = (
        "runner = web.AppRunner(app)\n"
        "site = TCPSite(runner, '127.0.0.1', 0)\n"
        "# web.AppRunner(app) in a comment is no call\n"
        "async with process.listening(d) as (app, url): pass\n"
        "svc = Service(config, policy)\n"
        "web.run_app(app)\n"
        "served(d, wired=True)\n"
    )
    assert starts(source) == [
        (1, "AppRunner"),
        (2, "TCPSite"),
        (4, "listening"),
        (5, "Service"),
        (6, "run_app"),
    ]


def test_no_test_module_starts_a_server_but_through_the_entry_point() -> None:
    modules = sorted(p for p in TESTS.rglob("*.py") if p != ENTRY)
    assert len(modules) > 100  # the whole tree was read
    offenders = [
        f"{path.relative_to(TESTS)}:{line}: {name}(...)"
        for path in modules
        for line, name in starts(path.read_text())
    ]
    assert offenders == [], (
        "start a daemon with support.daemons.served (a server that is not a daemon: "
        f"serving_app), not by hand: {offenders}"
    )


async def test_serving_app_refuses_a_daemons_app() -> None:
    app = create_app(Daemon())
    with pytest.raises(TypeError, match=r"not a daemon's: use served\(\)"):
        async with serving_app(app):
            pass


async def test_serving_app_serves_a_tests_own_app() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    async with serving_app(app) as url, aiohttp.ClientSession() as s, s.get(url) as r:
        assert url.startswith("http://127.0.0.1:") and await r.text() == "hello"
