"""A source's holder book: who holds each version it is the source of, and who reads
from whom. Pure state, no I/O; :mod:`refitd.daemon.mirrorhandlers` serves it.

The holders of a version form a tree rooted at the source. The source chooses each
joiner's parent (its *upstream*) from the holders it knows:

- the source itself has one child: its link carries each byte of a version about
  once, whatever the number of hosts;
- a holder has ``degree`` children at most: 1 while the version has at most
  ``CHAIN_HOLDERS`` holders (a chain: every link sends at its full rate, and each hop
  adds about one chunk's time), ``TREE_DEGREE`` past them (a tree: the depth, and so
  the hops a byte waits for and the holders a failure reaches, grows with the
  logarithm of the number of hosts, not with it);
- among the holders with a free slot, the shallowest, then the fastest (the rate
  each reported, bytes/s), then the earliest to join;
- a holder is never given one of its own descendants (a cycle would wait forever).

A joiner that failed to read from a holder, or found it slow (under half the rate
its peers report), names it in ``exclude``: that holder leaves the book (no later
joiner is sent to it) and the joiner gets another parent; the source is the last
resort. Each holder reports its rate as it fills (a join again, with ``rate``), and
the answer gives every holder's: a mirror compares its own with its peers'.
"""

from __future__ import annotations

from dataclasses import dataclass

from refitd.wire.mirrors import HolderAssign, HolderJoin

__all__ = ["CHAIN_HOLDERS", "MAX_HOLDERS", "TREE_DEGREE", "HolderBook"]

MAX_HOLDERS = 64
"""Holders the book keeps per version: a joiner past them is told an upstream but not
recorded, so the book, and each answer, stay bounded."""

CHAIN_HOLDERS = 4
"""Up to this many holders, each holder has one child (a chain)."""

TREE_DEGREE = 2
"""Children a holder has at most once a version has more than ``CHAIN_HOLDERS``."""


@dataclass
class _Holder:
    parent: str  # "" the source
    rate: float = 0.0  # bytes/s it last reported filling at


class HolderBook:
    """Per version this daemon is the source of, its holders and their parents.
    Bounded: ``MAX_HOLDERS`` per version, and only versions the caller checked exist
    here (older ones of a model forgotten)."""

    def __init__(self) -> None:
        self._books: dict[tuple[str, int], dict[str, _Holder]] = {}

    def join(self, j: HolderJoin) -> HolderAssign:
        """Record ``j.url`` (once), with its reported rate, and answer its upstream: the
        parent it was given before, unless it excludes that one now; else a new one
        (see the module docstring). Holders ``j`` excludes leave the book."""
        for key in [k for k in self._books if k[0] == j.model and k[1] < j.version]:
            del self._books[key]
        book = self._books.setdefault((j.model, j.version), {})
        failed = set(j.exclude) - {j.url}
        for url in failed:
            book.pop(url, None)
        me = book.get(j.url)
        if me is not None:
            if j.rate:
                me.rate = j.rate
            if me.parent and (me.parent in failed or me.parent not in book):
                me.parent = self._choose(book, j.url)
            return self._answer(book, me.parent)
        parent = self._choose(book, j.url)
        if len(book) < MAX_HOLDERS:
            book[j.url] = _Holder(parent, j.rate)
        return self._answer(book, parent)

    def holders(self, model: str, version: int) -> list[str]:
        """The holders of ``model`` ``version``, in the order they joined."""
        return list(self._books.get((model, version), {}))

    def parent(self, model: str, version: int, url: str) -> str | None:
        """The upstream ``url`` was given ("" the source), None if not in the book."""
        h = self._books.get((model, version), {}).get(url)
        return None if h is None else h.parent

    @staticmethod
    def _answer(book: dict[str, _Holder], upstream: str) -> HolderAssign:
        rates = {u: h.rate for u, h in book.items()}
        return HolderAssign(upstream, list(book), rates, {u: h.parent for u, h in book.items()})

    @staticmethod
    def _choose(book: dict[str, _Holder], joiner: str) -> str:
        """The parent of ``joiner``: see the module docstring."""
        degree = 1 if len(book | {joiner: _Holder("")}) <= CHAIN_HOLDERS else TREE_DEGREE
        children: dict[str, int] = {}
        for url, h in book.items():
            if url != joiner:
                children[h.parent] = children.get(h.parent, 0) + 1
        if children.get("", 0) < 1:
            return ""
        below = _descendants(book, joiner)
        order = {url: i for i, url in enumerate(book)}
        free = [u for u in book if u != joiner and u not in below and children.get(u, 0) < degree]
        if not free:
            return ""  # every holder's slots are taken: the source, as the last resort
        return min(free, key=lambda u: (_depth(book, u), -book[u].rate, order[u]))


def _depth(book: dict[str, _Holder], url: str) -> int:
    """Hops from the source to ``url`` (a parent no longer in the book ends the walk)."""
    depth, seen = 0, set()
    while url and url in book and url not in seen:
        seen.add(url)
        depth += 1
        url = book[url].parent
    return depth


def _descendants(book: dict[str, _Holder], url: str) -> set[str]:
    """Every holder that reads from ``url``, directly or through others."""
    out: set[str] = set()
    frontier = {url}
    while frontier:
        nxt = {u for u, h in book.items() if h.parent in frontier and u not in out}
        out |= nxt
        frontier = nxt
    return out
