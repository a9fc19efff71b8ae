"""A source's holder book: who holds each version it is the source of, and which
holder each chunk of it is read from first. Pure state, no I/O;
:mod:`refitd.daemon.mirror.routes` serves it.

Every host's mirror reads each chunk from *some* holder: the source, or another
host's mirror, still filling or complete. The book decides who brings each chunk
onto the hosts first: it **deals** the version's chunks to its *seeders*, chunk ``c``
to ``seeders[c % len(seeders)]``. A seeder reads its own chunks from the source;
every other holder reads them from that seeder (a read of a chunk the seeder does
not hold yet waits there until it does, :mod:`refitd.daemon.mirror.hold`). So:

- the source sends each chunk about once, to its seeder, whatever the number of
  hosts (``uplink_ratio`` about 1);
- a host's downlink is fed by every seeder's uplink at once, not by one upstream: a
  host that fell behind catches up, and one slow host slows only itself;
- every seeder's uplink carries its share, ``1 / len(seeders)`` of the version, to
  each other holder: the load is spread evenly, with no relay whose stall reaches
  every host below it.

Why a deal and not a map of who holds what (a bitmap per holder, BitTorrent's way):
with a deal, every holder knows where each chunk will be before any byte moves, and
asks for it at once; the seeder's data server answers the moment the chunk lands
there. A bitmap is news of the past: a reader waits for it (a report, a round trip)
before each read, and two readers that see the same missing chunk both take it from
the source. The bitmaps each holder reports (``have``) are kept for what they are
good for: when a seeder fails, the chunks it was dealt are dealt again to a holder
that already holds them complete, else spread over the other seeders.

When the deal is made. A refit loop's fleet is the same from one version to the
next: the book deals a version once every holder of the model's version before it
has joined, or ``DEAL_GRACE_S`` after the first join, whichever comes first (with
no version before, at ``DEAL_GRACE_S``: the hosts that start together seed together). Seeders are the holders joined by then,
less the ones another holder found slow or sending wrong bytes in the version
before (``shun``) and the ones that filled it under ``SLOW_FRACTION`` of their
peers' median rate: a host whose own link is slow reads every chunk, and brings
none first. A holder left for failing or being late (a busy core, a restart) seeds
again in the next version it joins in time. A holder that joins after the deal is a reader only.

A joiner that failed to read from a holder, found it slow, or got wrong bytes from
it names it in ``exclude``: that holder leaves the book, and its chunks are dealt
again. The source is the holder of last resort: a chunk with no seeder left is read
from the source by whoever lacks it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from refitd.wire.mirrors import FROM_SOURCE, MAX_DEAL_CHUNKS, HolderAssign, HolderJoin

__all__ = ["DEAL_GRACE_S", "MAX_HOLDERS", "SLOW_FRACTION", "HolderBook"]

MAX_HOLDERS = 64
"""Holders the book keeps per version: a joiner past them reads from the seeders
but is not recorded, so the book, and each answer, stay bounded."""

DEAL_GRACE_S = 0.05
"""How long after a version's first join the book waits for the holders of the
version before it to join, s (a refit loop's hosts start each version together)."""

SLOW_FRACTION = 0.5
"""A holder that filled the version before under this fraction of its peers' median
rate is dealt no chunks of the next one."""


@dataclass
class _Holder:
    rate: float = 0.0  # bytes/s it last reported filling at
    final: bool = False  # ``rate`` is its whole fill's (its last report)
    have: np.ndarray | None = None  # the chunks it last reported complete


@dataclass
class _Version:
    chunks: int
    first_join: float
    #: the holders of the version before that were not slow: the deal waits for them
    expected: frozenset[str]
    slow: frozenset[str]
    holders: dict[str, _Holder] = field(default_factory=dict)
    #: holders another holder found slow, or sending wrong bytes, in this version
    dropped: set[str] = field(default_factory=set)
    seeders: list[str] = field(default_factory=list)
    deal: np.ndarray | None = None  # per chunk, an index into ``seeders`` or FROM_SOURCE
    dealt: asyncio.Event = field(default_factory=asyncio.Event)


class HolderBook:
    """Per version this daemon is the source of, its holders and its deal. Bounded:
    ``MAX_HOLDERS`` per version, two versions per model (the newest and the one
    before it, whose holders the next deal waits for)."""

    def __init__(self) -> None:
        self._books: dict[tuple[str, int], _Version] = {}

    def join(self, j: HolderJoin, chunks: int, now: float) -> HolderAssign:
        """Record ``j.url`` (once) with what it reports, drop the holders it
        excludes (their chunks dealt again), deal the version if it is due, and
        answer the deal as it stands (empty while not dealt: :meth:`wait_dealt`).
        ``chunks`` is the number of chunks the version is cut into here."""
        v = self._version(j.model, j.version, chunks, now)
        me = v.holders.get(j.url)
        if me is None and len(v.holders) < MAX_HOLDERS:
            me = v.holders[j.url] = _Holder()
        if me is not None:
            if j.rate and not me.final:
                me.rate, me.final = j.rate, j.done
            if j.have:
                me.have = _unpack(j.have, v.chunks)
        for url in set(j.exclude) - {j.url}:
            self._drop(v, url, j.url)
        for url in set(j.shun) & set(j.exclude) - {j.url}:
            if len(v.dropped) < MAX_HOLDERS:
                v.dropped.add(url)
        if v.deal is None and v.expected and v.expected <= set(v.holders):
            self._deal(v)
        return self._answer(v)

    def due(self, model: str, version: int, now: float) -> float:
        """Seconds until the deal of ``model`` ``version`` is due (0: dealt, or due)."""
        v = self._books.get((model, version))
        if v is None or v.deal is not None:
            return 0.0
        return max(0.0, v.first_join + DEAL_GRACE_S - now)

    async def wait_dealt(self, model: str, version: int, now: float) -> HolderAssign:
        """The answer once ``model`` ``version`` is dealt: at once, when every
        expected holder joined, else at ``DEAL_GRACE_S`` after its first join."""
        v = self._books[(model, version)]
        if v.deal is None:
            try:
                async with asyncio.timeout(self.due(model, version, now)):
                    await v.dealt.wait()
            except TimeoutError:
                pass
            if v.deal is None:
                self._deal(v)
        return self._answer(v)

    def holders(self, model: str, version: int) -> list[str]:
        """The holders of ``model`` ``version``, in the order they joined."""
        v = self._books.get((model, version))
        return [] if v is None else list(v.holders)

    def seeders(self, model: str, version: int) -> list[str]:
        """The holders dealt chunks of ``model`` ``version``, in deal order."""
        v = self._books.get((model, version))
        return [] if v is None else list(v.seeders)

    # ------------------------------------------------------------ inside

    def _version(self, model: str, version: int, chunks: int, now: float) -> _Version:
        v = self._books.get((model, version))
        if v is not None:
            return v
        older = sorted(k for k in self._books if k[0] == model and k[1] < version)
        expected: frozenset[str] = frozenset()
        slow: frozenset[str] = frozenset()
        if older:
            before = self._books[older[-1]]
            rates = [h.rate for h in before.holders.values() if h.rate > 0]
            median = float(np.median(rates)) if rates else 0.0
            slow = frozenset(
                u for u, h in before.holders.items() if 0 < h.rate < SLOW_FRACTION * median
            ) | frozenset(before.dropped)
            expected = frozenset(before.holders) - slow
        for key in older[:-1]:  # the newest older one is kept: the next deal waits for it
            del self._books[key]
        if older:
            self._books[older[-1]].dealt.set()  # nothing waits on it any more
        v = self._books[(model, version)] = _Version(
            min(chunks, MAX_DEAL_CHUNKS), now, expected, slow
        )
        return v

    def _deal(self, v: _Version) -> None:
        """Deal every chunk round robin over the holders joined now, less the slow."""
        seeders = [u for u in v.holders if u not in v.slow] or list(v.holders)
        v.seeders = seeders[: FROM_SOURCE - 1]
        n = len(v.seeders)
        if n == 0 or v.chunks == 0:
            v.deal = np.full(v.chunks, FROM_SOURCE, dtype=np.uint8)
        else:
            v.deal = (np.arange(v.chunks) % n).astype(np.uint8)
        v.dealt.set()

    def _drop(self, v: _Version, url: str, by: str) -> None:
        """``url`` leaves the book (``by`` failed to read from it); the chunks it was
        dealt go to a holder that reported them complete, else round robin to the
        other seeders (``by`` among them), else to the source."""
        v.holders.pop(url, None)
        if v.deal is None or url not in v.seeders:
            return
        gone = v.seeders.index(url)
        mine = np.flatnonzero(v.deal == gone)
        live = [s for s in v.seeders if s in v.holders and s != url]
        if by in v.holders and by not in live and len(v.seeders) < FROM_SOURCE - 1:
            live.append(by)
        for s in live:
            if s not in v.seeders:
                v.seeders.append(s)
        index = {s: i for i, s in enumerate(v.seeders)}
        rest = np.ones(len(mine), dtype=bool)
        for u, h in v.holders.items():  # a holder that has a chunk complete serves it
            if h.have is None or not (rest & h.have[mine]).any():
                continue
            if u not in index:
                if len(v.seeders) >= FROM_SOURCE - 1:
                    continue
                v.seeders.append(u)
                index[u] = len(v.seeders) - 1
            has = rest & h.have[mine]
            v.deal[mine[has]] = index[u]
            rest &= ~has
        left = mine[rest]
        if live:
            v.deal[left] = np.array([index[s] for s in live], dtype=np.uint8)[
                np.arange(len(left)) % len(live)
            ]
        else:
            v.deal[left] = FROM_SOURCE
        v.seeders[gone] = ""  # its index is never dealt again

    @staticmethod
    def _answer(v: _Version) -> HolderAssign:
        deal = b"" if v.deal is None else v.deal.tobytes()
        rates = {u: h.rate for u, h in v.holders.items()}
        return HolderAssign(list(v.seeders), deal, list(v.holders), rates)


def _unpack(have: bytes, chunks: int) -> np.ndarray | None:
    """A reported bitmap of complete chunks (``np.packbits`` order), or None if it
    does not fit the version's chunks."""
    bits = np.unpackbits(np.frombuffer(have, dtype=np.uint8))
    if len(bits) < chunks or bits[chunks:].any():
        return None
    return bits[:chunks].astype(bool)
