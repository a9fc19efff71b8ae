"""The daemon's client of its peer daemons: the four calls a pull makes to its source.

A pulling daemon asks its source daemon to check the pull's lease, for the signed
region records that lease may read, to pack strided blocks into staging, and to
release that staging. These are daemon-to-daemon calls (``/v1/leases/{id}`` and
``/v1/peer/...``), so the daemon makes them with this client, not with the public
:class:`refitd.client.RefitClient` a trainer or an engine uses.

Bodies travel as msgpack. A refusal comes back as the RefitError class the peer
raised (by name, else by status); a connection failure is a
:class:`~refitd.errors.TransportError`; a redirect is refused, never followed (it
would carry the token and the lease to a host nobody listed).
"""

from __future__ import annotations

from typing import Any, TypeVar

import aiohttp
import msgspec

from refitd import errors
from refitd.wire import (
    ERROR_OF_STATUS,
    MSGPACK,
    ErrorBody,
    LeaseGrant,
    PackRequest,
    PackSpec,
    PeerRegions,
    StagedPack,
    gc_paused,
)

__all__ = ["PeerClient"]

T = TypeVar("T")

_ERRORS: dict[str, type[errors.RefitError]] = {
    name: getattr(errors, name) for name in errors.__all__
}


class PeerClient:
    """Calls one peer daemon at ``base_url`` (its API v1), with this daemon's
    ``token`` where peers require one. :meth:`close` when done."""

    def __init__(
        self, base_url: str, *, token: str | None = None, timeout_s: float = 300.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Accept": MSGPACK}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def check_lease(self, lease_id: str, model: str, version: int) -> LeaseGrant:
        """ConflictError unless ``lease_id`` is live on exactly ``(model, version)``."""
        params = {"model": model, "version": str(version)}
        return await self._call("GET", f"/leases/{lease_id}", LeaseGrant, params=params)

    async def regions(self, ids: list[int], lease_id: str, model: str, version: int) -> PeerRegions:
        """Signed records of ``ids`` that ``lease_id`` (on ``model`` ``version``) may
        read, each with the byte ranges it may read (not verified here)."""
        params = {
            "ids": ",".join(str(i) for i in ids),
            "lease": lease_id,
            "model": model,
            "version": str(version),
        }
        return await self._call("GET", "/peer/regions", PeerRegions, params=params)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        """Gather ``specs`` into a staging region of the peer, held for ``lease_id``."""
        body = PackRequest(model, version, lease_id, specs)
        return await self._call("POST", "/peer/pack", StagedPack, body)

    async def drop(self, region_id: int, lease_id: str) -> None:
        """Release staging region ``region_id``, packed for ``lease_id``."""
        params = {"lease": lease_id}
        await self._call("DELETE", f"/peer/staging/{region_id}", type(None), params=params)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64),
                timeout=self._timeout,
                headers=self._headers,
            )
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        type_: type[T],
        body: Any = None,
        params: dict[str, str] | None = None,
    ) -> T:
        data = None if body is None else msgspec.msgpack.encode(body)
        headers = {"Content-Type": MSGPACK} if data is not None else None
        url = f"{self.base_url}/v1{path}"
        try:
            async with self._open().request(
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
            raise _refusal(status, raw, f"{method} {path}: HTTP {status} {raw[:200]!r}")
        if type_ is type(None):
            return None
        try:
            with gc_paused():
                return msgspec.msgpack.decode(raw, type=type_)
        except msgspec.DecodeError as exc:
            raise errors.ProtocolError(f"{method} {path}: malformed response ({exc})") from exc


def _refusal(status: int, raw: bytes, fallback: str) -> errors.RefitError:
    """The RefitError a refusal stands for: by the class name the peer sent, else by
    its status code."""
    try:
        body: ErrorBody | None = msgspec.msgpack.decode(raw, type=ErrorBody)
    except msgspec.DecodeError:
        body = None
    if body is not None and body.error in _ERRORS:
        return _ERRORS[body.error](body.detail)
    cls = ERROR_OF_STATUS.get(status, errors.RefitError)
    return cls(body.detail if body is not None else fallback)
