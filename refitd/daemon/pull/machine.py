"""A pull's life as a state machine: pure, no I/O.

:func:`step` takes a pull's :class:`Pull` state and one event, and returns its next
state and what to do (:class:`Ended`): the order and the outcome of a pull are
decided here once, for an engine's pull (:meth:`PullManager._run
<refitd.daemon.pull.pulls.PullManager>`) and for the bytes the daemon reads on its own
behalf (:meth:`PullManager.tracked <refitd.daemon.pull.pulls.PullManager.tracked>`), in the
style of a worker state machine whose transitions are tested without sockets.

::

    PENDING --Start--> RUNNING --Move--> RUNNING (moving) --Finish--> DONE
       |                  |                   |
       +--Cancel--> CANCELLED     Fail / Gone / Cancel --> FAILED / FAILED / CANCELLED

- ``Finish`` ends a running pull DONE (only after its last byte and its lease check);
- ``Fail(exc)`` ends it FAILED with ``exc``'s error; an error that is not a
  :class:`~refitd.errors.RefitError` is also logged (it was not expected);
- ``Gone(reason)`` ends it FAILED because its source left (the registry's cluster
  view, a peer declared dead), naming why;
- ``Cancel(reason)`` ends it CANCELLED, naming who cancelled it and why;
- once ``Move`` happened (bytes may have moved), an ending that is not DONE marks
  every destination range of the pull suspect: nothing read by it may be used;
- an ended pull stays ended: a later event changes nothing (a pull ends once).
"""

from __future__ import annotations

from dataclasses import dataclass

from refitd.daemon.pull import core as pullcore
from refitd.errors import RefitError
from refitd.wire import ErrorBody, PullState

__all__ = [
    "Cancel",
    "Ended",
    "Event",
    "Fail",
    "Finish",
    "Gone",
    "Move",
    "Pull",
    "Start",
    "step",
]

ENDED = frozenset({PullState.DONE, PullState.FAILED, PullState.CANCELLED})


@dataclass(frozen=True)
class Pull:
    """Where a pull stands: its state, and whether bytes may have moved (``moving``)."""

    pull_id: str
    state: PullState = PullState.PENDING
    moving: bool = False


@dataclass(frozen=True)
class Start:
    """The pull begins to run."""


@dataclass(frozen=True)
class Move:
    """From now on bytes may move: an ending other than DONE makes its ranges suspect."""


@dataclass(frozen=True)
class Finish:
    """Every byte is read and the lease checked after the last one."""


@dataclass(frozen=True)
class Fail:
    """An error ended it, reading from ``where`` (how the error names its source)."""

    error: BaseException
    where: str


@dataclass(frozen=True)
class Gone:
    """Its source, ``where``, left (``reason`` says how)."""

    reason: str
    where: str


@dataclass(frozen=True)
class Cancel:
    """Someone cancelled it (``reason`` says who and why)."""

    reason: str


Event = Start | Move | Finish | Fail | Gone | Cancel


@dataclass(frozen=True)
class Ended:
    """What to do as the pull ends: record ``error`` (None: DONE), mark its ranges
    ``suspect``, and log the error when it was not ``expected``."""

    state: PullState
    error: ErrorBody | None = None
    suspect: bool = False
    expected: bool = True


def step(p: Pull, ev: Event) -> tuple[Pull, list[Ended]]:
    """The pull after ``ev``, and what to do (one :class:`Ended` when it ends now)."""
    if p.state in ENDED:
        return p, []  # it ended already
    if isinstance(ev, Start):
        return Pull(p.pull_id, PullState.RUNNING, p.moving), []
    if isinstance(ev, Move):
        return Pull(p.pull_id, p.state, True), []
    if isinstance(ev, Finish):
        if p.state is not PullState.RUNNING:
            return _end(p, PullState.FAILED, _not_running(p), True)
        return _end(p, PullState.DONE, None, True)
    if isinstance(ev, Cancel):
        return _end(p, PullState.CANCELLED, pullcore.cancelled(p.pull_id, ev.reason), True)
    if isinstance(ev, Gone):
        return _end(p, PullState.FAILED, pullcore.source_gone(p.pull_id, ev.where, ev.reason), True)
    error = ev.error if isinstance(ev.error, Exception) else RuntimeError(str(ev.error))
    return _end(
        p,
        PullState.FAILED,
        pullcore.failed(p.pull_id, ev.where, error),
        isinstance(error, RefitError),
    )


def _end(
    p: Pull, state: PullState, error: ErrorBody | None, expected: bool
) -> tuple[Pull, list[Ended]]:
    suspect = p.moving and state is not PullState.DONE
    return Pull(p.pull_id, state, p.moving), [Ended(state, error, suspect, expected)]


def _not_running(p: Pull) -> ErrorBody:
    return ErrorBody("ProtocolError", f"pull {p.pull_id} finished before it was started")
