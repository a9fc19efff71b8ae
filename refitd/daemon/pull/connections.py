"""A pull's path and connections: which data plane reads each source, the
connection it reads through (made once per source daemon life where a transport
shares its connections), the credential each is read under, and for reads into
device memory over a host-only plane the staging around that connection.

:class:`PullPaths` is what :class:`~refitd.daemon.pull.pulls.PullManager` decides
and opens before any byte moves, and what reads outside a pull (a host mirror's, a
relay's feed) open through it; the pure decision is :mod:`refitd.daemon.pull.paths`.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from refitd.daemon.pull import core as pullcore
from refitd.daemon.pull.devstaging import BUFFER_BYTES, BUFFERS, StagedPeer, StagingRegions
from refitd.daemon.pull.paths import advert_of, adverts, choose_remote, lease_scope
from refitd.daemon.pull.sources import Source
from refitd.daemon.state.plane import TransportSet
from refitd.daemon.state.store import RegionStore
from refitd.errors import RefitError, TransportError
from refitd.wire import PeerRegions, RegionCreate
from transports.interface import Peer, PeerInfo, Transport

__all__ = ["PullPaths"]

log = logging.getLogger("refitd.pulls")


class PullPaths:
    """The path choice and connections of one daemon's pulls, a part of its
    :class:`~refitd.daemon.pull.pulls.PullManager` built with the owners it uses:
    the data planes ``plane`` in the data-plane ``mode``, the region ``store`` (what
    a pull writes into; the host staging of device-bound reads is made there), and
    ``seen_paths``, the daemon's note of the path each peer was last read over and
    why."""

    def __init__(
        self,
        plane: TransportSet,
        mode: str,
        store: RegionStore,
        seen_paths: dict[str, tuple[str, str]],
    ) -> None:
        self.plane = plane
        self.mode = mode
        self.store = store
        #: per peer node, the path the last pull from it took and why (the daemon's)
        self.seen_paths = seen_paths
        #: the transport's connection per source daemon life (node id, incarnation)
        self._peers: dict[tuple[str, int, str], Peer] = {}
        #: one opener at a time per peer node (see :meth:`transport_peer`)
        self._opening: dict[str, asyncio.Lock] = {}
        #: host staging regions of device-bound reads, kept between pulls
        self.staging_regions = StagingRegions(
            self._make_staging, lambda rid: rid in store.segments, self._drop_staging
        )

    async def choose_path(self, src: Source, peer: PeerRegions | None) -> tuple[str, Peer | None]:
        """The path a pull from ``src`` takes, decided before any byte moves, and for
        ``shm`` the connection it reads through.

        ``shm`` for a source read where it is (:meth:`Source.loopback`: this daemon, a
        loopback connection of its ``shm`` transport, in any mode); in mode ``auto``
        or ``shm``, ``shm`` when the ``shm`` transport connects to the peer
        (:meth:`shm_refusal` says why not otherwise); else (mode ``auto`` or a
        scheme) the transport's scheme, when the peer advertises that transport
        (connected when bytes first move).
        Raises :class:`TransportError` (nothing moved) when no path fits.
        """
        shm = self.plane.shm.scheme
        here = src.loopback()
        if here is not None:
            return shm, here
        if peer is None:
            return "none", None  # nothing to read
        pullcore.refuse_peer_devices(peer, self.mode)
        why_not_shm = pullcore.forced(self.mode)
        if pullcore.peer_devices(peer):
            why_not_shm = "its GPU regions are read through its staging"
        elif pullcore.tries_shm(self.mode):
            try:
                conn = await self.plane.shm.connect(self.shm_credential(peer))
                self.seen_paths[peer.node_id] = (shm, "proven on this host")
                return shm, conn
            except (RefitError, OSError) as exc:
                why_not_shm = pullcore.shm_refused(self.mode, peer.node_id, str(exc))
        mine = {s: t.capabilities for s, t in self.plane.by_scheme.items()}
        scheme, why = choose_remote(self.mode, mine, peer, why_not_shm)
        self.seen_paths[peer.node_id] = (scheme, why)
        log.info("pull from %s over %s: %s", peer.node_id, scheme, why)
        return scheme, None

    def lease_checked_by(self, path: str) -> bool:
        """Whether the data plane of ``path`` checks the lease at the source before
        every read (:attr:`transports.interface.Transport.checks_lease`)."""
        transport = self.plane.by_scheme.get(path)
        return transport is not None and transport.checks_lease

    async def open_path(self, src: Source, peer: PeerRegions) -> tuple[str, Peer]:
        """The path a pull from ``src`` (its records ``peer``) would take, and a
        connection on it, for reads made outside a pull (a host mirror's). A
        connection of a path that does not share them (``shm``) is the caller's to
        close; a shared one stays open (:meth:`owns`)."""
        path, conn = await self.choose_path(src, peer)
        if conn is None:
            conn = await self.transport_peer(peer, path)
        return path, conn

    def owns(self, path: str) -> bool:
        """Whether a connection :meth:`open_path` gave on ``path`` is its reader's own
        (to close when done), not one shared by every reader of its peer."""
        return not self.plane.caps(path).shares_connections

    async def regrant(self, peer: PeerRegions, path: str, conn: Peer) -> Peer:
        """A connection on ``path`` reading ``peer`` under a grant made from these
        (newer) records, for reads outside a pull whose scope grows (a relay's feed):
        ``conn`` itself, widened in place, where it is its reader's own (:meth:`owns`);
        else the transport's shared connection, scoped to them."""
        if self.owns(path):
            return await conn.scoped(self._credential(peer, path))
        return await self.transport_peer(peer, path)

    def _credential(self, peer: PeerRegions, path: str) -> PeerInfo:
        """The record the transport of ``path`` reads ``peer`` through: the credential
        the source granted the lease on it, in ``peer``'s signed records, as given
        (this daemon never makes one); for the same-host transport, checked first to
        be the grant of ``peer``'s lease (:meth:`shm_credential`)."""
        transport = self._transport(path)
        if transport is self.plane.shm:
            return self.shm_credential(peer)
        return adverts(peer)[transport.scheme]

    def _transport(self, path: str) -> Transport:
        transport = self.plane.on(path)
        if transport is None:  # choose_path picks only a transport this daemon runs
            raise TransportError(f"this daemon runs no transport {path!r}")
        return transport

    async def shm_refusal(self, peer: PeerRegions) -> str | None:
        """Why the ``shm`` transport does not connect to ``peer``, or None when it does:
        the peer's boot id equals ours and every region it listed maps (by name) to
        the very file its signed record names, at exactly the size it states."""
        try:
            conn = await self.plane.shm.connect(self.shm_credential(peer))
        except (RefitError, OSError) as exc:
            return str(exc)
        await conn.close()
        return None

    def shm_credential(self, peer: PeerRegions) -> PeerInfo:
        """The record the ``shm`` transport reads ``peer`` through: the grant the source
        made for the lease of ``peer``'s records (:meth:`transports.shm.ShmTransport.grant`),
        as given, once that transport checked it names that lease and every host region
        the pull may read (:meth:`transports.shm.ShmTransport.check_grant`); refused
        for records given without a lease, which carry none."""
        grant = advert_of(peer, self.plane.shm.scheme)
        self.plane.shm.check_grant(grant, lease_scope(peer))
        return grant

    async def transport_peer(self, peer: PeerRegions, scheme: str) -> Peer:
        """The ``scheme`` transport's connection to ``peer``: made once per source
        daemon life, and read by the pull under the credential the source granted its
        lease (in ``peer``'s signed records, :meth:`Leases.peer_regions`), as given:
        this daemon never makes one (:meth:`_credential`)."""
        transport = self._transport(scheme)
        info = self._credential(peer, scheme)
        key = (peer.node_id, peer.incarnation, scheme)
        # Pulls that find no connection at once wait for the first one's: each
        # opening its own would leave all but one unkept, so never closed.
        async with self._opening.setdefault(peer.node_id, asyncio.Lock()):
            earlier = [k for k in self._peers if k[0] == key[0] and k[1] != key[1]]
            for old in earlier:
                await self._peers.pop(old).close()  # an earlier life of that daemon
            conn = self._peers.get(key)
            if conn is None:
                conn = await transport.connect(info)
                self._peers[key] = conn
        return await conn.scoped(info)

    async def staged(self, conn: Peer, rows: np.ndarray) -> StagedPeer:
        """``conn`` (a host-memory data plane's) with the reads into this daemon's
        device memory staged through a host staging region (one kept from an earlier
        pull where one is idle)."""
        targets = [int(r) for r in np.unique(rows[:, 2]).tolist()]
        devices = [r for r in targets if self.store.device_kinds([r])]
        staging = await self.staging_regions.take()
        return StagedPeer(conn, self.plane.shm.loopback(), staging, devices)

    async def _make_staging(self) -> int:
        info = await self.store.create_region(
            RegionCreate(BUFFERS * BUFFER_BYTES, label="device-staging")
        )
        return info.region_id

    async def _drop_staging(self, region_id: int) -> None:
        await self.store.drop(region_id, self.store.regions.get(region_id))
