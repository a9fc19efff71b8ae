"""The OpenAPI 3.1 document of the HTTP API, generated from the live router.

Nothing here is written by hand twice. Paths and methods come from the app's
router, so a route cannot exist undocumented nor a documented route be missing;
request and response bodies come from the msgspec Structs in
:mod:`refitd.wire` that the handlers decode and encode with, rendered by
``msgspec.json.schema_components``.

A handler says which Structs it reads and writes in one of two ways:

- an entry in the ``operations`` mapping given to :func:`setup_openapi`,
  keyed by ``(METHOD, path template)``: the daemon's are :func:`operations_of` its
  route table (:data:`refitd.wire.routes.ROUTES`), so a summary or a body type is
  declared once, next to the path;
- the :func:`operation` decorator on the handler (an app without a route table).

Routes with neither are still listed (summary from the handler's docstring), with
no body schema; the ops tests insist every ``/v1`` route has one.

Integration: ``setup_openapi(app, operations)`` after all routes are added; the
document is built on the first ``GET /v1/openapi.json`` and cached.
"""

from __future__ import annotations

import functools
import operator
import re
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, Union, get_args, get_origin

import msgspec
from aiohttp import web

from refitd.wire import MSGPACK, STATUS_OF, ErrorBody
from refitd.wire import routes as api
from refitd.wire.args import FLAG, FLAG_SPELLINGS, Args

__all__ = [
    "OPENAPI_PATH",
    "Operation",
    "build_openapi",
    "documented_paths",
    "operation",
    "operations_of",
    "route_table",
    "setup_openapi",
]

OPENAPI_PATH = api.OPENAPI.path
JSON = api.JSON
_ATTR = "__refitd_operation__"


def _error_statuses() -> dict[str, str]:
    """Every refusal status of :data:`refitd.wire.STATUS_OF` (the map the error
    middleware answers with), described by its class; 500 is no refusal but a fault,
    and is not promised."""
    statuses: dict[str, str] = {}
    for cls, code in STATUS_OF:
        if code == 500 or str(code) in statuses:
            continue
        doc = (cls.__doc__ or "").strip().splitlines()
        statuses[str(code)] = f"{cls.__name__}: {doc[0] if doc else cls.__name__}"
    return dict(sorted(statuses.items()))


#: HTTP status of each refusal class, as the error middleware maps them.
ERROR_STATUSES: dict[str, str] = _error_statuses()


@dataclass(frozen=True)
class Operation:
    """What one route reads and writes.

    ``request``/``response`` are msgspec types (a Struct, or e.g. ``list[Struct]``);
    None means no body. ``args`` is the Struct of its path and query parameters
    (:mod:`refitd.wire.args`): each field is listed as a parameter, with its schema,
    bounds and default (a path parameter it does not name is a string). ``media``
    lists the accepted request content types (bulk descriptor bodies also come as
    msgpack); ``response_media`` is the content type answered, e.g. ``text/plain``
    for metrics.
    """

    summary: str = ""
    request: Any = None
    response: Any = None
    status: int = 200
    media: tuple[str, ...] = (JSON,)
    response_media: str = JSON
    tags: tuple[str, ...] = ()
    args: type[Args] | None = None


def operations_of(routes: Iterable[api.Route[Any]]) -> dict[tuple[str, str], Operation]:
    """The operations of ``routes``, keyed as :func:`setup_openapi` takes them."""
    return {
        (r.method, r.path): Operation(
            summary=r.summary,
            request=r.request,
            response=None if r.response is type(None) else r.response,
            status=r.status,
            media=r.media,
            response_media=r.response_media,
            tags=(r.tag,) if r.tag else (),
            args=r.args,
        )
        for r in routes
    }


H = TypeVar("H", bound=Callable[..., Any])


def operation(
    *,
    summary: str = "",
    request: Any = None,
    response: Any = None,
    status: int = 200,
    media: tuple[str, ...] = (JSON,),
    response_media: str = JSON,
    tags: tuple[str, ...] = (),
) -> Callable[[H], H]:
    """Declare the schemas of a handler; see :class:`Operation`."""

    def mark(handler: H) -> H:
        op = Operation(summary, request, response, status, media, response_media, tags)
        setattr(handler, _ATTR, op)
        return handler

    return mark


_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")


def route_table(app: web.Application) -> list[tuple[str, str]]:
    """Every ``(METHOD, path template)`` the router serves, minus implicit HEADs."""
    routes: set[tuple[str, str]] = set()
    for route in app.router.routes():
        resource = route.resource
        if resource is None or route.method in ("HEAD", "*"):
            continue
        routes.add((route.method, _PARAM.sub(r"{\1}", resource.canonical)))
    return sorted(routes, key=lambda r: (r[1], r[0]))


def _find_operation(
    app: web.Application, method: str, path: str, operations: Mapping[tuple[str, str], Operation]
) -> Operation | None:
    if (method, path) in operations:
        return operations[(method, path)]
    for route in app.router.routes():
        resource = route.resource
        if (
            route.method == method
            and resource is not None
            and _PARAM.sub(r"{\1}", resource.canonical) == path
        ):
            op = getattr(route.handler, _ATTR, None)
            if isinstance(op, Operation):
                return op
            doc = (route.handler.__doc__ or "").strip().splitlines()
            return Operation(summary=doc[0] if doc else "")
    return None


def build_openapi(
    app: web.Application,
    operations: Mapping[tuple[str, str], Operation] | None = None,
    *,
    title: str = "refitd",
    version: str = "1",
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for every route of ``app``."""
    operations = operations or {}
    table = route_table(app)
    ops = {key: _find_operation(app, *key, operations) or Operation() for key in table}
    types: list[Any] = [ErrorBody]
    for op in ops.values():
        types.extend(t for t in (op.request, op.response) if t is not None)
    unique = list(dict.fromkeys(types))
    schemas, components = msgspec.json.schema_components(
        unique, ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip(unique, schemas, strict=True))
    error_ref = schema_of[ErrorBody]

    paths: dict[str, dict[str, Any]] = {}
    for (method, path), op in ops.items():
        entry: dict[str, Any] = {
            "operationId": _operation_id(method, path),
            "summary": op.summary,
            "responses": {},
        }
        if op.tags:
            entry["tags"] = list(op.tags)
        params = _parameters(path, op.args)
        if params:
            entry["parameters"] = params
        if op.request is not None:
            body = schema_of[op.request]
            entry["requestBody"] = {
                "required": True,
                "content": {media: {"schema": body} for media in op.media},
            }
        ok: dict[str, Any] = {"description": op.summary or "OK"}
        if op.response is not None:
            ok["content"] = {op.response_media: {"schema": schema_of[op.response]}}
        elif op.response_media != JSON:
            ok["content"] = {op.response_media: {"schema": {"type": "string"}}}
        entry["responses"][str(op.status)] = ok
        for status, text in ERROR_STATUSES.items():
            entry["responses"][status] = {
                "description": text,
                "content": {JSON: {"schema": error_ref}},
            }
        paths.setdefault(path, {})[method.lower()] = entry
    _add_links(ops, paths)

    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": (
                "refitd HTTP API. Byte offsets and sizes are bytes; tensor offsets and "
                f"shapes are elements. Bulk bodies may be sent as {MSGPACK}. Every "
                "refusal is {error, detail}."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # Tokens are required only when the daemon has a token file; loopback
        # deployments take requests without one (the empty requirement).
        "security": [{}, {"bearer": []}],
    }


def _parameters(path: str, args: type[Args] | None) -> list[dict[str, Any]]:
    """The path parameters of ``path``, then the query parameters of ``args``, each
    with the schema, bounds and default its field declares."""
    fields = {f.name: f for f in msgspec.structs.fields(args)} if args is not None else {}
    in_path = _PARAM.findall(path)
    params = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": _schema(fields[name]) if name in fields else {"type": "string"},
        }
        for name in in_path
    ]
    params += [
        {"name": f.name, "in": "query", "required": f.required, "schema": _schema(f)}
        for f in fields.values()
        if f.name not in in_path
    ]
    return params


def _schema(f: msgspec.structs.FieldInfo) -> dict[str, Any]:
    """A parameter's schema, as :mod:`refitd.wire.args` reads it from text: a flag
    (``bool``) is one of its four spellings; an optional one (``X | None``) is its
    ``X``, absent when not given (None is never spelled)."""
    tp = f.type
    if get_origin(tp) in (Union, types.UnionType):
        rest = [t for t in get_args(tp) if t is not type(None)]
        tp = functools.reduce(operator.or_, rest)
    schema: dict[str, Any] = (
        {"enum": list(FLAG_SPELLINGS)} if tp is bool else msgspec.json.schema(tp)
    )
    if f.default is not msgspec.NODEFAULT and f.default is not None:
        schema["default"] = FLAG[f.default] if tp is bool else f.default
    return schema


def _add_links(ops: Mapping[tuple[str, str], Operation], paths: dict[str, dict[str, Any]]) -> None:
    """OpenAPI links from each POST that creates something to the operations on it.

    ``POST /v1/regions`` answers a RegionInfo whose ``region_id`` names the created
    region: every operation under ``/v1/regions/{region_id}`` gets a link taking that
    path parameter from the response body (parameters already in the creating path
    pass through; an item right under the collection may be addressed by the body's
    ``name``). Stateful API testers follow these links."""
    for (method, path), op in ops.items():
        if method != "POST" or not isinstance(op.response, type):
            continue
        if not issubclass(op.response, msgspec.Struct):
            continue
        fields = {f.encode_name for f in msgspec.structs.fields(op.response)}
        own = set(_PARAM.findall(path))
        links: dict[str, Any] = {}
        for method2, path2 in ops:
            if not path2.startswith(path + "/{"):
                continue
            params: dict[str, str] = {}
            for name in _PARAM.findall(path2):
                if name in own:
                    params[name] = f"$request.path.{name}"
                elif name in fields:
                    params[name] = f"$response.body#/{name}"
                elif path2.startswith(f"{path}/{{{name}}}") and "name" in fields:
                    # a collection's item addressed by its name (/v1/experts/{pool})
                    params[name] = "$response.body#/name"
                else:
                    break
            else:
                target = _operation_id(method2, path2)
                links[target] = {"operationId": target, "parameters": params}
        if links:
            paths[path]["post"]["responses"][str(op.status)]["links"] = links


def _operation_id(method: str, path: str) -> str:
    words = [w for w in re.split(r"[/{}_.-]+", path) if w and w != "v1"]
    return method.lower() + "".join(w[:1].upper() + w[1:] for w in words)


OPENAPI_KEY = web.AppKey("refitd_openapi", dict)


def setup_openapi(
    app: web.Application,
    operations: Mapping[tuple[str, str], Operation] | None = None,
    *,
    version: str = "1",
) -> None:
    """Serve ``GET /v1/openapi.json``: built on the first request (when every route
    exists) and cached for the app's life."""
    known = operations_of([api.OPENAPI]) | dict(operations or {})

    async def serve(request: web.Request) -> web.Response:
        cache: dict[str, Any] = request.app[OPENAPI_KEY]
        if "doc" not in cache:
            cache["doc"] = msgspec.json.encode(build_openapi(request.app, known, version=version))
        return web.Response(body=cache["doc"], content_type=JSON)

    app[OPENAPI_KEY] = {}
    app.router.add_get(OPENAPI_PATH, serve, name="openapi")


def documented_paths(doc: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    """``(METHOD, path)`` pairs a document lists (for tests and tools)."""
    for path, methods in doc["paths"].items():
        for method in methods:
            yield method.upper(), path
