"""Reading a host mirror's chunks from one holder: the source, or another host's
mirror (a relay), with the leases, feed and data path that takes.

:class:`Filler` runs a mirror's fill (:class:`~refitd.daemon.mirror.swarm.Swarm`
reads from every holder the source's book deals chunks to at once); its
:meth:`Filler.from_source` and :meth:`Filler.from_relay` read one holder's share.
A relay is read under a peer daemon's lease of its own registry, its feed
(:mod:`refitd.daemon.mirror.feed`) saying which chunks it serves now; over ``tcp`` the
reads go out ahead and its data server answers each once its chunk is complete
there (a transport that holds reads, :class:`~transports.interface.Capabilities`). Every read is a job of the daemon's one byte loop
(:func:`refitd.daemon.mirror.read.fill_chunks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from refitd.client.leases import LeaseKeeper
from refitd.daemon.mirror.chunks import Mirror, covered
from refitd.daemon.mirror.feed import HEARTBEAT_S, follow
from refitd.daemon.mirror.judge import describe
from refitd.daemon.mirror.leases import OWNER
from refitd.daemon.mirror.read import FILL_IN_FLIGHT_BYTES, Regranted, answer_s, fill_chunks
from refitd.daemon.mirror.swarm import Swarm, report_done
from refitd.daemon.pull.move import one_error
from refitd.daemon.pull.sources import RemoteSource
from refitd.errors import ProtocolError, RefitError, TransportError
from refitd.wire import PeerRegions
from refitd.wire import routes as api
from refitd.wire.leases import LeaseInfo
from refitd.wire.mirrors import MAX_DEAL_CHUNKS, MAX_EXCLUDE, HolderAssign, HolderJoin, MirrorLease

if TYPE_CHECKING:
    from refitd.daemon.pull.peerclient import PeerClient
    from refitd.daemon.pull.pulls import PullManager
    from refitd.daemon.state.store import RegionStore

__all__ = ["LEASE_TTL_S", "Filler", "describe"]

log = logging.getLogger("refitd.mirrors")

LEASE_TTL_S = 120.0
"""TTL of the leases a mirror holds while it fills (renewed at a third of it), s."""


class Filler:
    """Fills a daemon's mirrors: ``pulls`` moves their bytes (its byte loop, paths and
    list of pulls), ``store`` holds the regions they land in (checked against their
    digests there); ``node_id`` and ``secret`` name and sign this daemon to the
    holders (its joins and lease requests), ``pull_timeout_s`` bounds a read of the
    source (and, cut to a relay's answer time, of a relay). ``self_url()`` is the URL
    other daemons read this one at ("" none: the source is read directly),
    ``remote(url)`` the trusted peer daemon at ``url``; ``landed()`` is called after
    chunks were marked complete (reads held for them are answered)."""

    def __init__(
        self,
        pulls: PullManager,
        *,
        node_id: str,
        secret: bytes,
        pull_timeout_s: float,
        store: RegionStore,
        self_url: Callable[[], str],
        remote: Callable[[str], RemoteSource],
        landed: Callable[[], None] = lambda: None,
    ) -> None:
        self.pulls = pulls
        self.node_id = node_id
        self.secret = secret
        self.pull_timeout_s = pull_timeout_s
        self.store = store
        self.self_url = self_url
        self._remote = remote
        self.landed = landed
        #: releases of leases granted after their mirror stopped waiting for them
        self._late: set[asyncio.Task[None]] = set()

    async def fill(
        self,
        m: Mirror,
        src: RemoteSource,
        lease_id: str,
        joined: asyncio.Task[HolderAssign | None],
        prepared: asyncio.Task[PeerRegions | None],
    ) -> None:
        """Fill every chunk from the holders the source's book deals them to (first
        ``joined``, the answer to this mirror's first join), all at once, failing over
        (:class:`~refitd.daemon.mirror.swarm.Swarm`); the chunks already here stay.

        ``prepared`` makes the mirror's regions and gives the source's records under
        ``lease_id`` (None: this daemon does not mirror it, and nothing is read). It
        runs while this starts: each holder's lease, feed and data path are opened
        while the regions are made, so the first reads go out as soon as they exist."""
        began = asyncio.get_running_loop().time()
        try:
            await Swarm(self, m, src, lease_id, prepared).run(await joined)
        except (RefitError, OSError, TimeoutError) as exc:
            m.error = (
                f"mirror of {m.model!r} version {m.version} failed; holders read from, in "
                f"order: {', '.join(m.tried)}; the source failed: {describe(exc)}"
            )
            raise TransportError(m.error) from exc
        if await made(prepared) is not None:
            await report_done(self, src, m, asyncio.get_running_loop().time() - began)

    async def assign(self, src: RemoteSource, m: Mirror, exclude: list[str]) -> HolderAssign | None:
        """The source's holder book's deal of ``m``'s version (None: read the source
        for every chunk: it runs no holder book, or this daemon has no URL)."""
        try:
            return await self.join(src, m, exclude, 0.0)
        except RefitError as exc:
            log.info("no holder book at %s (%s): reading it directly", m.source, exc)
            return None

    async def join(
        self,
        src: RemoteSource,
        m: Mirror,
        exclude: list[str],
        rate: float,
        done: bool = False,
        shun: list[str] | None = None,
    ) -> HolderAssign | None:
        """Join (or report ``rate``, bytes/s, and the chunks complete here to) the
        source's holder book, naming the holders it left (``exclude``; ``shun``:
        those of them found slow or sending wrong bytes); None when this daemon has
        no URL to be read at."""
        me = self.self_url()
        if not me:
            return None
        have = np.packbits(m.done).tobytes() if m.planned.is_set() else b""
        join = HolderJoin(
            m.model, m.version, me, self.node_id, exclude[-MAX_EXCLUDE:], rate, done,
            have[: MAX_DEAL_CHUNKS // 8], (shun or [])[-MAX_EXCLUDE:],
        )  # fmt: skip
        async with asyncio.timeout(answer_s(self.pull_timeout_s)):
            return await src.client.join_holders(join.signed(self.secret))

    async def from_source(
        self,
        m: Mirror,
        src: RemoteSource,
        lease_id: str,
        prepared: asyncio.Task[PeerRegions | None],
        todo: np.ndarray,
        in_flight_bytes: int = FILL_IN_FLIGHT_BYTES,
    ) -> None:
        """Read chunks ``todo`` of ``m`` from the source, under the mirror's own lease
        there (the records it was prepared with give the whole version), with at most
        ``in_flight_bytes`` asked at once."""
        peer = await made(prepared)
        if peer is None:
            return  # not mirrored here: nothing to read
        wait = self.pull_timeout_s
        async with asyncio.timeout(wait):
            path, conn = await self.pulls.open_path(src, peer)
        try:
            todo = todo[~m.done[todo] & covered(m.chunks[todo], peer.scope)]
            await fill_chunks(
                m, self.pulls, conn, path, todo, holder=m.source, lease_id=lease_id,
                owner=OWNER, their=None, pull_timeout_s=wait, landed=self.landed,
                in_flight_bytes=in_flight_bytes,
            )  # fmt: skip
        finally:
            if self.pulls.owns(path):  # a shared connection stays open
                await conn.close()

    async def from_relay(
        self,
        m: Mirror,
        url: str,
        source_lease: str,
        prepared: asyncio.Task[PeerRegions | None],
        todo: np.ndarray,
        check: Callable[[np.ndarray], Awaitable[None]],
        progressed: Callable[[], None],
    ) -> None:
        """Read chunks ``todo`` of ``m`` from ``url``'s mirror, each as soon as it is
        complete there (over ``tcp`` the read waits there for it; else its feed says
        so, with records that let us read it); ``check(chunks)`` checks each batch's
        bytes before its chunks are marked complete (their digests at the source);
        ``progressed()`` is called whenever the relay's feed says its own fill moved
        on (its regions made, more of its chunks complete).
        Its lease there is a peer daemon's, granted under this mirror's live lease at
        the source, ``source_lease``. The lease, the feed and
        the data path are opened while ``prepared`` makes this mirror's regions; the
        reads wait for them (none when it gives None)."""
        relay = self._remote(url)
        c = relay.client
        timeout = self.pull_timeout_s
        deadline = answer_s(timeout)
        await m.planned.wait()  # its chunks are cut (before its regions are made)
        ask = MirrorLease.fresh(m.model, m.version, source_lease, self.node_id, LEASE_TTL_S)
        asking = asyncio.ensure_future(c.send(api.MIRROR_LEASE, ask.signed(self.secret)))
        try:
            async with asyncio.timeout(deadline):  # a stopped relay answers nothing
                grant = await asyncio.shield(asking)
        except (asyncio.CancelledError, TimeoutError):
            # Stopped waiting (this mirror cannot be made here after all, or the relay
            # is slow): a lease the relay grants after that is released, not left to
            # run out its TTL there.
            asking.add_done_callback(lambda f: self._release_late(c, f))
            raise
        feed = Feed(self, m, relay, grant.lease_id, progressed)
        try:
            async with LeaseKeeper(c, grant, LEASE_TTL_S):  # re-checked at the source
                with one_error():
                    async with asyncio.TaskGroup() as tg:
                        follower = tg.create_task(feed.read(deadline + HEARTBEAT_S))
                        await feed.started.wait()
                        if feed.conn is None:  # it failed first: its error ends the group
                            await follower
                            raise TransportError("its feed ended before its first frame")
                        if await made(prepared) is None:
                            return  # not mirrored here: nothing to read
                        todo = todo[~m.done[todo]]
                        await fill_chunks(
                            m, self.pulls, feed.conn, feed.path, todo, holder=url,
                            lease_id=grant.lease_id, owner=OWNER, their=feed.their,
                            pull_timeout_s=timeout, landed=self.landed,
                            ready=None if feed.ahead else feed.ready, check=check,
                        )  # fmt: skip
                        follower.cancel()
        except BaseException:
            if feed.conn is not None:  # left for another holder: no late byte lands
                feed.conn.cut()
            raise
        finally:
            if feed.conn is not None and self.pulls.owns(feed.path):
                await feed.conn.close()
            with contextlib.suppress(RefitError, TimeoutError):
                async with asyncio.timeout(deadline):
                    await c.release_lease(grant.lease_id)

    def _release_late(self, c: PeerClient, asked: asyncio.Future[LeaseInfo]) -> None:
        """Release the lease ``asked`` was granted, if it was (in a task of its own,
        bounded by a relay's answer time)."""
        if asked.cancelled() or asked.exception() is not None:
            return
        lease_id = asked.result().lease_id

        async def release() -> None:
            with contextlib.suppress(RefitError, TimeoutError):
                async with asyncio.timeout(answer_s(self.pull_timeout_s)):
                    await c.release_lease(lease_id)

        task = asyncio.get_running_loop().create_task(release())
        self._late.add(task)
        task.add_done_callback(self._late.discard)


class Feed:
    """What a downstream mirror knows of its upstream relay, from the upstream's feed:
    which chunks it serves now (``served``), through which connection (its grant
    widened with each frame's records), and how its regions map to the source's.

    Over ``tcp`` the upstream grants the whole version from the first frame on
    (``ahead``): its data server holds a read of a chunk not complete there until it is
    (:mod:`refitd.daemon.mirror.hold`), so the reads go out ahead of the chunks and
    each is answered as soon as its chunk lands upstream; the frames then only say the
    upstream still answers, or that its mirror failed."""

    def __init__(
        self,
        filler: Filler,
        m: Mirror,
        relay: RemoteSource,
        lease_id: str,
        progressed: Callable[[], None],
    ) -> None:
        self.filler = filler
        self.progressed = progressed
        self.m = m
        self.relay = relay
        self.lease_id = lease_id
        self.served = np.zeros(len(m.chunks), dtype=bool)
        self.their: dict[int, int] = {}
        self.path = ""
        self.conn: Regranted | None = None
        #: reads go out ahead of the upstream's chunks (held there until complete)
        self.ahead = False
        self.started = asyncio.Event()
        self.error: BaseException | None = None
        self._tick = asyncio.Event()

    async def read(self, frame_s: float) -> None:
        """Read the feed until the upstream's mirror is complete (or this task is
        cancelled); a frame late, a failed mirror, a broken stream fail it."""
        m = self.m
        made, done = False, 0
        try:
            async for frame in follow(
                self.relay.client, m.model, m.version, self.lease_id, frame_s
            ):
                if frame.error:
                    raise TransportError(f"its mirror failed: {frame.error}")
                # Checked against the layout planned here, not the regions made so
                # far (the feed is read while they are made); a frame from a relay
                # still making its own names none.
                if frame.source.rstrip("/") != m.source or (
                    frame.regions and set(frame.regions) != m.layout
                ):
                    raise TransportError(
                        f"its mirror is of another source or layout: source "
                        f"{frame.source}, regions {sorted(frame.regions)}; this mirror's "
                        f"{m.source}, regions {sorted(m.layout)}"
                    )
                if (frame.regions and not made) or min(frame.chunks_done, len(m.chunks)) > done:
                    self.progressed()  # its own fill moved on: not late for what it lacked
                made = made or bool(frame.regions)
                done = max(done, min(frame.chunks_done, len(m.chunks)))
                rec = frame.records
                if rec is None:
                    continue
                rec.verify(self.relay.secret)
                if rec.lease_id != self.lease_id:
                    raise ProtocolError("its feed's records were given under another lease")
                await self._regrant(frame.regions, rec)
        except BaseException as exc:
            self.error = exc
            self._wake()
            raise

    async def _regrant(self, regions: dict[int, int], rec: PeerRegions) -> None:
        pulls = self.filler.pulls
        if self.conn is None:
            self.their = dict(regions)
            self.path, conn = await pulls.open_path(self.relay, rec)
            # Its data server holds reads until complete, and the relay granted the
            # whole version on it (Leases.version_scope): read ahead of its chunks.
            self.ahead = pulls.plane.caps(self.path).holds_reads
            self.conn = Regranted(conn)
        elif self.ahead:
            pass  # the grant is the whole version already
        else:
            self.conn.swap(await pulls.regrant(rec, self.path, self.conn.current))
        back = {v: k for k, v in self.their.items()}
        scope = {back[int(k)]: v for k, v in rec.scope.items() if int(k) in back}
        self.served |= covered(self.m.chunks, scope)
        self.started.set()
        self._wake()

    def _wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()
        self.started.set()

    async def ready(self, chunks: np.ndarray) -> None:
        """Return once the upstream serves every chunk of ``chunks``."""
        while not bool(self.served[chunks].all()):
            if self.error is not None:
                raise TransportError(f"its feed ended: {describe(self.error)}")
            await self._tick.wait()


async def made(prepared: asyncio.Task[PeerRegions | None]) -> PeerRegions | None:
    """What ``prepared`` gave: the source's records once the mirror's regions exist,
    None when it does not mirror the version or failed (its failure is the mirror's,
    reported by whoever runs it, :meth:`Mirrors._run`). Waiting for it never cancels
    it."""
    try:
        return await asyncio.shield(prepared)
    except asyncio.CancelledError:
        if prepared.cancelled() and not _cancelling():
            return None
        raise
    except Exception:
        return None


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _no_rows() -> np.ndarray:
    return np.zeros((0, 5), dtype=np.int64)
