"""Where a pull reads from, seen from the daemon that pulls: this daemon
(:class:`LocalSource`), a peer daemon (:class:`RemoteSource`), and a source whose
bytes are still arriving (:class:`Filling`, a host mirror filling).

A pull asks its source what it can do (:meth:`Source.loopback`, :meth:`Source.own`,
:attr:`Source.filling`), never which class it is."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from refitd.daemon.pull.peerclient import PeerClient
from refitd.daemon.state.plane import TransportSet
from refitd.daemon.state.registry import Registry
from refitd.daemon.state.staging import StagingPool
from refitd.errors import AccessDenied
from refitd.wire import PackRequest, PackSpec, PeerRegions, PullRequest, StagedPack
from transports.batch import ReadBatch
from transports.interface import Peer

__all__ = [
    "Filling",
    "Gated",
    "LeasedPack",
    "LeasedRecords",
    "LocalSource",
    "Redirect",
    "RemoteSource",
    "Source",
]

Gated = tuple[ReadBatch, np.ndarray, list[tuple[int, int]], Callable[[int, int], Awaitable[None]]]
"""A pull's reads of a source still filling: reads, descriptors each ends, spans,
and ``ready(lo, hi)``, which returns once the reads of a span may be made."""

LeasedRecords = Callable[[list[int] | None, str, str, int], PeerRegions]
"""``(ids, lease_id, model, version)``: this daemon's signed records of region ``ids``
for a pull under that lease (409 for a lease not live on the version), scoped to what
it may read: :meth:`~refitd.daemon.app.leasing.Leases.leased_regions`."""

LeasedPack = Callable[[PackRequest], Awaitable[StagedPack]]
"""This daemon packing a request's specs into staging for its lease (409 for a lease
not live on its version): :meth:`~refitd.daemon.app.leasing.Leases.pack_leased`."""


class Filling(Protocol):
    """A source whose bytes are still arriving (a host mirror filling): a pull reads
    each of its pieces as soon as that piece is complete, never before."""

    def gated(self, rows: np.ndarray, done: np.ndarray | None, batch_reads: int) -> Gated:
        """Wire ``rows`` (``done``: see :func:`~refitd.daemon.pull.core.cut`) as reads
        in the order the source fills, in spans of at most ``batch_reads`` reads (the
        path's), and the wait before each span."""
        ...

    async def complete(self) -> None:
        """Return once every byte is there (raise if it never will be)."""
        ...


class Source(Protocol):
    """The daemon a pull reads from, seen from the daemon that pulls."""

    #: its bytes are still arriving (a host mirror filling): read as they complete
    filling: Filling | None

    def loopback(self) -> Peer | None:
        """A connection reading this source's regions where they are, in this daemon
        (its own memory), or None: it is read over the path chosen for its peer."""
        ...

    def own(self, ids: list[int]) -> set[int]:
        """Of region ``ids`` of this source, those that are this daemon's own regions
        (kept from going while a pull reads them)."""
        ...

    def granted(self, req: PullRequest) -> PeerRegions | None:
        """The records ``req`` presents that this source granted its lease (verified),
        or None where there are none to use (then :meth:`regions` asks for them)."""
        ...

    async def check_lease(self, lease_id: str, model: str, version: int) -> None: ...
    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        """Signed records of ``ids``, scoped to what ``req``'s lease may read."""
        ...

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack: ...
    async def drop(self, region_id: int, lease_id: str) -> None: ...


class LocalSource:
    """This daemon as the source of its own pulls, built with the parts it reads:
    the data planes (``plane``: its same-host loopback), the version ``registry``
    (lease checks), the ``staging`` pool (a pack's region given back), and what a
    lease is given here (``records`` and ``pack``, whose rule, "a lease reads only
    its version's shards and the staging packed for it", is the leasing's, one for
    this daemon's own pulls and its peers'). ``filling``: the bytes it reads are
    still arriving (a host mirror's, :mod:`refitd.daemon.mirror.read`)."""

    filling: Filling | None = None

    def __init__(
        self,
        plane: TransportSet,
        registry: Registry,
        staging: StagingPool,
        records: LeasedRecords,
        pack: LeasedPack,
    ) -> None:
        self.plane = plane
        self.registry = registry
        self.staging = staging
        self._records = records
        self._pack = pack

    def loopback(self) -> Peer:
        return self.plane.shm.loopback()

    def own(self, ids: list[int]) -> set[int]:
        return set(ids)

    def granted(self, req: PullRequest) -> PeerRegions | None:
        return None  # this daemon's own records cost no round trip

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        self.registry.check(lease_id, model, version)

    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        return self._records(ids, req.lease_id, req.model, req.version)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        return await self._pack(PackRequest(model, version, lease_id, specs))

    async def drop(self, region_id: int, lease_id: str) -> None:
        await self.staging.release(region_id, lease_id)


class RemoteSource:
    """A peer daemon, reached through this daemon's :class:`PeerClient`; its region
    records are verified with the deployment ``secret``."""

    filling: Filling | None = None

    def __init__(self, client: PeerClient, secret: bytes) -> None:
        self.client = client
        self.secret = secret

    def loopback(self) -> None:
        return None

    def own(self, ids: list[int]) -> set[int]:
        return set()

    def granted(self, req: PullRequest) -> PeerRegions | None:
        """``req.grant``, once its MAC verifies (:class:`ProtocolError` if it does not:
        altered, or made outside this deployment) and it was granted ``req``'s very
        lease (:class:`AccessDenied` if not); None when ``req`` presents none, or
        records of a daemon, or of a life of it, other than the one this source's own
        records came from (or before any did): then they are asked of this source
        itself. A grant names the data server it is read at, so one of an earlier life
        (a daemon of the same node id started again elsewhere) would read that life's
        bytes, and close this daemon's connection to the live one."""
        rec = req.grant
        if rec is None:
            return None
        rec.verify(self.secret)
        if not rec.lease_id or rec.lease_id != req.lease_id:
            raise AccessDenied(
                f"pull refused: the grant it presents is of lease {rec.lease_id!r}, not of "
                f"its lease {req.lease_id!r}; a pull reads only with its own lease's grant"
            )
        mine = (self.client.node_id, self.client.incarnation)
        return rec if (rec.node_id, rec.incarnation) == mine else None

    def answered(self, rec: PeerRegions) -> PeerRegions:
        """Records this source answered one of this daemon's own requests with,
        verified: from now on they name the daemon at its URL (:meth:`granted`)."""
        rec.verify(self.secret)
        self.client.node_id, self.client.incarnation = rec.node_id, rec.incarnation
        return rec

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        await self.client.check_lease(lease_id, model, version)

    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        return self.answered(await self.client.regions(ids, req.lease_id, req.model, req.version))

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        return await self.client.pack(model, version, lease_id, specs)

    async def drop(self, region_id: int, lease_id: str) -> None:
        await self.client.drop(region_id, lease_id)


@dataclass
class Redirect:
    """A pull rewritten to read this daemon's mirror (from ``source``), and how to let
    go of it."""

    req: PullRequest
    release: Callable[[], None]
    source: Source
