"""Filling a host mirror: from the holder the source's book assigns, failing over.

A mirror reads the chunks it lacks from its upstream, the holder the source's holder
book (:mod:`refitd.daemon.mirrorbook`) gives it: the source itself, or an upstream
relay whose feed (:mod:`refitd.daemon.mirrorfeed`) says which chunks it serves now.
Every read is a job of the daemon's one byte loop (:func:`refitd.daemon.mirrorread.fill_chunks`).

While it reads, the mirror reports its rate to the book (:meth:`Filler._watch`); it
leaves an upstream relay that fails, stops answering, or sends under half its peers'
rate (:class:`SlowRelay`), and the book gives it another; the chunks already here
stay, so the version is never restarted. The source is the last holder: if it fails,
the mirror fails, naming every holder it tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from refitd.client.leases import LeaseKeeper
from refitd.daemon.mirror import Mirror, covered
from refitd.daemon.mirrorfeed import HEARTBEAT_S, follow
from refitd.daemon.mirrorleases import OWNER
from refitd.daemon.mirrorread import Regranted, answer_s, fill_chunks
from refitd.daemon.move import one_error
from refitd.daemon.paths import SHM_SCHEME, TCP_SCHEME
from refitd.daemon.sources import RemoteSource
from refitd.errors import ProtocolError, RefitError, TransportError
from refitd.wire import DescriptorTable, PeerRegions, PullRequest
from refitd.wire import routes as api
from refitd.wire.leases import LeaseGrant
from refitd.wire.mirrors import MAX_EXCLUDE, HolderAssign, HolderJoin, MirrorLease

if TYPE_CHECKING:
    from refitd.daemon.node import Daemon
    from refitd.daemon.peerclient import PeerClient
    from refitd.daemon.pulls import PullManager

__all__ = ["LEASE_TTL_S", "Filler", "Reassigned", "SlowRelay", "describe"]

log = logging.getLogger("refitd.mirrors")

LEASE_TTL_S = 120.0
"""TTL of the leases a mirror holds while it fills (renewed at a third of it), s."""

REPORT_S = 0.5
"""How often a filling mirror reports its rate to the source's holder book, s."""

RATE_WINDOW_S = 1.0
"""A mirror's rate is the bytes it completed over about the last this many seconds."""

SLOW_AFTER_S = 1.0
"""A relay is judged slow only after it was read from this long, s."""

SLOW_FRACTION = 0.5
"""A relay sending under this fraction of its peers' rate (their median) is slow."""

SLOW_REPORTS = 2
"""Reports in a row (a second) a relay must be slow in before it is left: a host
that a busy core held up for a moment is not slow."""

MAX_SLOW_SWITCHES = 1
"""Relays one mirror leaves for being slow: a host whose own link is slow finds every
upstream slow, and must not walk the whole book."""


class Reassigned(TransportError):
    """The source's book gave this mirror another upstream (its own left the book)."""


class SlowRelay(TransportError):
    """An upstream relay sends under ``SLOW_FRACTION`` of its peers' rate."""


log = logging.getLogger("refitd.mirrors")


class Filler:
    """Fills the mirrors of daemon ``d``: ``pulls`` moves their bytes, ``self_url()``
    is the URL other daemons read this one at ("" none: the source is read directly),
    ``remote(url)`` the trusted peer daemon at ``url``; ``landed()`` is called after
    chunks were marked complete (reads held for them are answered)."""

    def __init__(
        self,
        d: Daemon,
        pulls: PullManager,
        self_url: Callable[[], str],
        remote: Callable[[str], RemoteSource],
        landed: Callable[[], None] = lambda: None,
    ) -> None:
        self.d = d
        self.pulls = pulls
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
        joined: asyncio.Task[str],
        prepared: asyncio.Task[PeerRegions | None],
    ) -> None:
        """Fill every chunk, from the holder the source assigns (first ``joined``, the
        answer to this mirror's first join), failing over (a relay that failed, stopped
        answering or was slow leaves the book; the chunks already here stay).

        ``prepared`` makes the mirror's regions and gives the source's records under
        ``lease_id`` (None: this daemon does not mirror it, and nothing is read). It
        runs while this starts: a relay's lease, feed and data path are opened while
        the regions are made, so the first read goes out as soon as they exist."""
        exclude: list[str] = []
        slow_checks = MAX_SLOW_SWITCHES
        sourced = False  # the source was tried: later tries fetch its records afresh
        while not m.tried or not m.done.all():
            upstream = await joined if not m.tried else await self.assign(src, m, exclude)
            m.upstream = upstream
            m.tried.append(upstream or m.source)
            try:
                with one_error():
                    async with asyncio.TaskGroup() as tg:
                        watch = tg.create_task(self._watch(m, src, upstream, slow_checks > 0))
                        if upstream:
                            await self._from_relay(m, upstream, lease_id, prepared)
                        elif (peer := await made(prepared)) is not None:
                            tried, sourced = sourced, True
                            await self._from_source(m, src, lease_id, None if tried else peer)
                        watch.cancel()
            except Reassigned as exc:
                log.info("%s", exc)
            except (RefitError, OSError, TimeoutError) as exc:
                slow_checks -= isinstance(exc, SlowRelay)
                what = f"{upstream or m.source}: {describe(exc)}"
                if not upstream:
                    m.error = (
                        f"mirror of {m.model!r} version {m.version} failed; holders tried, in "
                        f"order: {', '.join(m.tried)}; the source failed last: {what}"
                    )
                    raise TransportError(m.error) from exc
                log.warning("relay %s failed, reading the rest elsewhere: %s", upstream, what)
                exclude.append(upstream)
            if await made(prepared) is None:
                return  # not mirrored here (``m.error`` says why): nothing to read

    async def assign(self, src: RemoteSource, m: Mirror, exclude: list[str]) -> str:
        """The holder to read from, as the source's holder book assigns it ("" the
        source). A source that runs no holder book is read directly."""
        try:
            a = await self._join(src, m, exclude, 0.0)
        except RefitError as exc:
            log.info("no holder book at %s (%s): reading it directly", m.source, exc)
            return ""
        return "" if a is None else a.upstream.rstrip("/")

    async def _join(
        self, src: RemoteSource, m: Mirror, exclude: list[str], rate: float
    ) -> HolderAssign | None:
        """Join (or report ``rate``, bytes/s, to) the source's holder book; None when
        this daemon has no URL to be read at."""
        me = self.self_url()
        if not me:
            return None
        join = HolderJoin(m.model, m.version, me, self.d.node_id, exclude[-MAX_EXCLUDE:], rate)
        async with asyncio.timeout(answer_s(self.d.config.data_plane.pull_timeout_s)):
            return await src.client.join_holders(join.signed(self.d.secret))

    async def _watch(self, m: Mirror, src: RemoteSource, upstream: str, judge: bool) -> None:
        """While this mirror reads from ``upstream`` ("" the source): every
        ``REPORT_S`` report its rate to the source's book, and raise
        :class:`Reassigned` when its upstream left the book (another mirror found it
        failed or slow) and the book gives it another, or (``judge``) :class:`SlowRelay` when a relay sends it under
        ``SLOW_FRACTION`` of its peers' rate (their median; a relay's rate is shared
        by its children, so it is counted once per child) in ``SLOW_REPORTS``
        reports in a row. A mirror that itself left the book (another found it slow)
        and is put back by a report keeps reading from its upstream."""
        await m.ready.wait()  # a rate counts from when the regions exist
        loop = asyncio.get_running_loop()
        began = loop.time()
        samples = [(began, m.done_bytes())]
        me = self.self_url().rstrip("/")
        slow_reports = 0
        while True:
            await asyncio.sleep(REPORT_S)  # a timer: how often the source hears of us
            now, got = loop.time(), m.done_bytes()
            samples.append((now, got))
            while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
                samples.pop(0)
            rate = (got - samples[0][1]) / max(1e-6, now - samples[0][0])
            try:
                a = await self._join(src, m, [], rate)
            except (RefitError, TimeoutError):
                continue  # the book is advice: reading goes on
            if a is None:
                return
            held = {u.rstrip("/") for u in a.holders}
            if upstream and upstream not in held and a.upstream.rstrip("/") != upstream:
                raise Reassigned(
                    f"mirror of {m.model!r} version {m.version}: the source moved it from "
                    f"{upstream or m.source} to {a.upstream or m.source}"
                )
            if not (judge and upstream) or now - began < SLOW_AFTER_S:
                continue
            share = max(1, sum(1 for p in a.parents.values() if p.rstrip("/") == upstream))
            peers = sorted(
                r for u, r in a.rates.items() if u.rstrip("/") not in (me, upstream) and r > 0
            )
            slow_reports = (
                slow_reports + 1
                if peers and rate * share < SLOW_FRACTION * peers[len(peers) // 2]
                else 0
            )
            if slow_reports >= SLOW_REPORTS:
                raise SlowRelay(
                    f"it sends {rate * 8 / 1e6:.0f} Mbit/s, under {SLOW_FRACTION} of its "
                    f"peers' {peers[len(peers) // 2] * 8 / 1e6:.0f} Mbit/s"
                )

    async def _from_source(
        self, m: Mirror, src: RemoteSource, lease_id: str, peer: PeerRegions | None
    ) -> None:
        """Read every chunk this mirror lacks from the source, under the mirror's own
        lease there (its records, ``peer`` or fetched now, give the whole version)."""
        probe = PullRequest(m.model, m.version, lease_id, DescriptorTable.pack(_no_rows()), [], "")
        wait = self.d.config.data_plane.pull_timeout_s
        async with asyncio.timeout(wait):
            if peer is None:
                peer = await src.regions(sorted(m.regions), probe)
            path, conn = await self.pulls.open_path(src, peer)
        try:
            todo = np.flatnonzero(~m.done & covered(m.chunks, peer.scope))
            await fill_chunks(
                m, self.pulls, conn, path, todo, holder=m.source, lease_id=lease_id,
                owner=OWNER, their=None, pull_timeout_s=wait, landed=self.landed,
            )  # fmt: skip
        finally:
            if path == SHM_SCHEME:  # a transport's connection is shared: it stays open
                await conn.close()

    async def _from_relay(
        self,
        m: Mirror,
        url: str,
        source_lease: str,
        prepared: asyncio.Task[PeerRegions | None],
    ) -> None:
        """Read the chunks this mirror lacks from ``url``'s mirror, each as soon as it
        is complete there (its feed says so, with records that let us read it), until
        every chunk is here. Its lease there is a peer daemon's, granted under this
        mirror's live lease at the source, ``source_lease``. The lease, the feed and
        the data path are opened while ``prepared`` makes this mirror's regions; the
        reads wait for them (none when it gives None)."""
        relay = self._remote(url)
        c = relay.client
        timeout = self.d.config.data_plane.pull_timeout_s
        deadline = answer_s(timeout)
        await m.planned.wait()  # its chunks are cut (before its regions are made)
        ask = MirrorLease.fresh(m.model, m.version, source_lease, self.d.node_id, LEASE_TTL_S)
        asking = asyncio.ensure_future(c.send(api.MIRROR_LEASE, ask.signed(self.d.secret)))
        try:
            async with asyncio.timeout(deadline):  # a stopped relay answers nothing
                grant = await asyncio.shield(asking)
        except (asyncio.CancelledError, TimeoutError):
            # Stopped waiting (this mirror cannot be made here after all, or the relay
            # is slow): a lease the relay grants after that is released, not left to
            # run out its TTL there.
            asking.add_done_callback(lambda f: self._release_late(c, f))
            raise
        feed = Feed(self, m, relay, grant.lease_id)
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
                        todo = np.flatnonzero(~m.done)
                        await fill_chunks(
                            m, self.pulls, feed.conn, feed.path, todo, holder=url,
                            lease_id=grant.lease_id, owner=OWNER, their=feed.their,
                            pull_timeout_s=timeout, landed=self.landed,
                            ready=None if feed.ahead else feed.ready,
                        )  # fmt: skip
                        follower.cancel()
        except asyncio.CancelledError:
            if feed.conn is not None:  # left for another holder: no late byte lands
                feed.conn.cut()
            raise
        finally:
            if feed.conn is not None and feed.path == SHM_SCHEME:
                await feed.conn.close()
            with contextlib.suppress(RefitError, TimeoutError):
                async with asyncio.timeout(deadline):
                    await c.release_lease(grant.lease_id)

    def _release_late(self, c: PeerClient, asked: asyncio.Future[LeaseGrant]) -> None:
        """Release the lease ``asked`` was granted, if it was (in a task of its own,
        bounded by a relay's answer time)."""
        if asked.cancelled() or asked.exception() is not None:
            return
        lease_id = asked.result().lease_id

        async def release() -> None:
            with contextlib.suppress(RefitError, TimeoutError):
                async with asyncio.timeout(answer_s(self.d.config.data_plane.pull_timeout_s)):
                    await c.release_lease(lease_id)

        task = asyncio.get_running_loop().create_task(release())
        self._late.add(task)
        task.add_done_callback(self._late.discard)


class Feed:
    """What a downstream mirror knows of its upstream relay, from the upstream's feed:
    which chunks it serves now (``served``), through which connection (its grant
    widened with each frame's records), and how its regions map to the source's.

    Over ``tcp`` the grant is the whole version from the first frame on (``ahead``):
    the upstream's data server holds a read of a chunk not complete there until it is
    (:mod:`refitd.daemon.mirrorhold`), so the reads go out ahead of the chunks and
    each is answered as soon as its chunk lands upstream; the frames then only say the
    upstream still answers, or that its mirror failed."""

    def __init__(self, filler: Filler, m: Mirror, relay: RemoteSource, lease_id: str) -> None:
        self.filler = filler
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
            if self.path == TCP_SCHEME:  # its data server holds reads until complete
                conn = await pulls.regrant(self._whole(rec), self.path)
                self.ahead = True
            self.conn = Regranted(conn)
        elif self.ahead:
            pass  # the grant is the whole version already
        elif self.path == SHM_SCHEME:
            await self.conn.update(pulls.shm_credential(rec))
        else:
            self.conn.swap(await pulls.regrant(rec, self.path))
        back = {v: k for k, v in self.their.items()}
        scope = {back[int(k)]: v for k, v in rec.scope.items() if int(k) in back}
        self.served |= covered(self.m.chunks, scope)
        self.started.set()
        self._wake()

    def _whole(self, rec: PeerRegions) -> PeerRegions:
        """``rec`` (verified) with the whole version's scope: every chunk of the mirror,
        in the upstream's region ids. The grant a downstream reads ahead under; the
        upstream's data server still answers only complete bytes."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for s, o, n in self.m.chunks.tolist():
            ranges.setdefault(self.their[s], []).append((o, o + n))
        return msgspec.structs.replace(rec, scope={k: ranges.get(k, []) for k in rec.scope})

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


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within its deadline (stopped or partitioned)"
    return f"{type(exc).__name__}: {exc}"
