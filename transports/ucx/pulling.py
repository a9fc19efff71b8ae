"""The ``ucx`` owner's pulling side: connections to peers, and a pulling child per peer.

:class:`UcxPeer` is one connection (`Transport.connect`); its reads go to the
pulling child of its peer id, started when first needed, connected to the peer, and
stopped when no connection uses it or, idle, to make room above
``max_peer_children``. Pulls sharing it each read under their own lease's record
(:class:`ScopedUcxPeer`, :meth:`UcxPeer.scoped`). :class:`PeerPulls` is that half of
:class:`~transports.ucx.transport.UcxTransport` (mixed in; the serving child, the
regions and the requests to a child stay there). See `transports.ucx.transport` for
the processes and why there are several.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError, TransportError

from ..batch import ReadBatch, as_read_batch, suspect_ranges, validate_batch
from ..interface import (
    AdvertisedRegion,
    Peer,
    PeerInfo,
    PeerLost,
    PullFailed,
    ReadRefused,
    Transport,
    TransportClosed,
)
from .protocol import Connect, Disconnect, Get, Reply, Request
from .supervisor import Child, ChildTimedOut

__all__ = ["BACKSTOP_S", "PeerPulls", "ScopedUcxPeer", "UcxPeer"]

log = logging.getLogger("refitd.dataplane")
BACKSTOP_S = 5.0
"""Seconds past a batch's deadline after which the owner kills a child that has not
answered (the child's own deadline should have ended the batch before)."""


class UcxPeer(Peer):
    """One connection to a peer. Its pulling child is connected with every region
    any record given to it listed (:meth:`update`, :meth:`scoped`), the newest
    generation of each; each read is checked against the one record it is made
    under: this connection's own, or a :class:`ScopedUcxPeer`'s."""

    def __init__(self, owner: PeerPulls, handle: int, info: PeerInfo) -> None:
        self.owner = owner
        self.handle = handle
        self.info = info
        self._sizes = {r.region_id: r.size for r in info.regions}
        #: what the pulling child is (to be) connected with: the serving process's
        #: worker address, and region id -> record
        self.address = info.address
        self.regions = {r.region_id: r for r in info.regions}
        self._closed = False
        life = hashlib.blake2b(info.address, digest_size=6).hexdigest()
        self._key = f"{info.peer_id}@{life}" if info.peer_id else f"#{handle}"

    @property
    def key(self) -> str:
        """Which pulling child serves this connection: one per life of a peer (its peer
        id and the worker address it was first connected at, as given to
        :meth:`PeerPulls.connect`).

        Never one child for two lives: the connection to a peer's earlier life is
        closed once it is gone, and in a child still shared with the new life that
        means closing UCX endpoints to a dead peer, which can block the child (and
        every read queued behind it) until it is killed. Alone in its child, the
        earlier life's connection is closed by stopping the child."""
        return self._key

    @property
    def pid(self) -> int | None:
        """Process id of the child pulling from this peer (None until one is started)."""
        c = self.owner._pullers.get(self.key)
        return c.proc.pid if c is not None and not c.dead else None

    def _check_record(self, info: PeerInfo) -> None:
        info.verify(self.owner.secret)  # before any key reaches UCX
        if info.peer_id != self.info.peer_id:
            raise ProtocolError(
                f"update refused: the record is for peer {info.peer_id!r}, this connection "
                f"is to {self.info.peer_id!r}"
            )

    async def update(self, info: PeerInfo) -> None:
        self._check_record(info)
        self.info = info
        self._sizes = {r.region_id: r.size for r in info.regions}
        self._cover(info)

    async def scoped(self, info: PeerInfo) -> Peer:
        """A view of this connection whose reads are checked against ``info`` alone.

        Concurrent pulls from one peer share this connection, each under the record
        its own lease was given; a record fetched earlier lists fewer regions (not the
        staging packed for a later lease), so one pull's record must never replace
        another's: each view keeps its own, and the child is connected with both."""
        if info is self.info:
            return self
        self._check_record(info)
        self._cover(info)
        return ScopedUcxPeer(self, info)

    def _cover(self, info: PeerInfo) -> None:
        """Connect the child (before the next read) with ``info``'s regions too.

        A record from a later serving process of the peer (another worker address,
        newer generations: it restarted, and the old keys are void) replaces every
        region; one from an earlier process (fetched before the restart, given after)
        changes nothing: pointing the child back there would send every sharing
        pull's reads, each checked against its own record, to that process. Otherwise
        each region keeps the newest generation any record gave it."""
        if info.address != self.address:
            if _newest(info.regions) <= _newest(self.regions.values()):
                return  # an earlier process's record: its reads fail there, no one else's
            self.address = info.address
            self.regions = {}
        merged = dict(self.regions)
        for r in info.regions:
            old = merged.get(r.region_id)
            if old is None or r.generation > old.generation:
                merged[r.region_id] = r
        if merged == self.regions:
            return
        self.regions = merged
        c = self.owner._pullers.get(self.key)
        if c is not None:
            c.connected.discard(self.handle)  # connect again (new keys) before the next get

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        await self._get_under(self._sizes, batch)

    async def _get_under(
        self,
        sizes: dict[int, int],
        batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]],
    ) -> None:
        if self._closed:
            raise TransportClosed(f"get refused: connection to {self.info.peer_id!r} is closed")
        reads = as_read_batch(batch)
        validate_batch(reads, self.owner.local_sizes(), sizes)
        if not (reads["nbytes"] > 0).any():
            return
        await self.owner._pull(self, reads)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.owner._close_peer(self)


def _newest(regions: Iterable[AdvertisedRegion]) -> int:
    """The newest generation among ``regions`` (0: none): a later serving process of
    a peer registers its regions again, under newer generations."""
    return max((r.generation for r in regions), default=0)


class ScopedUcxPeer(Peer):
    """:meth:`UcxPeer.scoped`: the connection's reads, checked against ``info`` (one
    lease's record of the peer). Closing it leaves the connection open."""

    def __init__(self, conn: UcxPeer, info: PeerInfo) -> None:
        self.conn = conn
        self.info = info
        self._sizes = {r.region_id: r.size for r in info.regions}

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        await self.conn._get_under(self._sizes, batch)

    async def update(self, info: PeerInfo) -> None:
        self.conn._check_record(info)
        self.conn._cover(info)
        self.info = info
        self._sizes = {r.region_id: r.size for r in info.regions}

    async def scoped(self, info: PeerInfo) -> Peer:
        return await self.conn.scoped(info)

    async def close(self) -> None:
        return None


class PeerPulls(Transport):
    """Connections to peers and their pulling children (mixed into
    :class:`~transports.ucx.transport.UcxTransport`, whose state it reads)."""

    pull_timeout: float
    request_timeout: float
    lanes: int
    max_peer_children: int
    _closed: bool
    _pullers: dict[str, Child]
    _puller_locks: dict[str, asyncio.Lock]
    _peers: dict[int, UcxPeer]
    _handles: itertools.count[int]

    if TYPE_CHECKING:

        async def _ready(self) -> Child: ...

        async def _start_child(self, lanes: int, role: str, peer_id: str = "") -> Child: ...

        async def _stop_child(self, c: Child) -> None: ...

        async def _call_in(
            self,
            c: Child,
            body: Request,
            batch: ReadBatch | None = None,
            *,
            peer_id: str = "",
            limit: float | None = None,
        ) -> Reply: ...

        async def _map_in(self, c: Child, reads: ReadBatch) -> None: ...

    async def connect(self, info: PeerInfo) -> Peer:
        await self._ready()
        info.verify(self.secret)  # a forged record never reaches ucp_ep_rkey_unpack
        if info.scheme != self.scheme:
            raise ProtocolError(
                f"connect refused: record is for scheme {info.scheme!r}, not {self.scheme!r}"
            )
        peer = UcxPeer(self, next(self._handles), info)
        try:
            await self._puller(peer)  # a peer that cannot be connected fails here
        except TimeoutError:
            raise TransportError(
                f"connecting to {info.peer_id!r} timed out after {self.request_timeout} s: its "
                "data-plane process was stopped"
            ) from None
        self._peers[peer.handle] = peer
        return peer

    async def _puller(self, peer: UcxPeer) -> Child:
        """The live pulling child of ``peer`` (started if needed), connected to it."""
        if self._closed:
            raise TransportClosed("ucx transport is closed")
        lock = self._puller_locks.setdefault(peer.key, asyncio.Lock())
        async with lock:
            c = self._pullers.get(peer.key)
            if c is None or c.dead:
                await self._make_room()
                c = await self._start_child(self.lanes, peer.key, peer.info.peer_id)
                if self._closed:
                    await self._stop_child(c)
                    raise TransportClosed("ucx transport is closed")
                self._pullers[peer.key] = c
            while peer.handle not in c.connected:
                address, regions = peer.address, dict(peer.regions)
                await self._call_in(c, Connect(peer.handle, address, tuple(regions.values())))
                # A record given meanwhile (another pull's scope) connects again.
                if (address, regions) == (peer.address, peer.regions):
                    c.connected.add(peer.handle)
            c.last_used = time.monotonic()
            return c

    async def _make_room(self) -> None:
        """Stop least recently used idle pulling children until one more fits."""
        live = [c for c in self._pullers.values() if not c.dead]
        idle = sorted((c for c in live if not c.pending), key=lambda c: c.last_used)
        excess = len(live) + 1 - self.max_peer_children
        for c in idle[: max(0, excess)]:
            if self._pullers.get(c.role) is c:
                del self._pullers[c.role]
            log.info(
                "stopping the idle data-plane process pulling from %r (more than %d peers)",
                c.peer_id,
                self.max_peer_children,
            )
            await self._stop_child(c)

    async def _close_peer(self, peer: UcxPeer) -> None:
        self._peers.pop(peer.handle, None)
        c = self._pullers.get(peer.key)
        if c is None:
            return
        was_connected = peer.handle in c.connected
        c.connected.discard(peer.handle)
        if any(p.key == peer.key for p in self._peers.values()):
            if was_connected and not c.dead:  # another connection still uses the child
                with contextlib.suppress(TransportError, TimeoutError):
                    await self._call_in(c, Disconnect(peer.handle))
            return
        if self._pullers.get(peer.key) is c:
            del self._pullers[peer.key]
        await self._stop_child(c)

    async def _prepare(self, peer: UcxPeer, reads: ReadBatch) -> Child:
        """The peer's pulling child, connected, with the batch's destinations mapped.

        Nothing is read here, so a child found dead on the way (killed, or ended after
        a timeout, before its death was noticed) is replaced once and it is tried again."""
        for attempt in range(2):
            try:
                c = await self._puller(peer)
                await self._map_in(c, reads)
                return c
            except (TransportClosed, ProtocolError):
                raise
            except TransportError:
                current = self._pullers.get(peer.key)
                if attempt or (current is not None and not current.dead):
                    raise
        raise AssertionError("unreachable")

    async def _pull(self, peer: UcxPeer, reads: ReadBatch) -> None:
        who = peer.info.peer_id
        try:
            c = await self._prepare(peer, reads)
        except TimeoutError:
            raise PullFailed(
                f"pull from {who!r} failed: its data-plane process did not answer within "
                f"{self.request_timeout} s and was stopped",
                suspect_ranges(reads),
            ) from None
        except (TransportClosed, ProtocolError):
            raise
        except TransportError as exc:
            raise PullFailed(f"pull from {who!r} failed: {exc}", suspect_ranges(reads)) from exc
        deadline = time.monotonic_ns() + int(self.pull_timeout * 1e9)
        try:
            await self._call_in(
                c,
                Get(peer.handle, reads.tobytes(), deadline),
                batch=reads,
                peer_id=who,
                limit=self.pull_timeout + BACKSTOP_S,
            )
        except ChildTimedOut as exc:
            raise PeerLost(
                f"pull from {who!r} timed out after {self.pull_timeout} s ({exc}): the data-plane "
                "process reading from it was stopped; pulls from other peers were not affected",
                suspect_ranges(reads),
            ) from None
        except TimeoutError:
            raise PeerLost(
                f"pull from {who!r} timed out after {self.pull_timeout} s, and the data-plane "
                f"process reading from it did not give up within {BACKSTOP_S} s more: it was "
                "killed; pulls from other peers were not affected",
                suspect_ranges(reads),
            ) from None
        except ProtocolError as exc:
            raise ReadRefused(0, tuple(int(v) for v in reads[0].tolist()), str(exc)) from exc  # type: ignore[arg-type]
        except PullFailed:
            raise
        except TransportError as exc:
            raise PullFailed(f"pull from {who!r} failed: {exc}", suspect_ranges(reads)) from exc
        finally:
            c.last_used = time.monotonic()
