"""The ``ucx`` transport: one-sided UCX GETs from supervised data-plane processes.

The owner (this class, in the daemon's process) never loads UCX. It starts children
(`transports.ucx.worker`) that own the UCX contexts, and talks to each over a
socketpair. Records and batches are validated here before anything is sent, and
again in the child against its own records before anything is posted.
`transports.ucx.supervisor` is the mechanics of one child (start, request, stop);
this module is the policy: which children exist, and what a death costs;
`transports.ucx.pulling` is the pulling side of it (peers and their children).

Processes, and why there are several (isolation):

- **One serving child.** Its worker address and the remote keys of every local
  region are what `advertise` publishes; on the tcp path it answers peers' GETs
  (target-side progress). When it dies, a new one is started, every local region is
  registered in it again (new keys, new generations: re-advertise after `incarnation`
  changes, `on_restart` is called). A serving child that cannot start
  ``max_restarts`` times in a row closes the transport.
- **One pulling child per connected peer** (per ``peer_id`` and life of it:
  connections to the same serving process of a peer share it, a peer restarted under
  the same id gets a new one, so closing the old life's connection stops its child
  rather than closing endpoints to a dead peer where the new life's reads queue).
  Pulls sharing a connection each read under their own lease's record
  (`UcxPeer.scoped`). `UcxPeer.get` posts there, and nowhere else. A peer that
  hangs (its process stopped, its host unreachable) stalls only the child that reads
  from it, and on the ``cma`` path a peer that dies mid-read aborts only that child.
  Either way only the pulls in flight on that child fail (`PeerLost`, naming the
  peer and the suspect destination ranges); pulls from every other peer go on.
  A pulling child is not restarted eagerly: the next `get` on that peer starts a
  fresh one and connects it again. `UcxPeer.close` stops it once no connection uses
  it, and above ``max_peer_children`` live pulling children the least recently used
  idle one is stopped (it is started again, lazily, if its peer is read again).
  Measured on this project's 2-core test host (/proc/PID/status after a 64 MiB
  pull): a pulling child holds about 31 MiB of private (anonymous) memory, plus
  ~28 MiB of shared library pages and the destination segments it maps, which are
  the owner's shared memory, not copies; the serving child about 25 MiB private.
  The default bound of 16 thus costs at most about 0.5 GiB.

Registration: a local region is registered (mapped by name, ``ucp_mem_map``) once
in the serving child, whose key is advertised, and once per allocation in each
pulling child that writes into it, lazily, just before the first batch that writes
there. That costs one mapping per allocation per pulling child, the price of giving
each peer its own process; deregistering a region unmaps it in every child.

Deadlines: every batch carries one (``pull_timeout`` s from when it was handed to
the child; the C helper stops waiting then). A child that gives up a batch replies
"timeout" and exits, because GETs it posted may still land: only a dead process
cannot write into memory whose pull was already reported failed. If a child does not
answer by the deadline plus `BACKSTOP_S`, the owner kills it. Every other request to
a child (register, connect, stop) is bounded by ``request_timeout``; a child that
misses it is killed (the serving one is then restarted).

Regions must be named shared segments (`transports.segments.SharedSegment`): the
children map them by name, so bytes land directly in the owner's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Self

import numpy as np

from refitd.errors import NotFoundError, ProtocolError, TransportError

from ..batch import ReadBatch, suspect_ranges
from ..interface import (
    AdvertisedRegion,
    Capabilities,
    LocalRegion,
    MappedMemory,
    PeerInfo,
    PeerLost,
    TransportClosed,
    TransportOptions,
)
from .protocol import EXIT_TIMED_OUT, Deregister, Register, Reply, Request
from .pulling import PeerPulls, UcxPeer
from .supervisor import SERVING, Child, ChildTimedOut, start_child

__all__ = ["UcxTransport"]

log = logging.getLogger("refitd.dataplane")


class UcxTransport(PeerPulls):
    """UCX GETs through supervised children (see the module docstring).

    ``pull_timeout`` is the deadline of one batch (s). ``request_timeout`` bounds
    every other request to a child (s). ``max_peer_children`` bounds the live pulling
    children (least recently used idle ones are stopped above it). ``lanes`` UCX
    contexts+workers in each pulling child post a large batch's shares from that many
    threads (default: 2, or 1 on a 1-core host). Measured on 2 idle cores: 1 MiB
    pieces 7.7 -> 12-14 GB/s, shuffled 4 KiB 1.9 -> 3.2 GB/s; on 2 cores saturated by
    other work a second lane gains nothing, so set 1 there."""

    scheme = "ucx"
    #: 32 MiB pieces, so one large region keeps both batches busy
    capabilities = Capabilities(rdma=True)

    def __init__(
        self,
        *,
        secret: bytes,
        peer_id: str = "",
        pull_timeout: float = 120.0,
        request_timeout: float = 30.0,
        max_restarts: int = 5,
        max_peer_children: int = 16,
        on_restart: Callable[[int], None] | None = None,
        lanes: int | None = None,
    ) -> None:
        super().__init__(secret=secret, peer_id=peer_id)
        if pull_timeout <= 0 or request_timeout <= 0:
            raise ValueError("pull_timeout and request_timeout must be > 0 seconds")
        self.pull_timeout = pull_timeout
        self.request_timeout = request_timeout
        self.max_restarts = max_restarts
        self.max_peer_children = max(1, max_peer_children)
        self.on_restart = on_restart
        self.lanes = max(1, lanes if lanes is not None else min(2, os.cpu_count() or 1))
        self.incarnation = 0
        self.restarts = 0
        self._child: Child | None = None
        self._pullers: dict[str, Child] = {}  # peer key -> its pulling child
        self._puller_locks: dict[str, asyncio.Lock] = {}
        self._regions: dict[int, LocalRegion] = {}
        self._peers: dict[int, UcxPeer] = {}
        self._handles = itertools.count(1)
        self._generation = time.time_ns()
        self._lock = asyncio.Lock()  # serialises (re)starts of the serving child
        self._background: set[asyncio.Task[None]] = set()
        self._dying: set[Child] = set()  # retired pulling children not yet reaped
        self._closed = True

    @classmethod
    def from_options(cls, options: TransportOptions) -> Self:
        return cls(
            secret=options.secret, peer_id=options.peer_id, pull_timeout=options.pull_timeout
        )

    # -- child lifecycle

    async def start(self) -> None:
        self._closed = False
        async with self._lock:
            await self._spawn()

    async def _start_child(self, lanes: int, role: str, peer_id: str = "") -> Child:
        return await start_child(lanes, role, peer_id, self._child_exited)

    async def _spawn(self) -> None:
        """Start the serving child and register every local region in it."""
        c = await self._start_child(1, SERVING)  # it only serves: one lane
        self.incarnation += 1
        c.incarnation = self.incarnation
        self._child = c
        for rid, region in list(self._regions.items()):
            self._regions[rid] = await self._register_in(c, rid, region.segment)

    async def _child_exited(self, c: Child, code: int) -> None:
        if c.role == SERVING:
            await self._child_died(c, code)
        else:
            await self._puller_died(c, code)

    async def _child_died(self, c: Child, code: int) -> None:
        why = await c.why(code)
        if not self._closed and not c.stopping:
            log.warning("ucx data-plane process %d (serving) died (%s)", c.proc.pid, why)
        c.dead = True
        c.writer.close()
        for p in c.pending.values():
            if p.future.done():
                continue
            p.future.set_exception(
                TransportError(f"ucx data-plane process died ({why}) during a request")
            )
        c.pending.clear()
        if self._closed or self._child is not c:
            return
        self._child = None
        async with self._lock:
            if self._closed or self._child is not None:
                return
            for _ in range(self.max_restarts):
                try:
                    await self._spawn()
                    break
                except TransportError:
                    continue
            else:
                self._closed = True
                return
            self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(self.incarnation)

    async def _puller_died(self, c: Child, code: int) -> None:
        """Fail what was in flight on a pulling child; nothing else is touched. The
        next get on its peer starts a new one."""
        why = await c.why(code)
        if not self._closed and not c.stopping and code != EXIT_TIMED_OUT:
            log.warning(
                "ucx data-plane process %d (pulls from %r) died (%s)",
                c.proc.pid,
                c.peer_id,
                why,
            )
        c.dead = True
        c.writer.close()
        if self._pullers.get(c.role) is c:
            del self._pullers[c.role]
        self._dying.discard(c)
        for p in c.pending.values():
            if p.future.done():
                continue
            if p.batch is None:
                p.future.set_exception(
                    TransportError(
                        f"the ucx data-plane process pulling from {c.peer_id!r} died ({why}) "
                        "during a request"
                    )
                )
            elif c.stopping:
                p.future.set_exception(
                    PeerLost(
                        f"pull from {p.peer_id!r} failed: its connection was closed mid-pull",
                        suspect_ranges(p.batch),
                    )
                )
            else:
                p.future.set_exception(
                    PeerLost(
                        f"pull from {p.peer_id!r} failed: the data-plane process reading from it "
                        f"died ({why}), most likely because {p.peer_id!r} died or hung "
                        "mid-read; pulls from other peers were not affected",
                        suspect_ranges(p.batch),
                    )
                )
        c.pending.clear()

    async def _stop_child(self, c: Child) -> None:
        """Ask ``c`` to stop (bounded), kill it if it does not, and reap it."""
        await c.stop(self.request_timeout)

    async def close(self) -> None:
        if self._closed and self._child is None and not self._pullers:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            peer._closed = True
        self._peers.clear()
        async with self._lock:  # let a restart in progress finish, then stop its child
            c, self._child = self._child, None
        pullers = [*self._pullers.values(), *self._dying]
        self._pullers.clear()
        self._dying.clear()
        await asyncio.gather(*(self._stop_child(x) for x in [*pullers, *([c] if c else [])]))
        for task in list(self._background):
            task.cancel()
        self._regions.clear()

    @property
    def pid(self) -> int | None:
        """Process id of the current serving child (for supervision and tests)."""
        return self._child.proc.pid if self._child is not None else None

    @property
    def puller_pids(self) -> dict[str, int]:
        """Process id of each live pulling child, by peer id."""
        return {c.peer_id or key: c.proc.pid for key, c in self._pullers.items() if not c.dead}

    # -- requests

    async def _ready(self) -> Child:
        if self._closed:
            raise TransportClosed("ucx transport is closed")
        if self._child is None:
            async with self._lock:
                pass  # a restart in progress holds the lock
        if self._child is None:
            raise TransportClosed(
                "ucx transport is closed: its data-plane process could not be restarted"
            )
        return self._child

    async def _call_in(
        self,
        c: Child,
        body: Request,
        batch: ReadBatch | None = None,
        *,
        peer_id: str = "",
        limit: float | None = None,
    ) -> Reply:
        """Send ``body`` to ``c`` and wait for its reply, ``limit`` s at most (default
        ``request_timeout``). A child that misses it is killed, and TimeoutError raised;
        either way, or once it gave up a batch, it takes no new work."""
        limit = self.request_timeout if limit is None else limit
        try:
            return await c.call(body, batch, peer_id=peer_id, limit=limit)
        except (TimeoutError, ChildTimedOut):
            self._retire(c)  # killed, or exiting
            raise

    def _retire(self, c: Child) -> None:
        """A pulling child that was killed or is exiting takes no new work: the next
        get on its peer starts another, even before its death is noticed."""
        if c.role != SERVING and self._pullers.get(c.role) is c:
            del self._pullers[c.role]
            self._dying.add(c)

    async def _call(self, body: Request) -> Reply:
        try:
            return await self._call_in(await self._ready(), body)
        except TimeoutError:
            raise TransportError(
                f"the ucx data-plane process did not answer a {type(body).__name__.lower()} "
                f"request within {self.request_timeout} s: it was killed and is restarting"
            ) from None

    # -- regions

    async def _register_in(self, c: Child, region_id: int, segment: MappedMemory) -> LocalRegion:
        try:
            reply = await self._call_in(c, Register(region_id, segment.name, segment.size))
        except TimeoutError:
            raise TransportError(
                f"registering region {region_id} timed out after {self.request_timeout} s: the "
                "serving data-plane process was killed and is restarting"
            ) from None
        self._generation += 1
        info = AdvertisedRegion(
            region_id=region_id,
            generation=self._generation,
            address=reply.address,
            size=segment.size,
            key=reply.rkey,
        )
        return LocalRegion(region_id, segment, info)

    async def register(self, region_id: int, segment: MappedMemory) -> LocalRegion:
        region = await self._register_in(await self._ready(), region_id, segment)
        self._regions[region_id] = region
        for c in self._pullers.values():
            c.registered.pop(region_id, None)  # a new segment under an old id: map again
        return region

    async def deregister(self, region_id: int) -> None:
        if region_id not in self._regions:
            raise NotFoundError(f"deregistering region {region_id} refused: not registered")
        del self._regions[region_id]
        # Pulling children unmap it in order, after the batches already queued there
        # (none writes into it: the daemon deregisters only regions no pull uses).
        # Not awaited: a child stalled on a hung peer must not hold this up.
        for c in list(self._pullers.values()):
            if c.registered.pop(region_id, None) is not None and not c.dead:
                self._forget(c.send(Deregister(region_id)))
        await self._call(Deregister(region_id))

    def _forget(self, fut: asyncio.Future[Reply]) -> None:
        async def consume() -> None:
            with contextlib.suppress(Exception):
                await fut

        task = asyncio.create_task(consume())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _map_in(self, c: Child, reads: ReadBatch) -> None:
        """Register in pulling child ``c`` the local regions ``reads`` writes that it
        does not have mapped yet."""
        lr = reads["local_region"]
        first = int(lr[0])
        ids = [first] if bool((lr == first).all()) else np.unique(lr).tolist()  # usually one
        for rid in ids:
            region = self._regions.get(rid)
            if region is None:  # deregistered since the batch was validated
                raise ProtocolError(f"pull refused: local region {rid} is not registered")
            name = region.segment.name
            if c.registered.get(rid) == name:
                continue
            c.registered[rid] = name  # later batches queue behind this registration
            try:
                await self._call_in(c, Register(rid, name, region.segment.size, pack=False))
            except BaseException:
                if c.registered.get(rid) == name:
                    del c.registered[rid]
                raise

    @property
    def regions(self) -> dict[int, LocalRegion]:
        return dict(self._regions)

    async def wait_ready(self) -> None:
        """Return once the serving process is up (after a restart, its regions too)."""
        await self._ready()

    def advertise(self) -> PeerInfo:
        if self._child is None:
            raise TransportError(
                "advertise refused: the ucx data-plane process is restarting or closed; await wait_ready()"
            )
        return PeerInfo(
            scheme=self.scheme,
            peer_id=self.peer_id,
            address=self._child.address,
            regions=tuple(r.info for r in self._regions.values()),
        ).signed(self.secret)
