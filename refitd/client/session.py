"""One HTTP session to one daemon's API v1: :class:`ApiSession`, the base of both the
public :class:`~refitd.client.http.RefitClient` and the daemon's own client of its
peers (:class:`refitd.daemon.pull.peerclient.PeerClient`).

What both need, written once:

- a route of :mod:`refitd.wire.routes` is called by its entry (its path filled in,
  only the query parameters its ``args`` declare, each spelled as
  :func:`refitd.wire.args.spell` writes it), so no path and no ``/v1`` is spelled here;
- bodies travel as msgpack, and answers decode as the route's response type;
- a redirect is refused, never followed: a daemon that points elsewhere would send the
  token, the lease and the request to a host nobody listed;
- a refusal comes back as the :class:`~refitd.errors.RefitError` class the daemon
  raised (by the name in its body, else by status, :func:`error_from_body`); a
  connection failure is a :class:`~refitd.errors.TransportError` raised ``from``
  aiohttp's exception.

It imports nothing of torch, so a daemon (or ``refitd status``) may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import aiohttp
import msgspec

from refitd import errors
from refitd.wire import ERROR_OF_STATUS, MSGPACK, ErrorBody, gc_paused
from refitd.wire.args import spell
from refitd.wire.routes import Route

__all__ = ["ApiSession", "error_from_body", "refusal"]

T = TypeVar("T")

#: The refusal classes by name, as the daemon's error body names them.
_ERRORS: dict[str, type[errors.RefitError]] = {
    name: getattr(errors, name) for name in errors.__all__
}


def error_from_body(status: int, body: ErrorBody | None, fallback: str) -> errors.RefitError:
    """The RefitError a response stands for: by the class name the daemon sent, else
    by status code."""
    if body is not None and body.error in _ERRORS:
        return _ERRORS[body.error](body.detail)
    cls = ERROR_OF_STATUS.get(status, errors.RefitError)
    return cls(body.detail if body is not None else fallback)


def refusal(status: int, raw: bytes, fallback: str) -> errors.RefitError:
    """The RefitError of a refusal whose (msgpack) body is ``raw``."""
    try:
        body: ErrorBody | None = msgspec.msgpack.decode(raw, type=ErrorBody)
    except msgspec.DecodeError:
        body = None
    return error_from_body(status, body, fallback)


class ApiSession:
    """Calls one daemon: ``base_url`` over TCP, or ``unix_path`` (then ``base_url``
    only supplies the host header), with ``token`` as its bearer token where given.
    The aiohttp session opens on first use; :meth:`close` when done."""

    def __init__(
        self,
        base_url: str,
        *,
        unix_path: str | None = None,
        token: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._unix_path = unix_path
        self._headers = {"Accept": MSGPACK}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> aiohttp.ClientSession:
        """The aiohttp session (opened now if it is not open)."""
        if self._session is None or self._session.closed:
            connector = (
                aiohttp.UnixConnector(path=self._unix_path)
                if self._unix_path
                else aiohttp.TCPConnector(limit=64)
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        route: Route[T],
        body: Any = None,
        params: Mapping[str, str | int | float | bool] | None = None,
        **path: object,
    ) -> T:
        """Call ``route`` (its path parameters in ``path``, its query in ``params``: a
        flag as a bool, a number as a number), decoding the answer as the route's
        response type. A query parameter the route's ``args`` do not declare is
        refused here (TypeError), before anything is sent."""
        undeclared = sorted(set(params or ()) - set(route.query))
        if undeclared:
            raise TypeError(f"{route.method} {route.path} declares no query {undeclared}")
        query = None if params is None else {k: spell(v) for k, v in params.items()}
        return await self.request(route.method, route.url(**path), route.response, body, query)

    #: the route call and the session, as tests, tools and streaming calls name them
    _send = send
    _open = open

    async def request(
        self,
        method: str,
        path: str,
        type_: type[T],
        body: Any = None,
        params: dict[str, str] | None = None,
    ) -> T:
        """``method`` on ``path`` (from the root, ``/v1`` included), the answer decoded
        as ``type_`` (``type(None)``: no body); :meth:`send` for a route of the table,
        this for a path outside it (tests, tools)."""
        data = None if body is None else msgspec.msgpack.encode(body)
        headers = {"Content-Type": MSGPACK} if data is not None else None
        url = f"{self.base_url}{path}"
        try:
            async with self.open().request(
                method, url, data=data, headers=headers, params=params, allow_redirects=False
            ) as resp:
                raw = await resp.read()
                status = resp.status
                location = resp.headers.get("Location", "?")
        except aiohttp.ClientError as exc:
            raise errors.TransportError(f"{method} {url} failed: {exc}") from exc
        if 300 <= status < 400:
            raise errors.ProtocolError(
                f"{method} {url} refused: the daemon at {self.base_url} answered a "
                f"redirect (HTTP {status} to {location!r}); refitd never follows redirects"
            )
        if status >= 400:
            raise refusal(status, raw, f"{method} {path}: HTTP {status} {raw[:200]!r}")
        if type_ is type(None):
            return None
        try:
            with gc_paused():
                return msgspec.msgpack.decode(raw, type=type_)
        except msgspec.DecodeError as exc:
            raise errors.ProtocolError(f"{method} {path}: malformed response ({exc})") from exc
