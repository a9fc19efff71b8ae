"""Every query parameter a handler reads is declared in the route table, so the OpenAPI
document (and the fuzz suite reading it) sees it, and the daemon checks its type.

The handlers are read with :mod:`ast`: each ``@routes.handles(api.X)`` handler, and
the module's own functions it calls, must read only names ``api.X`` declares (its
``query`` or its path parameters), through the query helpers or ``request.query``.
"""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from support.daemons import daemon_config, served

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import ProtocolError
from refitd.wire import routes as api

pytestmark = pytest.mark.timeout(60)

DAEMON_DIR = Path(__file__).resolve().parents[3] / "refitd" / "daemon"
READERS = {"query_int", "query_float", "query_str", "query_flag", "query_has"}


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_request_query(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "query"


def names_read(fn: ast.AST) -> Iterator[str]:
    """The query (or path) names ``fn`` reads directly."""
    for node in ast.walk(fn):
        name: str | None = None
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in READERS and len(node.args) >= 2:
                name = _literal(node.args[1])
                assert name is not None, f"line {node.lineno}: a query name must be a literal"
            elif (
                isinstance(f, ast.Attribute)
                and f.attr == "get"
                and _is_request_query(f.value)
                and node.args
            ):
                name = _literal(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_request_query(node.value):
            name = _literal(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_request_query(c) for c in node.comparators):
            name = _literal(node.left)
        if name is not None:
            yield name


def _route_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    for dec in fn.decorator_list:
        if (
            isinstance(dec, ast.Call)
            and isinstance(dec.func, ast.Attribute)
            and dec.func.attr == "handles"
            and isinstance(dec.args[0], ast.Attribute)
        ):
            return dec.args[0].attr
    return None


def handler_reads() -> dict[str, set[str]]:
    """Route constant name -> every name its handler reads (through the module's own
    helpers, followed transitively)."""
    found: dict[str, set[str]] = {}
    for path in sorted(DAEMON_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        funcs = {
            n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for fn in funcs.values():
            route = _route_of(fn)
            if route is None:
                continue
            seen, todo, names = {fn.name}, [fn], set()
            while todo:
                f = todo.pop()
                names.update(names_read(f))
                for node in ast.walk(f):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                        callee = funcs.get(node.func.id)
                        if callee is not None and callee.name not in seen:
                            seen.add(callee.name)
                            todo.append(callee)
            found.setdefault(route, set()).update(names)
    return found


def test_every_query_name_a_handler_reads_is_declared_by_its_route() -> None:
    reads = handler_reads()
    assert len(reads) >= 30, sorted(reads)  # the scan found the handlers
    undeclared = {}
    for const, names in reads.items():
        route = getattr(api, const)
        extra = names - set(route.query) - set(route.params)
        if extra:
            undeclared[f"{route.method} {route.path}"] = sorted(extra)
    assert not undeclared, f"query names read but not declared in refitd.wire.routes: {undeclared}"


def test_the_scan_sees_each_way_a_handler_reads_the_query() -> None:
    source = (
        "async def h(request):\n"
        "    a = query_int(request, 'a')\n"
        "    b = request.query.get('b', '')\n"
        "    c = request.query['c']\n"
        "    if 'd' in request.query: pass\n"
        "    e = query_flag(request, 'e')\n"
    )
    assert set(names_read(ast.parse(source))) == {"a", "b", "c", "d", "e"}


@pytest.fixture
async def client() -> AsyncIterator[RefitClient]:
    daemon = Daemon(daemon_config(node_id="t", transport="shm"))
    async with served(daemon, wired=True) as s:  # with the API document
        yield s.client


async def test_the_document_lists_every_query_parameter_and_every_refusal_status(
    client: RefitClient,
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(client.base_url + api.OPENAPI.path) as resp,
    ):
        doc = await resp.json()
    for const, names in handler_reads().items():
        route = getattr(api, const)
        op = doc["paths"][route.path][route.method.lower()]
        listed = {p["name"] for p in op.get("parameters", [])}
        assert names <= listed, (route.path, names - listed)
        assert {"400", "404", "429", "507"} <= set(op["responses"]), route.path
    gc = doc["paths"][api.GC.path]["post"]["parameters"]
    assert gc == [
        {
            "name": "dry_run",
            "in": "query",
            "required": False,
            "schema": {"enum": ["0", "1", "false", "true"]},
        }
    ]


async def test_a_flag_spelled_otherwise_is_refused_not_read_as_no(client: RefitClient) -> None:
    with pytest.raises(ProtocolError, match="dry_run must be one of"):
        await client._send(api.GC, params={"dry_run": "yes"})
    report = await client._send(api.GC, params={"dry_run": "true"})
    assert report.dry_run


async def test_a_declared_parameter_of_the_wrong_type_is_refused_even_where_unread(
    client: RefitClient,
) -> None:
    # Without a lease, peer regions reads no version, yet a malformed one is refused.
    with pytest.raises(ProtocolError, match="version must be an integer"):
        await client._send(api.PEER_REGIONS, params={"version": "x"})
    assert (await client._send(api.PEER_REGIONS, params={"version": "3"})).regions == []


async def test_the_client_refuses_to_send_a_parameter_its_route_does_not_declare(
    client: RefitClient,
) -> None:
    with pytest.raises(TypeError, match="declares no query"):
        await client._send(api.GET_PULL, params={"timeout": "1"}, pull_id="p")
