"""Which holders a filling mirror leaves as slow or late: pure, no daemon."""

from __future__ import annotations

from refitd.daemon.mirror.judge import (
    LATE_BATCHES,
    LATE_FLOOR_S,
    LATE_MAKING_S,
    MAX_SLOW_SWITCHES,
    RELAY_QUIET_MAX_S,
    SLOW_AFTER_S,
    Judge,
)

MIB = 1 << 20
SRC = "http://trainer"


def fill(judge: Judge, per_s: dict[str, int], seconds: float, peers: list[float]) -> list[str]:
    """Report every 0.5 s for ``seconds``, each holder sending ``per_s`` chunks (1 MiB)
    a second, all of them with chunks still to send; the holders judged slow."""
    reads: dict[str, int] = dict.fromkeys(per_s, 0)
    got, t, slow = 0, 0.0, []
    judge.report(t, got, reads)
    while t < seconds:
        t += 0.5
        for u, n in per_s.items():
            reads[u] += n // 2
            got += n // 2 * MIB
        judge.report(t, got, reads)
        verdict = judge.slow_one(t, MIB, set(per_s), peers)
        if verdict is not None:
            slow.append(verdict.url)
    return slow


def started(*holders: str, relay: bool = False) -> Judge:
    judge = Judge(SRC, 2 * MIB)
    for h in holders:
        judge.reading(h, 0.0, relay=relay)
    return judge


def test_a_holder_sending_under_half_the_others_is_left_after_two_reports_in_a_row() -> None:
    judge = started(SRC, "a", "b", "slow")
    slow = fill(judge, {SRC: 40, "a": 40, "b": 40, "slow": 10}, 3.0, [1e8, 1e8])
    assert slow == ["slow"] * MAX_SLOW_SWITCHES  # then no more: it left its quota
    # one slow report (at SLOW_AFTER_S) is not enough: SLOW_REPORTS in a row are
    judge = started(SRC, "a", "b", "slow")
    assert fill(judge, {SRC: 40, "a": 40, "b": 40, "slow": 10}, SLOW_AFTER_S, [1e8]) == []


def test_holders_at_about_the_same_rate_are_never_slow() -> None:
    judge = started(SRC, "a", "b", "c")
    assert fill(judge, {SRC: 40, "a": 36, "b": 44, "c": 30}, 5.0, [1e8]) == []


def test_a_mirror_that_is_itself_the_slow_one_judges_nobody() -> None:
    judge = started(SRC, "a", "b")
    # its own rate (about 10 MB/s in all) is under half its peers' (the book's)
    assert fill(judge, {SRC: 4, "a": 4, "b": 1}, 5.0, [1e8, 1e8, 1e8]) == []


def test_a_mirror_that_is_itself_the_slow_one_finds_no_holder_late() -> None:
    """A host whose own link is slow waits on every holder: none of them is late for
    that (a slow host leaving fast holders read their chunks from the trainer again)."""
    judge = started(SRC, "a", "waiting")
    fill(judge, {SRC: 4, "a": 2, "waiting": 0}, 1.0, [1e8, 1e8])  # it is the slow one
    assert judge.late(LATE_FLOOR_S * 3, {"a": 1, "waiting": 0}, {"a", "waiting"}) is None
    fill(judge, {SRC: 40, "a": 40, "waiting": 0}, 1.0, [1e8])  # it is not any more
    verdict = judge.late(LATE_FLOOR_S * 3, {"a": 1, "waiting": 0}, {"a", "waiting"})
    assert verdict is not None and verdict.url == "waiting"


def test_the_source_is_never_left() -> None:
    judge = started(SRC, "a", "b")
    assert fill(judge, {SRC: 2, "a": 40, "b": 40}, 5.0, [1e8]) == []


def test_a_holder_that_sends_nothing_is_late_after_the_floor_and_not_before() -> None:
    judge = started("a", "stopped")
    reads = {"a": 0, "stopped": 0}
    t = 0.0
    while t < LATE_FLOOR_S - 0.2:
        t += 0.1
        reads["a"] += 1
        assert judge.late(t, reads, {"a", "stopped"}) is None
    t = LATE_FLOOR_S + 0.1
    reads["a"] += 1
    verdict = judge.late(t, reads, {"a", "stopped"})
    assert verdict is not None and verdict.url == "stopped"


def test_a_holder_with_nothing_left_to_send_is_never_late() -> None:
    judge = started("done")
    assert judge.late(LATE_FLOOR_S * 10, {"done": 5}, set()) is None


def test_a_slow_holders_deadline_grows_with_its_batches_time_at_its_rate() -> None:
    judge = started(SRC, "a")
    rate = 1 * MIB  # what it sent here: 1 MiB/s, so a 2 MiB batch takes 2 s
    judge.last["a"] = rate
    limit = LATE_BATCHES * 2 * MIB / rate
    assert limit > LATE_FLOOR_S
    judge.late(0.0, {"a": 3}, {"a"})  # it sent its third chunk at 0
    assert judge.late(limit - 0.5, {"a": 3}, {"a"}) is None
    assert judge.late(limit + 0.5, {"a": 3}, {"a"}) is not None


def test_a_holders_lateness_counts_from_when_this_mirror_could_take_its_chunks() -> None:
    """A reader starts while this mirror still makes its regions (slow on a busy
    host): no chunk can land before they exist, so the holder is judged from then."""
    judge = started("waited-on")  # its reader started at 0
    made = LATE_FLOOR_S + 1.0  # this mirror's regions took longer than the floor
    judge.receiving(made)
    assert judge.late(made + LATE_FLOOR_S - 0.1, {"waited-on": 0}, {"waited-on"}) is None
    judge.receiving(made + 5.0)  # a later watch: the first call counts
    verdict = judge.late(made + LATE_FLOOR_S + 0.1, {"waited-on": 0}, {"waited-on"})
    assert verdict is not None and verdict.url == "waited-on"


def test_a_relay_whose_own_fill_moves_on_is_not_late_for_chunks_it_did_not_hold() -> None:
    """A relay still making its regions, then filling them from upstream, owes chunks
    here it does not hold yet: each move of its own fill restarts its clock (CI saw a
    relay left for the trainer while it still made its regions). Once its fill stops
    moving, it is judged from its last move."""
    judge = started("relay", relay=True)
    judge.receiving(0.0)
    judge.progressed("relay", LATE_FLOOR_S - 0.5)  # its regions made
    judge.progressed("relay", 2 * LATE_FLOOR_S - 1.0)  # its first chunks complete there
    assert judge.late(3 * LATE_FLOOR_S - 1.1, {"relay": 0}, {"relay"}) is None
    verdict = judge.late(3 * LATE_FLOOR_S - 0.9, {"relay": 0}, {"relay"})
    assert verdict is not None and verdict.url == "relay"


def test_a_relays_move_heard_before_this_mirror_could_take_chunks_counts_from_then() -> None:
    judge = started("relay", relay=True)
    judge.progressed("relay", 0.5)  # its feed moved while this mirror made its regions
    made = LATE_FLOOR_S + 1.0
    judge.receiving(made)
    assert judge.late(made + LATE_FLOOR_S - 0.1, {"relay": 0}, {"relay"}) is None
    assert judge.late(made + LATE_FLOOR_S + 0.1, {"relay": 0}, {"relay"}) is not None


def test_a_relays_chunks_that_landed_here_are_kept_when_its_fill_moves() -> None:
    judge = started("relay", relay=True)
    judge.progressed("relay", 0.0)  # its regions made
    judge.receiving(0.0)
    assert judge.late(0.5, {"relay": 3}, {"relay"}) is None  # three chunks landed at 0.5
    judge.progressed("relay", 1.0)
    # the count stays 3: nothing new landed, so its clock runs from its move at 1.0
    assert judge.late(1.0 + LATE_FLOOR_S - 0.1, {"relay": 3}, {"relay"}) is None
    assert judge.late(1.0 + LATE_FLOOR_S + 0.1, {"relay": 3}, {"relay"}) is not None


def test_a_relay_still_making_its_regions_is_late_only_after_the_making_limit() -> None:
    """A relay whose feed has not named its regions made holds no chunk yet (CI saw a
    relay left for the trainer while it made its regions); one that never makes them
    is left after ``LATE_MAKING_S``. A holder that is not a relay has no such grace."""
    judge = Judge(SRC, 2 * MIB)
    judge.reading("relay", 0.0, relay=True)
    judge.reading("source-like", 0.0)
    judge.receiving(0.0)
    verdict = judge.late(LATE_FLOOR_S + 0.1, {}, {"relay", "source-like"})
    assert verdict is not None and verdict.url == "source-like"
    assert judge.late(LATE_MAKING_S - 0.1, {}, {"relay"}) is None
    verdict = judge.late(LATE_MAKING_S + 0.1, {}, {"relay"})
    assert verdict is not None and verdict.url == "relay"


def test_a_relay_whose_feed_says_it_moves_on_but_never_sends_is_late_after_the_quiet_cap() -> None:
    """A hostile (or broken) relay keeps its feed alive and says one more chunk of its
    own fill is complete just under every limit, yet sends nothing: each word restarts
    its clock, so without a cap it would hold this mirror for a limit per chunk of the
    model (hours). No chunk for ``RELAY_QUIET_MAX_S`` is late, whatever its feed says;
    a chunk that lands restarts that count."""
    judge = started("liar", relay=True)
    judge.receiving(0.0)
    judge.progressed("liar", 0.0)  # its regions made
    t, verdict = 0.0, None
    while verdict is None and t < 10 * RELAY_QUIET_MAX_S:
        t += LATE_FLOOR_S - 0.1
        judge.progressed("liar", t)  # one more chunk done there, it says
        verdict = judge.late(t, {"liar": 0}, {"liar"})
    assert verdict is not None and verdict.url == "liar"
    assert RELAY_QUIET_MAX_S < t <= RELAY_QUIET_MAX_S + LATE_FLOOR_S

    honest = started("relay", relay=True)
    honest.receiving(0.0)
    honest.progressed("relay", 0.0)
    t, sent = 0.0, 0
    while t < 3 * RELAY_QUIET_MAX_S:  # a chunk here every other move: never late
        t += LATE_FLOOR_S - 0.1
        honest.progressed("relay", t)
        sent += int(t / (LATE_FLOOR_S - 0.1)) % 2
        assert honest.late(t, {"relay": sent}, {"relay"}) is None
