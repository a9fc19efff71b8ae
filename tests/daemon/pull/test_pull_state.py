"""A pull's life as a state machine (refitd.daemon.pull.machine): pure, no daemon."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from refitd.daemon.pull.machine import (
    Cancel,
    Ended,
    Event,
    Fail,
    Finish,
    Gone,
    Move,
    Pull,
    Start,
    step,
)
from refitd.errors import TransportError
from refitd.wire import PullState

ENDED = {PullState.DONE, PullState.FAILED, PullState.CANCELLED}


def run(*events: Event) -> tuple[Pull, list[Ended]]:
    p, out = Pull("p1"), []
    for ev in events:
        p, todo = step(p, ev)
        out += todo
    return p, out


def test_a_pull_that_reads_every_byte_ends_done_with_no_error_and_nothing_suspect() -> None:
    p, out = run(Start(), Move(), Finish())
    assert p.state is PullState.DONE
    assert out == [Ended(PullState.DONE, None, False, True)]


def test_a_failure_after_bytes_may_have_moved_marks_its_ranges_suspect() -> None:
    p, [end] = run(Start(), Move(), Fail(TransportError("lane lost"), "node-a"))
    assert p.state is PullState.FAILED and end.suspect and end.expected
    assert end.error is not None and end.error.error == "TransportError"
    assert "node-a" in end.error.detail and "lane lost" in end.error.detail


def test_a_failure_before_any_byte_moved_marks_nothing_suspect() -> None:
    _, [end] = run(Start(), Fail(TransportError("refused"), "node-a"))
    assert end.state is PullState.FAILED and not end.suspect


def test_an_error_that_is_not_refitds_own_is_logged_as_unexpected() -> None:
    _, [end] = run(Start(), Move(), Fail(KeyError("bug"), "node-a"))
    assert not end.expected and end.error is not None and end.error.error == "TransportError"


def test_a_cancel_names_its_reason_and_a_gone_source_fails_the_pull_naming_why() -> None:
    _, [cancelled] = run(Start(), Move(), Cancel("cancelled by request"))
    assert cancelled.state is PullState.CANCELLED and cancelled.suspect
    assert cancelled.error is not None and "cancelled by request" in cancelled.error.detail
    _, [gone] = run(Start(), Gone("its daemon left the cluster", "node-b"))
    assert gone.state is PullState.FAILED and not gone.suspect
    assert gone.error is not None and "left the cluster" in gone.error.detail


def test_a_pull_finished_before_it_started_fails_rather_than_ending_done() -> None:
    p, [end] = run(Finish())
    assert p.state is PullState.FAILED and end.error is not None


EVENTS = st.sampled_from(
    [Start(), Move(), Finish(), Fail(TransportError("x"), "w"), Gone("g", "w"), Cancel("c")]
)


@given(st.lists(EVENTS, max_size=8))
def test_a_pull_ends_at_most_once_and_then_never_changes(events: list[Event]) -> None:
    p, ends = Pull("p1"), 0
    for ev in events:
        before = p
        p, todo = step(p, ev)
        ends += len(todo)
        if before.state in ENDED:
            assert p == before and todo == []
        for end in todo:
            assert end.state is p.state in ENDED
            assert (end.error is None) == (end.state is PullState.DONE)
            assert not (end.suspect and not p.moving)
    assert ends == (1 if p.state in ENDED else 0)
