"""Filling a host mirror from every holder at once, as the source's book deals it.

The source's holder book (:mod:`refitd.daemon.mirror.book`) deals each chunk of a
version to a seeder. A mirror reads the chunks dealt to itself from the source, and
the chunks dealt to each other seeder from that seeder, all at once: one reader per
holder (:meth:`Holders.from_source`, :meth:`Holders.from_relay`), so the host's
downlink is fed by every seeder's uplink.

What goes wrong, and what is done (:class:`Swarm`):

- a holder that fails, stops answering (its reads and its feed have deadlines) or
  whose mirror failed: its reader ends with that error; the mirror names it to the
  book (``exclude``), which deals its chunks again, and reads the chunks it still
  lacks of that holder from where the new deal says. The chunks already here stay;
  the other readers go on;
- a holder that is late or slow (:mod:`refitd.daemon.mirror.judge` says which) or
  sends chunks that differ from their digests at the source (:class:`WrongBytes`):
  left the same way, and named to the book as one not to deal the next version to
  (``shun``, slow or wrong bytes only);
- a holder another mirror had the book drop: this mirror's report hears of it, and
  reads that holder's chunks from where the new deal says;
- the source fails: the mirror fails, naming every holder it read from.

A chunk is marked complete only once the read that filled it returned; its count is
``Mirror.reads`` of its holder, and a chunk asked again of another holder after its
own failed or was slow is counted in ``Mirror.reasked``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.digest import verify_mirror
from refitd.daemon.mirror.judge import Judge, LateHolder, SlowRelay, describe
from refitd.daemon.mirror.read import BATCH_CHUNKS, FILL_IN_FLIGHT_BYTES
from refitd.errors import RefitError, TransportError
from refitd.wire import ChunkDigests, PeerRegions
from refitd.wire.mirrors import FROM_SOURCE, HolderAssign

if TYPE_CHECKING:
    from refitd.daemon.pull.sources import RemoteSource
    from refitd.daemon.state.store import RegionStore

__all__ = [
    "REPORT_S",
    "SEED_IN_FLIGHT_CHUNKS",
    "TICK_S",
    "LateHolder",
    "SlowRelay",
    "Swarm",
    "WrongBytes",
    "holders_of",
]

log = logging.getLogger("refitd.mirrors")

REPORT_S = 0.5
"""How often a filling mirror reports its rate and its complete chunks to the
source's holder book, s."""

SEED_IN_FLIGHT_CHUNKS = 4
"""Chunks a seeder asks of the source at once (see :meth:`Swarm._source_window`)."""

TICK_S = 0.1
"""How often a filling mirror looks for late holders, s."""


class Holders(Protocol):
    """What a swarm fill uses of the daemon's mirror filler
    (:class:`refitd.daemon.mirror.fill.Filler`): read one holder's share, and talk
    to the source's holder book; ``store`` holds the regions the chunks land in."""

    store: RegionStore

    def self_url(self) -> str: ...

    async def from_source(
        self,
        m: Mirror,
        src: RemoteSource,
        lease_id: str,
        prepared: asyncio.Task[PeerRegions | None],
        todo: np.ndarray,
        in_flight_bytes: int = ...,
    ) -> None: ...

    async def from_relay(
        self,
        m: Mirror,
        url: str,
        source_lease: str,
        prepared: asyncio.Task[PeerRegions | None],
        todo: np.ndarray,
        check: Callable[[np.ndarray], Awaitable[None]],
        progressed: Callable[[], None],
    ) -> None: ...

    async def join(
        self,
        src: RemoteSource,
        m: Mirror,
        exclude: list[str],
        rate: float,
        done: bool = False,
        shun: list[str] | None = None,
    ) -> HolderAssign | None: ...


class WrongBytes(TransportError):
    """Chunks read from a holder differ from their digests at the source."""


class _Dropped(Exception):
    """The book no longer lists holders this mirror reads from: ``answer`` is its deal."""

    def __init__(self, answer: HolderAssign) -> None:
        super().__init__("holders left the book")
        self.answer = answer


def holders_of(m: Mirror, a: HolderAssign | None, me: str, excluded: set[str]) -> list[str]:
    """Per chunk of ``m``, the holder to read it from as the deal ``a`` says (``""``:
    the source): its seeder, unless that is this mirror (``me``), left the book or
    was excluded here. Everything from the source without a deal, or with one that
    does not cut the version as this mirror does."""
    n = len(m.chunks)
    if a is None or len(a.deal) != n:
        if a is not None and a.deal:
            log.warning(
                "the holder book dealt %d chunks of %r version %d, this mirror cut %d: "
                "reading the source",
                len(a.deal), m.model, m.version, n,
            )  # fmt: skip
        return [""] * n
    names = [s.rstrip("/") for s in a.seeders]
    listed = {h.rstrip("/") for h in a.holders}
    usable = [s if s and s != me and s in listed and s not in excluded else "" for s in names]
    table = np.array([*usable, ""] if usable else [""], dtype=object)
    idx = np.frombuffer(a.deal, dtype=np.uint8).astype(np.int64)
    idx = np.where((idx == FROM_SOURCE) | (idx >= len(usable)), len(table) - 1, idx)
    return list(table[idx])


class Swarm:
    """One mirror's fill: a reader per holder, re-planned when one fails."""

    def __init__(
        self,
        filler: Holders,
        m: Mirror,
        src: RemoteSource,
        lease_id: str,
        prepared: asyncio.Task[PeerRegions | None],
    ) -> None:
        self.f = filler
        self.m = m
        self.src = src
        self.lease_id = lease_id
        self.prepared = prepared
        self.me = filler.self_url().rstrip("/")
        self.excluded: set[str] = set()
        self.judge = Judge(m.source, BATCH_CHUNKS << 20)  # sized once the chunks are cut
        #: of them, the ones found slow or sending wrong bytes
        self.shunned: set[str] = set()
        #: chunks a running reader is reading (sized once the chunks are cut)
        self.busy = np.zeros(0, dtype=bool)
        self.readers: dict[asyncio.Task[None], tuple[str, np.ndarray]] = {}
        #: the chunks' digests at the source, fetched once a holder is read
        self.digests: asyncio.Future[ChunkDigests] | None = None
        #: seeders the deal names (the source's reads are paced when more than one)
        self.seeders = 0

    async def run(self, answer: HolderAssign | None) -> None:
        m = self.m
        planned = asyncio.ensure_future(m.planned.wait())
        try:
            await asyncio.wait([planned, self.prepared], return_when=asyncio.FIRST_COMPLETED)
        finally:
            planned.cancel()
        if not m.planned.is_set():
            return  # not mirrored here (``m.error`` says why), or it failed: nothing to read
        self.busy = np.zeros(len(m.chunks), dtype=bool)
        self.judge = Judge(m.source, BATCH_CHUNKS * int(m.chunks[:, 2].max(initial=1)))
        watch: asyncio.Task[None] | None = None
        watching = True  # a watch that ended on its own (no book to report to) is not redone
        try:
            while True:
                self.seeders = sum(1 for s in answer.seeders if s) if answer else 0
                self._start(holders_of(m, answer, self.me, self.excluded))
                if not self.readers:
                    if bool(m.done.all()):
                        return
                    raise TransportError("no holder left to read the missing chunks from")
                if watching and (watch is None or watch.done()):
                    watch = asyncio.create_task(self._watch(answer))
                finished, _ = await asyncio.wait(
                    [*self.readers, *([watch] if watch is not None else [])],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                new: HolderAssign | None = None
                for t in finished:
                    if t is watch:
                        watching = t.exception() is not None
                        new = await self._heard(t) or new
                        watch = None
                        continue
                    url, todo = self.readers.pop(t)
                    self.busy[todo] = False
                    exc = t.exception()
                    if exc is None:
                        continue
                    if not url:
                        raise exc
                    left = int((~m.done[todo]).sum())
                    new = await self._leave(url, left, exc) or new
                if new is not None:
                    answer = new
        finally:
            for t in [*self.readers, *([watch] if watch is not None else [])]:
                t.cancel()
            await asyncio.gather(*self.readers, *([watch] if watch else []), return_exceptions=True)
            self.readers.clear()
            if self.digests is not None:
                self.digests.cancel()

    async def check(self, idx: np.ndarray) -> None:
        """Raise :class:`WrongBytes` unless chunks ``idx`` here (read from a holder
        that is not the source, not marked complete yet) match their digests at the
        source. Digests the source will not give fail the read the same way: a
        holder's bytes are never taken unchecked."""
        m = self.m
        assert self.digests is not None  # started with the first holder's reader
        expected = await asyncio.shield(self.digests)
        bad = await verify_mirror(self.f.store, m, expected, idx)
        if len(bad):
            raise WrongBytes(
                f"{len(bad)} chunk(s) read from it differ from their digests at the "
                f"source (chunks {bad[:8].tolist()}); nothing of them was marked complete"
            )

    def _source_window(self, holders: list[str]) -> int:
        """Bytes a read of the source keeps in flight. Alone, the pull's window keeps
        the link busy. Seeding (other holders read this mirror's share from it): one
        chunk's worth per lane, so the chunks land here one after another, each
        forwarded as it lands, rather than a window's worth at once at the end."""
        seeding = any(h for h in holders) or self.seeders > 1
        size = int(self.m.chunks[:, 2].max(initial=1))
        return SEED_IN_FLIGHT_CHUNKS * size if seeding else FILL_IN_FLIGHT_BYTES

    def _start(self, holders: list[str]) -> None:
        """A reader for each holder of the chunks not complete and not being read."""
        m = self.m
        todo = np.flatnonzero(~m.done & ~self.busy)
        by: dict[str, list[int]] = {}
        for i in todo.tolist():
            by.setdefault(holders[i], []).append(i)
        for url, chunks in sorted(by.items(), key=lambda kv: kv[0] != ""):
            idx = np.array(chunks, dtype=np.int64)
            self.busy[idx] = True
            if url and self.digests is None:  # fetched while the first chunks cross
                self.digests = asyncio.ensure_future(
                    self.src.client.chunk_digests(m.model, m.version, self.lease_id)
                )
                self.digests.add_done_callback(_seen)
            name = url or m.source
            if name not in m.tried:
                m.tried.append(name)
            m.upstream = url
            coro = (
                self.f.from_relay(
                    m, url, self.lease_id, self.prepared, idx, self.check, self._moved(url)
                )
                if url
                else self.f.from_source(
                    m, self.src, self.lease_id, self.prepared, idx, self._source_window(holders)
                )
            )
            self.readers[asyncio.create_task(coro)] = (url, idx)
            self.judge.reading(url or m.source, asyncio.get_running_loop().time(), relay=bool(url))

    def _moved(self, url: str) -> Callable[[], None]:
        """What relay ``url``'s feed calls when the relay's own fill moved on."""
        loop = asyncio.get_running_loop()
        return lambda: self.judge.progressed(url, loop.time())

    async def _leave(self, url: str, left: int, exc: BaseException) -> HolderAssign | None:
        """``url`` failed (``exc``) with ``left`` chunks of its share not here: name
        it to the book, and read them where its new deal says."""
        self.m.reasked += left
        log.warning(
            "holder %s failed, reading its %d chunks left elsewhere: %s", url, left, describe(exc)
        )
        self.excluded.add(url)
        if isinstance(exc, SlowRelay | WrongBytes):
            self.shunned.add(url)
        return await self._ask()

    async def _heard(self, watch: asyncio.Task[None]) -> HolderAssign | None:
        """What the watch ended with: a holder found slow (left), or holders the book
        dropped (their readers stopped; their chunks read where the deal says)."""
        exc = watch.exception()
        if isinstance(exc, SlowRelay | LateHolder):
            left = await self._stopped(lambda url: url == exc.url)
            return await self._leave(exc.url, left, exc)
        if isinstance(exc, _Dropped):
            listed = {h.rstrip("/") for h in exc.answer.holders}
            self.m.reasked += await self._stopped(lambda url: bool(url) and url not in listed)
            return exc.answer
        if exc is not None:
            raise exc
        return None

    async def _stopped(self, which: Callable[[str], bool]) -> int:
        """Cancel the readers of the holders ``which(url)`` selects; the number of
        their chunks not complete (read again elsewhere)."""
        gone = {t: v for t, v in self.readers.items() if which(v[0])}
        for t in gone:
            t.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        left = 0
        for t, (_, todo) in gone.items():
            del self.readers[t]
            self.busy[todo] = False
            left += int((~self.m.done[todo]).sum())
        return left

    async def _ask(self) -> HolderAssign | None:
        try:
            return await self.f.join(
                self.src, self.m, sorted(self.excluded), 0.0, shun=sorted(self.shunned)
            )
        except (RefitError, TimeoutError) as exc:
            log.info("the holder book at %s did not answer (%s)", self.m.source, exc)
            return None

    async def _watch(self, answer: HolderAssign | None) -> None:
        """Every ``TICK_S``, look for a late holder; every ``REPORT_S``, report this
        mirror's rate and complete chunks to the book. End with :class:`_Dropped`
        when a holder read from here left the book, or with the verdict of
        :class:`~refitd.daemon.mirror.judge.Judge` (late, slow) on one."""
        m = self.m
        await m.ready.wait()
        loop = asyncio.get_running_loop()
        judge = self.judge
        judge.receiving(loop.time())  # no chunk landed before: the holders waited on us
        judge.report(loop.time(), m.done_bytes(), m.reads)
        reported = loop.time()
        while True:
            await asyncio.sleep(TICK_S)
            pending = self._pending()
            if (late := judge.late(loop.time(), m.reads, pending)) is not None:
                raise late
            if loop.time() - reported < REPORT_S:
                continue
            now = reported = loop.time()
            rate = judge.report(now, m.done_bytes(), m.reads)
            try:
                a = await self.f.join(self.src, m, [], rate)
            except (RefitError, TimeoutError):
                continue  # the book is advice: reading goes on
            if a is None:
                return
            listed = {h.rstrip("/") for h in a.holders}
            if {u for u, _ in self.readers.values() if u} - listed:
                raise _Dropped(a)
            peers = [r for u, r in a.rates.items() if u.rstrip("/") != self.me]
            size = int(m.chunks[:, 2].max(initial=1))
            if (slow := judge.slow_one(now, size, self._pending(), peers)) is not None:
                raise slow

    def _pending(self) -> set[str]:
        """The holders with chunks still to send here (the source by its URL)."""
        m = self.m
        return {u or m.source for u, todo in self.readers.values() if not m.done[todo].all()}


def _seen(f: asyncio.Future[ChunkDigests]) -> None:
    """A digest fetch's failure is its readers' (each raises it), not an unseen one."""
    if not f.cancelled():
        f.exception()


async def report_done(filler: Holders, src: RemoteSource, m: Mirror, seconds: float) -> None:
    """Tell the book this mirror is complete, with its whole fill's rate: the next
    version's deal leaves out a host that filled slowly. Best effort."""
    with contextlib.suppress(RefitError, TimeoutError):
        await filler.join(src, m, [], m.done_bytes() / max(seconds, 1e-6), done=True)
