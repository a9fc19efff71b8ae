"""Refusals as HTTP: the one place a refusal becomes a response body, and the one 413.

Every refusal the daemon answers goes out as ``{"error": ..., "detail": ...}``
(:class:`refitd.wire.ErrorBody`), in msgpack when the client asks for it (as the
daemon's own replies do), JSON otherwise: whether it was raised (a
:class:`~refitd.errors.RefitError`, mapped by
:func:`refitd.daemon.app.httpio.error_middleware`) or answered before any handler
ran (the access middleware's 401, 403 and 413, :mod:`refitd.daemon.access.auth`).
A body past the size limit is answered by :func:`too_large` alone, whichever of the
two middlewares meets it first.

This module imports nothing of the daemon, so both middlewares import it.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from refitd.wire import MSGPACK, ErrorBody

__all__ = ["body_of", "forbidden", "refused", "too_large"]


def body_of(request: web.BaseRequest, error: str, detail: str) -> tuple[bytes, str]:
    """The refusal ``error`` (a :class:`~refitd.errors.RefitError` class name) with
    ``detail`` as ``request``'s client reads it: its bytes and content type."""
    refusal = ErrorBody(error, detail)
    if MSGPACK in request.headers.get("Accept", ""):
        return msgspec.msgpack.encode(refusal), MSGPACK
    return msgspec.json.encode(refusal), "application/json"


def refused(
    request: web.BaseRequest, status: int, error: str, detail: str, **headers: str
) -> web.Response:
    """The response refusing ``request`` with ``status``: :func:`body_of` and ``headers``."""
    body, content_type = body_of(request, error, detail)
    return web.Response(status=status, body=body, content_type=content_type, headers=headers)


def forbidden(request: web.BaseRequest, detail: str) -> web.HTTPForbidden:
    """A 403 ``AccessDenied`` to raise (from a handler's owner check), in the same shape."""
    body, content_type = body_of(request, "AccessDenied", detail)
    refusal = web.HTTPForbidden()
    # Set after construction: aiohttp deprecates body= on its HTTP exceptions.
    refusal.body = body
    refusal.content_type = content_type
    return refusal


def too_large(request: web.BaseRequest, limit: int, size: int | None = None) -> web.Response:
    """The 413 ``RequestTooLarge`` refusing ``request``'s body: ``size`` bytes declared
    (None: a chunked body, found too large as it was read), ``limit`` the most this
    daemon accepts (``server.max_request_bytes``)."""
    what = f"a body of {size} bytes" if size is not None else "a larger body"
    return refused(
        request,
        413,
        "RequestTooLarge",
        f"{request.method} {request.path} sent {what}, too large: this daemon accepts at "
        f"most {limit} bytes (server.max_request_bytes)",
    )
