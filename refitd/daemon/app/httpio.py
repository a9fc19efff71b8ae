"""The HTTP edge every handler module shares: app keys, body decoding, replies, and
the one middleware where refusals become HTTP statuses.

Handler modules (:mod:`refitd.daemon.app.handlers`, :mod:`refitd.daemon.experts.routes`) import
this module, never each other's internals, so the app assembles them without an
import cycle.

A handler's route (:mod:`refitd.wire.routes`) says what the edge does with it: the
path and query are decoded into the route's ``args`` Struct before the handler runs
(:mod:`refitd.wire.args`: each parameter's type, default and bounds, declared once;
400 naming the parameter and its bound otherwise) and the handler gets it as its
second argument, reading no raw parameter; the body is decoded as the route's
``request`` (:func:`body`); the answer goes out with the route's ``status``
(:func:`reply`). A handler of a route with no ``args`` takes the request alone.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from refitd.daemon.app.node import Daemon
from refitd.daemon.app.refusals import refused, too_large
from refitd.errors import ProtocolError, RefitError
from refitd.wire import (
    MSGPACK,
    ManifestHead,
    ManifestIn,
    TensorEntry,
    gc_paused,
    status_of,
)
from refitd.wire.args import Args, decode_args
from refitd.wire.routes import ROUTES, Route

__all__ = [
    "DAEMON",
    "Handler",
    "RouteTable",
    "args_of",
    "body",
    "error_middleware",
    "manifest_body",
    "reply",
    "route_of",
    "wants_msgpack",
]

T = TypeVar("T")

DAEMON: web.AppKey[Daemon] = web.AppKey("daemon", Daemon)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: a handler as written: ``(request)``, or ``(request, args)`` for a route with ``args``
H = TypeVar("H", bound=Callable[..., Awaitable[web.StreamResponse]])


class RouteTable(web.RouteTableDef):
    """A handler module's routes, each bound to its entry in :mod:`refitd.wire.routes`
    (the one place a method, a path and its parameters are written)."""

    def handles(self, route: Route[Any]) -> Callable[[H], H]:
        """Register the decorated handler for ``route``. Where the route has ``args``,
        the handler is ``(request, args)`` and gets the request's path and query
        decoded into them (400 before it runs otherwise); else it is ``(request)``."""

        def register(handler: H) -> H:
            takes = len(inspect.signature(handler).parameters)
            if takes != (1 if route.args is None else 2):
                raise TypeError(
                    f"{handler.__qualname__} takes {takes} arguments; the handler of "
                    f"{route.method} {route.path} takes (request"
                    f"{', args' if route.args is not None else ''})"
                )
            if route.args is None:
                self.route(route.method, route.path)(handler)
                return handler
            cls = route.args

            @functools.wraps(handler)
            async def decoded(request: web.Request) -> web.StreamResponse:
                return await handler(request, args_of(request, cls))

            self.route(route.method, route.path)(decoded)
            return handler

        return register


A = TypeVar("A", bound=Args)


def args_of(request: web.Request, cls: type[A]) -> A:
    """``request``'s path and query decoded as ``cls`` (a route's ``args``); refused
    (:class:`ProtocolError`, 400) naming a parameter off its type or bounds."""
    return decode_args(cls, request.match_info, request.query, f"{request.method} {request.path}")


_ROUTE_OF = {(r.method, r.path): r for r in ROUTES}


def route_of(request: web.Request) -> Route[Any] | None:
    """The route table's entry for the route ``request`` matched (None: a route
    outside the table, as in a test's own app)."""
    info = request.match_info.route
    resource = info.resource
    if resource is None:
        return None
    method = "GET" if info.method == "HEAD" else info.method
    return _ROUTE_OF.get((method, resource.canonical))


def wants_msgpack(request: web.Request) -> bool:
    return MSGPACK in request.headers.get("Accept", "")


def reply(request: web.Request, value: Any, status: int | None = None) -> web.Response:
    """Encode ``value`` (a Struct, list, dict or None) as the client asked, with
    ``status``, by default the one the route declares for success."""
    if status is None:
        route = route_of(request)
        status = route.status if route is not None else 200
    if wants_msgpack(request):
        return web.Response(body=msgspec.msgpack.encode(value), status=status, content_type=MSGPACK)
    return web.Response(
        body=msgspec.json.encode(value), status=status, content_type="application/json"
    )


async def body(request: web.Request, type_: type[T] | None = None) -> T:
    """Decode and validate the request body (msgpack or JSON) as the ``request`` type
    its route declares (``type_``: for a route outside the table)."""
    if type_ is None:
        route = route_of(request)
        if route is None or route.request is None:
            raise RuntimeError(f"{request.method} {request.path}: no request type declared")
        type_ = route.request
    raw = await request.read()
    as_msgpack = request.content_type == MSGPACK
    try:
        decoded: T
        if len(raw) > OFF_LOOP_BODY_BYTES:  # thousands of structs: decoded beside the loop
            decoded = await asyncio.to_thread(_decode, raw, type_, as_msgpack)
        else:
            decoded = _decode(raw, type_, as_msgpack)
        return decoded
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"{request.method} {request.path}: body refused: {exc}") from exc


OFF_LOOP_BODY_BYTES = 256 << 10
"""A request body past this many bytes is decoded in a worker thread, not on the
event loop (a pack request of 128k specs took 0.07-0.1 s of the loop's time)."""


def _decode(raw: bytes, type_: type[T], as_msgpack: bool) -> T:
    with gc_paused():
        if as_msgpack:
            return msgspec.msgpack.decode(raw, type=type_)
        return msgspec.json.decode(raw, type=type_)


async def manifest_body(request: web.Request, raw: bytes, max_shards: int) -> ManifestIn:
    """Decode ``raw``, the body of ``request``: a published manifest, decoded off the
    event loop one tensor at a time. Refused (400) when it lists more than
    ``max_shards`` shards over all its tensors (``limits.max_manifest_shards``). A
    tensor's rank and shard count are bounded by the wire types (a msgpack body past
    them is refused from its headers)."""
    what = f"{request.method} {request.path}"
    as_msgpack = request.content_type == MSGPACK
    return await asyncio.to_thread(_decode_manifest, raw, as_msgpack, max_shards, what)


#: encoded tensor bytes decoded in one call: long enough to cost little per call,
#: short enough that the event loop waits a few milliseconds at most for the thread
DECODE_BATCH_BYTES = 1 << 20


def _decode_manifest(raw: bytes, as_msgpack: bool, max_shards: int, what: str) -> ManifestIn:
    # Tensors are decoded a batch (about DECODE_BATCH_BYTES) per call: between calls
    # this thread lets the event loop run (one call holds the interpreter throughout).
    decode: Callable[..., Any] = msgspec.msgpack.decode if as_msgpack else msgspec.json.decode
    tensors: list[TensorEntry] = []
    shards = 0

    def flush(batch: list[msgspec.Raw]) -> None:
        nonlocal shards
        if as_msgpack:
            n = len(batch)
            head = bytes([0x90 | n]) if n < 16 else b"\xdd" + n.to_bytes(4, "big")
            data = head + b"".join(bytes(r) for r in batch)
        else:
            data = b"[" + b",".join(bytes(r) for r in batch) + b"]"
        try:
            with gc_paused():
                got: list[TensorEntry] = decode(data, type=list[TensorEntry])
        except msgspec.ValidationError as exc:
            # The batch's paths start at `$[k]`: name the field in the whole body.
            base = len(tensors)
            where = re.sub(
                r"`\$\[(\d+)\]",
                lambda m: f"`$.tensors[{base + int(m.group(1))}]",
                str(exc),
            )
            raise msgspec.ValidationError(where) from exc
        for t in got:
            shards += len(t.shards)
            if shards > max_shards:
                raise ProtocolError(
                    f"{what}: manifest refused: more than {max_shards} shards by tensor "
                    f"#{len(tensors)} ({t.name!r}); the cap is limits.max_manifest_shards"
                )
            tensors.append(t)

    try:
        with gc_paused():
            head: ManifestHead = decode(raw, type=ManifestHead)
        batch: list[msgspec.Raw] = []
        size = 0
        for t in head.tensors:
            batch.append(t)
            size += len(t)
            if size >= DECODE_BATCH_BYTES:
                flush(batch)
                batch, size = [], 0
        if batch:
            flush(batch)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"{what}: body refused: {exc}") from exc
    return ManifestIn(head.model, head.version, head.part, head.expected_parts, tensors)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place raised refusals become HTTP: RefitError tree -> status, and the
    body :mod:`refitd.daemon.app.refusals` makes of every refusal."""
    try:
        return await handler(request)
    except RefitError as exc:
        return refused(request, status_of(exc), type(exc).__name__, str(exc))
    except web.HTTPRequestEntityTooLarge:
        return too_large(request, request.client_max_size)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type in (MSGPACK, "application/json"):
            raise  # a redirect, or a refusal already in our error shape
        # aiohttp's own refusals (no such route, method not allowed) in our error shape.
        name = "NotFoundError" if exc.status == 404 else "ProtocolError"
        return refused(request, exc.status, name, f"{request.method} {request.path}: {exc.reason}")
