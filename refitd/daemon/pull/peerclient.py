"""The daemon's client of its peer daemons: the four calls a pull makes to its source,
and the calls a host mirror makes to the daemon it reads from.

A pulling daemon asks its source daemon to check the pull's lease, for the signed
region records that lease may read, to pack strided blocks into staging, and to
release that staging. A host mirror (:mod:`refitd.daemon.mirror.mirrors`) also leases the
version it copies, reads its manifest, joins the source's holder book and follows an
upstream mirror's progress. These are daemon-to-daemon calls (``/v1/leases/{id}`` and
``/v1/peer/...``), so the daemon makes them with this client, not with the public
:class:`refitd.client.RefitClient` a trainer or an engine uses.

It speaks through the same :class:`~refitd.client.session.ApiSession` as that client:
msgpack bodies, the refusal the peer raised (by name, else by status), a
:class:`~refitd.errors.TransportError` for a connection failure, and a redirect
refused, never followed (it would carry the token and the lease to a host nobody
listed).
"""

from __future__ import annotations

from refitd.client.session import ApiSession, refusal
from refitd.wire import (
    LeaseInfo,
    LeaseRequest,
    MergedManifest,
    PackRequest,
    PackSpec,
    PeerRegions,
    StagedPack,
)
from refitd.wire import routes as api
from refitd.wire.digests import ChunkDigests
from refitd.wire.mirrors import HolderAssign, HolderJoin

__all__ = ["PeerClient"]

#: The refusal a peer's error answer stands for (:func:`refitd.client.session.refusal`).
_refusal = refusal


class PeerClient(ApiSession):
    """Calls one peer daemon at ``base_url`` (its API v1), with this daemon's
    ``token`` where peers require one (``PeerClient(url, token=...)``, as an
    :class:`ApiSession`). :meth:`close` when done."""

    #: the node id and life the peer's own signed records gave, once any did ("" and
    #: -1 before): a grant of another daemon, or of another life of this one, is not
    #: read with (:meth:`~refitd.daemon.pull.sources.RemoteSource.granted`)
    node_id: str = ""
    incarnation: int = -1

    async def check_lease(self, lease_id: str, model: str, version: int) -> LeaseInfo:
        """ConflictError unless ``lease_id`` is live on exactly ``(model, version)``."""
        params = {"model": model, "version": str(version)}
        return await self.send(api.CHECK_LEASE, params=params, lease_id=lease_id)

    async def regions(self, ids: list[int], lease_id: str, model: str, version: int) -> PeerRegions:
        """Signed records of ``ids`` that ``lease_id`` (on ``model`` ``version``) may
        read, each with the byte ranges it may read (not verified here)."""
        params = {
            "ids": ",".join(str(i) for i in ids),
            "lease": lease_id,
            "model": model,
            "version": str(version),
        }
        return await self.send(api.PEER_REGIONS, params=params)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        """Gather ``specs`` into a staging region of the peer, held for ``lease_id``."""
        body = PackRequest(model, version, lease_id, specs)
        return await self.send(api.PEER_PACK, body)

    async def drop(self, region_id: int, lease_id: str) -> None:
        """Release staging region ``region_id``, packed for ``lease_id``."""
        params = {"lease": lease_id}
        await self.send(api.PEER_DROP, params=params, region_id=region_id)

    # ------------------------------------------------------------ a host mirror's calls

    async def acquire_lease(
        self,
        model: str,
        version: int,
        ttl_s: float,
        source_lease: str = "",
        *,
        manifest: bool = False,
    ) -> LeaseInfo:
        """Lease ``model`` ``version`` (READY there) for ``ttl_s`` seconds; a host
        mirror's version under ``source_lease``, a live lease on it at its source. The
        grant carries the peer's signed records of what the lease reads, and with
        ``manifest`` the version's merged manifest."""
        req = LeaseRequest(model, version, ttl_s, source_lease=source_lease, manifest=manifest)
        return await self.send(api.ACQUIRE_LEASE, req)

    async def renew_lease(self, lease_id: str, ttl_s: float) -> LeaseInfo:
        return await self.send(api.RENEW_LEASE, params={"ttl": str(ttl_s)}, lease_id=lease_id)

    async def release_lease(self, lease_id: str) -> None:
        await self.send(api.RELEASE_LEASE, lease_id=lease_id)

    async def manifest(self, model: str, version: int) -> MergedManifest:
        return await self.send(api.MANIFEST, model=model, version=version)

    async def join_holders(self, join: HolderJoin) -> HolderAssign:
        """Join the holder pipeline of a version the peer is the source of; answers
        the holder to read from."""
        return await self.send(api.MIRROR_HOLDERS, join)

    async def chunk_digests(self, model: str, version: int, lease_id: str) -> ChunkDigests:
        """The digest of each chunk of ``model`` ``version`` (the peer is its source),
        under ``lease_id``, a live lease on it there: what a mirror checks the chunks
        it read from another holder against (:func:`refitd.daemon.mirror.digest.verify`)."""
        params = {"lease": lease_id}
        return await self.send(api.MIRROR_DIGESTS, params=params, model=model, version=version)
