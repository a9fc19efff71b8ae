"""Every route's parameters are declared once, as its ``args`` Struct
(:mod:`refitd.wire.args`), and the daemon's edge decodes them before the handler runs:

- no handler reads a raw parameter (``request.query``, ``request.match_info``): the
  handlers are read with :mod:`ast`, each ``@routes.handles(api.X)`` handler and the
  module's own functions it calls;
- a handler takes ``(request, args)`` annotated with its route's Struct (or the
  request alone where the route has none);
- a value off a field's type or bound is refused at the edge (400, naming the
  parameter), for every route of the table, so a new route joins the check;
- the OpenAPI document lists each field with its bounds and default.
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from msgspec import inspect as mi
from support.daemons import daemon_config, served

from refitd.client.http import RefitClient
from refitd.daemon.app.handlers import create_app
from refitd.daemon.app.node import Daemon
from refitd.errors import ProtocolError
from refitd.wire import routes as api
from refitd.wire.args import fields_of

pytestmark = pytest.mark.timeout(60)

DAEMON_DIR = Path(__file__).resolve().parents[3] / "refitd" / "daemon"
RAW = {"query", "match_info", "rel_url", "query_string"}


def raw_reads(fn: ast.AST) -> Iterator[str]:
    """Each raw parameter ``fn`` reads (``request.query``, ``request.match_info``...)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and node.attr in RAW:
            yield f"line {node.lineno}: .{node.attr}"


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


def handler_reads() -> dict[str, list[str]]:
    """Route constant name -> every raw parameter read of its handler (through the
    module's own helpers, followed transitively)."""
    found: dict[str, list[str]] = {}
    for path in sorted(DAEMON_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        funcs = {
            n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for fn in funcs.values():
            route = _route_of(fn)
            if route is None:
                continue
            seen, todo, reads = {fn.name}, [fn], []
            while todo:
                f = todo.pop()
                reads.extend(f"{path.name}:{f.name} {r}" for r in raw_reads(f))
                for node in ast.walk(f):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                        callee = funcs.get(node.func.id)
                        if callee is not None and callee.name not in seen:
                            seen.add(callee.name)
                            todo.append(callee)
            found.setdefault(route, []).extend(reads)
    return found


def test_no_handler_reads_a_raw_parameter_it_gets_them_decoded() -> None:
    reads = handler_reads()
    assert len(reads) >= 45, sorted(reads)  # the scan found the handlers
    raw = {const: r for const, r in reads.items() if r}
    assert not raw, f"handlers reading raw parameters, not their route's args: {raw}"


def test_the_scan_sees_each_way_a_handler_could_read_a_raw_parameter() -> None:
    source = (
        "async def h(request):\n"
        "    b = request.query.get('b', '')\n"
        "    c = request.match_info['c']\n"
        "    if 'd' in request.rel_url.query: pass\n"
    )
    assert len(list(raw_reads(ast.parse(source)))) == 4


def _handlers() -> dict[tuple[str, str], Any]:
    app = create_app(Daemon(daemon_config(node_id="t", transport="shm")))
    found = {}
    for r in app.router.routes():
        if r.resource is not None and r.method != "HEAD":
            found[(r.method, r.resource.canonical)] = inspect.unwrap(r.handler)
    return found


def test_each_handler_takes_its_routes_args_struct() -> None:
    handlers = _handlers()
    served_routes = [r for r in api.ROUTES if (r.method, r.path) in handlers]
    assert len(served_routes) >= 45
    for route in served_routes:
        handler = handlers[(route.method, route.path)]
        hints = typing.get_type_hints(handler)
        params = list(inspect.signature(handler).parameters)
        if route.args is None:
            assert len(params) == 1, (route.path, params)
        else:
            assert len(params) == 2, (route.path, params)
            assert hints[params[1]] is route.args, (route.path, hints[params[1]])


# ---------------------------------------------------------------- bounds, at the edge


def _valid(t: mi.Type) -> str:
    """A text every field of type ``t`` reads (a refusal then names another field)."""
    if isinstance(t, mi.Metadata):
        return _valid(t.type)
    if isinstance(t, mi.UnionType):
        return _valid(next(m for m in t.types if not isinstance(m, mi.NoneType)))
    if isinstance(t, mi.IntType):
        return str(t.ge if t.ge is not None else 0)
    if isinstance(t, mi.FloatType):
        return "0.5"
    if isinstance(t, mi.BoolType):
        return "0"
    if isinstance(t, mi.LiteralType):
        return str(t.values[0])
    return "x"


def _bad(t: mi.Type) -> list[str]:
    """Texts a field of type ``t`` refuses: off its type, then past each bound."""
    if isinstance(t, mi.Metadata):
        return _bad(t.type)
    if isinstance(t, mi.UnionType):
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if any(isinstance(m, mi.StrType) for m in members):
            return []  # any text is one
        ints = [m for m in members if isinstance(m, mi.IntType)]
        return ["x1", "1.5"] + (_bad(ints[0])[2:] if ints else [])
    if isinstance(t, mi.IntType):
        past = [str(t.ge - 1)] if t.ge is not None else []
        past += [str(t.le + 1)] if t.le is not None else []
        return ["x", "1.5", "1e3", *past]
    if isinstance(t, mi.FloatType):
        past = [repr(t.ge - 1.0)] if t.ge is not None else []
        past += [repr(float(t.gt))] if t.gt is not None else []
        past += [repr(t.le + 1.0)] if t.le is not None else []
        return ["x", "", "nan", "inf", "-inf", *past]
    if isinstance(t, mi.BoolType):
        return ["yes", "True", "2", ""]
    return []


def _cases(route: api.Route[Any]) -> list[tuple[str, str, dict[str, str], dict[str, str]]]:
    """``(field, bad text, path, query)`` for each refusal a field of ``route`` makes."""
    assert route.args is not None
    fields = fields_of(route.args)
    path = {f.name: _valid(f.type) for f in fields if f.name in route.params}
    query = {f.name: _valid(f.type) for f in fields if f.required and f.name not in path}
    cases = []
    for f in fields:
        for bad in _bad(f.type):
            if f.name in path:
                cases.append((f.name, bad, {**path, f.name: bad or "-"}, query))
            else:
                cases.append((f.name, bad, path, {**query, f.name: bad}))
    return cases


BOUNDED = [r for r in api.ROUTES if r.args is not None and _cases(r)]


@pytest.fixture
async def client() -> AsyncIterator[RefitClient]:
    daemon = Daemon(daemon_config(node_id="t", transport="shm"))
    async with served(daemon, wired=True) as s:  # with the API document
        yield s.client


def test_every_route_with_a_number_or_a_flag_is_checked_at_the_edge() -> None:
    names = {f"{r.method} {r.path}" for r in BOUNDED}
    assert len(BOUNDED) >= 18, names
    assert f"POST {api.RENEW_LEASE.path}" in names and f"POST {api.GC.path}" in names


@pytest.mark.parametrize("route", BOUNDED, ids=lambda r: f"{r.method} {r.path}")
async def test_a_parameter_off_its_declared_type_or_bound_is_refused_at_the_edge_naming_it(
    client: RefitClient, route: api.Route[Any]
) -> None:
    async with aiohttp.ClientSession() as http:
        for name, bad, path, query in _cases(route):
            url = client.base_url + route.url(**path)
            async with http.request(route.method, url, params=query) as resp:
                body = await resp.json(content_type=None)
            assert resp.status == 400, (name, bad, url, query, body)
            assert body["error"] == "ProtocolError", body
            assert f"parameter {name} must be" in body["detail"], (name, bad, body)


async def test_a_flag_spelled_otherwise_is_refused_not_read_as_no(client: RefitClient) -> None:
    with pytest.raises(ProtocolError, match="dry_run must be one of 0, 1, false, true"):
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


async def test_an_undeclared_query_parameter_is_ignored(client: RefitClient) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(client.base_url + api.GC.path, params={"dry_run": "1", "dryrun": "x"}) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_the_client_refuses_to_send_a_parameter_its_route_does_not_declare(
    client: RefitClient,
) -> None:
    with pytest.raises(TypeError, match="declares no query"):
        await client._send(api.GET_PULL, params={"timeout": "1"}, pull_id="p")


# ---------------------------------------------------------------- the document


async def test_the_document_lists_every_parameter_with_its_bounds_and_default(
    client: RefitClient,
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(client.base_url + api.OPENAPI.path) as resp,
    ):
        doc = await resp.json()
    for route in api.ROUTES:
        if not route.path.startswith("/v1"):
            continue  # /metrics: served where metrics are set up
        op = doc["paths"][route.path][route.method.lower()]
        listed = {p["name"]: p for p in op.get("parameters", [])}
        fields = {} if route.args is None else {f.name: f for f in fields_of(route.args)}
        assert set(listed) == set(fields) | set(route.params), route.path
        for name, f in fields.items():
            p = listed[name]
            assert p["in"] == ("path" if name in route.params else "query"), (route.path, p)
            assert p["required"] == (name in route.params or f.required), (route.path, p)
            if f.default not in (msgspec.NODEFAULT, None, False):
                assert p["schema"]["default"] == f.default, (route.path, p)
        assert {"400", "404", "429", "507"} <= set(op["responses"]), route.path
    gc = doc["paths"][api.GC.path]["post"]["parameters"]
    assert gc == [
        {
            "name": "dry_run",
            "in": "query",
            "required": False,
            "schema": {"enum": ["0", "1", "false", "true"], "default": "0"},
        }
    ]
    renew = doc["paths"][api.RENEW_LEASE.path]["post"]["parameters"]
    assert renew[1]["schema"] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 3600.0,
        "description": "seconds",
        "default": 30.0,
    }
