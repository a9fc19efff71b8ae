"""Which holders a filling mirror leaves, as slow or late: pure, no I/O.

A mirror reads chunks from several holders at once
(:mod:`refitd.daemon.mirror.swarm`). :class:`Judge` is told what the mirror sees (when
a holder's reader started, how many chunks each holder has sent here, the bytes
complete, the rates the source's book reports for the other holders) and says which
holder to leave and why:

- **late**: a holder with chunks still to send here from which none landed for
  ``LATE_BATCHES`` batches' time at the rate it sent here, ``LATE_FLOOR_S`` at
  least (a stopped holder answers nothing; the floor keeps a busy core from looking
  like a stopped host), counted from when this mirror could first take its chunks
  (:meth:`Judge.receiving`: its regions made), not from when its reader started,
  and again from each time a relay's own fill moved on (:meth:`Judge.progressed`:
  a relay still filling from upstream is not late for chunks it does not hold yet).
  A relay whose feed has not yet named its regions made is still making them: it is
  late only after ``LATE_MAKING_S``. Its feed's word is not a chunk: a relay from
  which no chunk came for ``RELAY_QUIET_MAX_S`` is late however its fill moves;
- **slow**: after ``SLOW_AFTER_S`` of reading from it, a holder sending under
  ``SLOW_FRACTION`` of the median rate the other holders sent here while they had
  chunks to send, in ``SLOW_REPORTS`` reports in a row; at most
  ``MAX_SLOW_SWITCHES`` holders are left as slow.

A mirror that is itself under ``SLOW_FRACTION`` of its peers' median rate (the
book's) judges nobody slow or late: a host whose own link is slow finds every holder
slow, and every holder's chunks late behind its own link.

The source is never judged: it is the reference, and the holder of last resort.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refitd.errors import TransportError

__all__ = [
    "LATE_BATCHES",
    "LATE_FLOOR_S",
    "LATE_MAKING_S",
    "MAX_SLOW_SWITCHES",
    "RATE_WINDOW_S",
    "RELAY_QUIET_MAX_S",
    "SLOW_AFTER_S",
    "SLOW_FRACTION",
    "SLOW_REPORTS",
    "Judge",
    "LateHolder",
    "SlowRelay",
    "describe",
]

RATE_WINDOW_S = 1.0
"""A rate is the bytes completed over about the last this many seconds."""

SLOW_AFTER_S = 1.0
"""A holder is judged slow only after it was read from this long, s."""

SLOW_FRACTION = 0.5
"""A holder sending under this fraction of the other holders' median rate is slow."""

SLOW_REPORTS = 2
"""Reports in a row a holder must be slow in before it is left: a host that a busy
core held up for a moment is not slow."""

MAX_SLOW_SWITCHES = 1
"""Holders one mirror leaves for being slow."""

LATE_FLOOR_S = 2.0
"""A holder with chunks still to send here that sent none for this long is late,
whatever its rate, s."""

LATE_BATCHES = 8
"""A holder is late after this many batches' time at the rate it sent here."""

LATE_MAKING_S = 15.0
"""A relay whose feed has not named its regions made this long after this mirror
could take chunks is late, s: making shared memory takes a busy host seconds, not
this long (its feed's heartbeats only say its daemon answers)."""

RELAY_QUIET_MAX_S = 60.0
"""A relay from which no chunk came here this long is late, s, however often its feed
says its own fill moved on (:meth:`Judge.progressed`): a feed that says so without
the relay ever sending would otherwise restart its clock once per chunk of the
model, and hold this mirror for hours."""


class SlowRelay(TransportError):
    """A holder sends under ``SLOW_FRACTION`` of the other holders' rate."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(why)
        self.url = url


class LateHolder(TransportError):
    """A holder with chunks to send here sent none within its deadline."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(why)
        self.url = url


@dataclass
class Judge:
    """The slow and late judgement of one filling mirror whose chunks from the
    source are counted under ``source`` (its URL); ``batch_bytes`` is what one read
    of a holder brings (its deadline is counted in those)."""

    source: str
    batch_bytes: int
    slow_left: int = MAX_SLOW_SWITCHES
    #: (when, bytes complete, chunks per holder) of the reports in the rate window
    samples: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    #: reports in a row each holder was slow in
    slow: dict[str, int] = field(default_factory=dict)
    #: each holder's rate here the last time it had chunks to send
    last: dict[str, float] = field(default_factory=dict)
    #: when each holder's count here last grew, and that count
    seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    #: when a chunk last came from each holder (or it started, or this mirror could
    #: take chunks), whatever its feed said since (:data:`RELAY_QUIET_MAX_S`)
    heard: dict[str, float] = field(default_factory=dict)
    #: when each holder was first read from, or when this mirror could first take
    #: chunks (its regions made) if later
    started: dict[str, float] = field(default_factory=dict)
    #: when this mirror could first take chunks (None: not yet known)
    receiving_at: float | None = None
    #: holders that are relays (mirrors of other hosts), and of them the ones whose
    #: feed named their regions made
    relays: set[str] = field(default_factory=set)
    made: set[str] = field(default_factory=set)
    #: this mirror filled under ``SLOW_FRACTION`` of its peers' median rate at its
    #: last report: it judges no holder slow or late
    behind: bool = False

    def reading(self, holder: str, now: float, *, relay: bool = False) -> None:
        """A reader of ``holder`` started at ``now`` (its first one counts); a
        ``relay`` is another host's mirror, which may still make its regions."""
        self.started.setdefault(holder, now)
        if relay:
            self.relays.add(holder)

    def receiving(self, now: float) -> None:
        """This mirror can take chunks from ``now`` on (its regions are made). No
        chunk lands here before that, so a holder's time until then is not its own:
        a reader started while the regions were made is judged from ``now`` (a host
        slow to make its shared memory, as a busy one is, does not find its holders
        late for waiting on it). Only the first call counts."""
        if self.receiving_at is not None:
            return
        self.receiving_at = now
        self.started = {u: max(t, now) for u, t in self.started.items()}
        self.seen = {u: (max(t, now), n) for u, (t, n) in self.seen.items()}
        self.heard = {u: max(t, now) for u, t in self.heard.items()}

    def progressed(self, holder: str, now: float) -> None:
        """``holder``, a relay, moved on at ``now`` in its own fill (its feed named its
        regions made, or more of its chunks complete): the chunks it still owes here
        may be ones it did not hold until now, so its lateness counts from ``now``
        (from when this mirror can take chunks, if later). A relay whose own fill stops
        moving is judged as any holder, from its last move."""
        self.made.add(holder)
        since = max(now, self.receiving_at if self.receiving_at is not None else now)
        _, count = self.seen.get(holder, (since, 0))
        self.seen[holder] = (since, count)

    def late(self, now: float, reads: dict[str, int], pending: set[str]) -> LateHolder | None:
        """The first holder of ``pending`` (holders with chunks still to send here)
        that is late at ``now``, given ``reads`` (chunks each holder sent here). None
        while this mirror is the slow one (its last report): its own link keeps
        every holder's chunks waiting."""
        if self.behind:
            return None
        for u in sorted(pending - {self.source}):
            count = reads.get(u, 0)
            since, before = self.seen.get(u, (self.started.get(u, now), 0))
            if count != before:
                self.seen[u] = (now, count)
                self.heard[u] = now
                continue
            r = self.last.get(u, 0.0)
            limit = max(LATE_FLOOR_S, LATE_BATCHES * self.batch_bytes / r if r > 0 else 0.0)
            if u in self.relays and u not in self.made:
                limit = max(limit, LATE_MAKING_S)  # still making its regions
            quiet = now - self.heard.get(u, self.started.get(u, now))
            if u in self.relays and quiet > max(limit, RELAY_QUIET_MAX_S):
                return LateHolder(
                    u,
                    f"no chunk came from it for {quiet:.1f} s, though its feed said its fill "
                    f"moved on (a relay's limit {max(limit, RELAY_QUIET_MAX_S):.1f} s)",
                )
            if now - since > limit:
                return LateHolder(
                    u, f"no chunk came from it for {now - since:.1f} s (its limit {limit:.1f} s)"
                )
        return None

    def report(self, now: float, got: int, reads: dict[str, int]) -> float:
        """Record a report at ``now`` (``got`` bytes complete here, ``reads`` chunks
        per holder); this mirror's rate over the window, bytes/s."""
        self.samples.append((now, got, dict(reads)))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.pop(0)
        t0, b0, _ = self.samples[0]
        return (got - b0) / max(1e-6, now - t0)

    def slow_one(
        self, now: float, chunk_bytes: int, pending: set[str], peers: list[float]
    ) -> SlowRelay | None:
        """After :meth:`report`: the holder of ``pending`` (holders, the source's URL
        included, with chunks still to send here) to leave as slow, if any; ``peers``
        are the other holders' rates as the book reports them."""
        if self.slow_left <= 0 or len(self.samples) < 2:
            return None
        t0, b0, r0 = self.samples[0]
        now_, got, reads = self.samples[-1]
        span = max(1e-6, now_ - t0)
        window = {u: (n - r0.get(u, 0)) * chunk_bytes / span for u, n in reads.items()}
        for u, r in window.items():
            if u in pending:
                self.last[u] = r
        mine = (got - b0) / span
        ranked = sorted(r for r in peers if r > 0)
        self.behind = bool(ranked) and mine < SLOW_FRACTION * ranked[len(ranked) // 2]
        if self.behind:
            self.slow.clear()  # this host is the slow one: every holder is slow to it
            return None
        for u in sorted(pending - {self.source}):
            if now - self.started.get(u, now) < SLOW_AFTER_S:
                continue
            others = sorted(r for v, r in self.last.items() if v != u)
            median = others[len(others) // 2] if others else 0.0
            rate = window.get(u, 0.0)
            self.slow[u] = self.slow.get(u, 0) + 1 if rate < SLOW_FRACTION * median else 0
            if self.slow[u] >= SLOW_REPORTS:
                self.slow_left -= 1
                return SlowRelay(
                    u,
                    f"it sends {rate * 8 / 1e6:.0f} Mbit/s, under {SLOW_FRACTION} of the other "
                    f"holders' {median * 8 / 1e6:.0f} Mbit/s (here, while they sent)",
                )
        return None


def describe(exc: BaseException) -> str:
    """How a holder's failure is named in logs and errors."""
    if isinstance(exc, TimeoutError):
        return "no answer within its deadline (stopped or partitioned)"
    return f"{type(exc).__name__}: {exc}"
