"""The daemon's client of its peer daemons: the four calls a pull makes to its source,
and the calls a host mirror makes to the daemon it reads from.

A pulling daemon asks its source daemon to check the pull's lease, for the signed
region records that lease may read, to pack strided blocks into staging, and to
release that staging. A host mirror (:mod:`refitd.daemon.mirrors`) also leases the
version it copies, reads its manifest, joins the source's holder book and follows an
upstream mirror's progress. These are daemon-to-daemon calls (``/v1/leases/{id}`` and
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
    API_PREFIX,
    ERROR_OF_STATUS,
    MSGPACK,
    ErrorBody,
    LeaseGrant,
    LeaseRequest,
    MergedManifest,
    PackRequest,
    PackSpec,
    PeerRegions,
    StagedPack,
    gc_paused,
)
from refitd.wire import routes as api
from refitd.wire.mirrors import HolderAssign, HolderJoin, MirrorState

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
        return await self._send(api.CHECK_LEASE, params=params, lease_id=lease_id)

    async def regions(self, ids: list[int], lease_id: str, model: str, version: int) -> PeerRegions:
        """Signed records of ``ids`` that ``lease_id`` (on ``model`` ``version``) may
        read, each with the byte ranges it may read (not verified here)."""
        params = {
            "ids": ",".join(str(i) for i in ids),
            "lease": lease_id,
            "model": model,
            "version": str(version),
        }
        return await self._send(api.PEER_REGIONS, params=params)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        """Gather ``specs`` into a staging region of the peer, held for ``lease_id``."""
        body = PackRequest(model, version, lease_id, specs)
        return await self._send(api.PEER_PACK, body)

    async def drop(self, region_id: int, lease_id: str) -> None:
        """Release staging region ``region_id``, packed for ``lease_id``."""
        params = {"lease": lease_id}
        await self._send(api.PEER_DROP, params=params, region_id=region_id)

    # ------------------------------------------------------------ a host mirror's calls

    async def acquire_lease(
        self, model: str, version: int, ttl_s: float, source_lease: str = ""
    ) -> LeaseGrant:
        """Lease ``model`` ``version`` (READY there) for ``ttl_s`` seconds; a host
        mirror's version under ``source_lease``, a live lease on it at its source."""
        req = LeaseRequest(model, version, ttl_s, source_lease=source_lease)
        return await self._send(api.ACQUIRE_LEASE, req)

    async def renew_lease(self, lease_id: str, ttl_s: float) -> LeaseGrant:
        return await self._send(api.RENEW_LEASE, params={"ttl": str(ttl_s)}, lease_id=lease_id)

    async def release_lease(self, lease_id: str) -> None:
        await self._send(api.RELEASE_LEASE, lease_id=lease_id)

    async def manifest(self, model: str, version: int) -> MergedManifest:
        return await self._send(api.MANIFEST, model=model, version=version)

    async def join_holders(self, join: HolderJoin) -> HolderAssign:
        """Join the holder pipeline of a version the peer is the source of; answers
        the holder to read from."""
        return await self._send(api.MIRROR_HOLDERS, join)

    async def mirror_state(
        self, model: str, version: int, after: int, timeout_s: float, lease_id: str = ""
    ) -> MirrorState:
        """The peer's mirror of ``model`` ``version``, once more than ``after`` chunks
        are complete there, it ended, or ``timeout_s`` passed; asked under a lease on
        it there (``lease_id``), or as a principal that may read the model there."""
        params = {"after": str(after), "timeout": str(timeout_s)}
        if lease_id:
            params["lease"] = lease_id
        return await self._send(api.MIRROR_STATE, params=params, model=model, version=version)

    async def _send(
        self,
        route: api.Route[T],
        body: Any = None,
        params: dict[str, str] | None = None,
        **path: object,
    ) -> T:
        """Call ``route`` (its path parameters in ``path``)."""
        rel = route.url(**path).removeprefix(API_PREFIX)
        return await self._call(route.method, rel, route.response, body, params)

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
