"""The one byte loop of a daemon: :func:`move`.

Every byte a daemon reads through a data plane goes through it: an engine's pull
(:mod:`refitd.daemon.pull.pulls`), a host mirror filling from its source or an upstream
relay, and an engine's pull from a mirror still filling (:mod:`refitd.daemon.mirror.mirrors`).
Each of them is a :class:`~refitd.daemon.pull.pulls.PullJob`, so they all count their
progress the same way and tell the same listeners (metrics, ``/v1/pulls``).

The loop hands ``spans`` of reads to a connection, ``in_flight`` at once: while one
batch moves, the next is validated and posted. Per span, in order:

1. ``ready(lo, hi)`` (optional) returns once those reads may be made: a mirror
   filling, or an upstream relay, serves a chunk only once it is complete;
2. the batch is read, within ``deadline_s(nbytes)`` if given (a relay's deadline; on
   a miss ``late()`` cuts the connection so no late byte lands, and the
   :class:`TimeoutError` fails the move);
3. ``check(lo, hi)`` (optional) checks what landed (a mirror reading another
   holder checks each chunk's digest; an error fails the move);
4. the job's progress counts it, then ``landed(lo, hi)`` (a mirror marks its
   chunks complete: only now, after the read returned and was checked).

The first error of any batch ends the move, raised as itself (:func:`one_error`),
after the other batches were cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Protocol

import numpy as np

from refitd.errors import RefitError
from transports.batch import ReadBatch
from transports.interface import Peer

__all__ = ["IN_FLIGHT", "Progress", "first_error", "move", "one_error"]


class Progress(Protocol):
    """What a move reports to (a :class:`~refitd.daemon.pull.pulls.PullJob`)."""

    def progress(self, n_desc: int, n_bytes: int) -> None: ...


IN_FLIGHT = 2
"""Batches one move has in flight at once: while one is being moved, the next is
validated and posted, so the data plane never waits on this loop."""


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The error a failed task group stands for: its first :class:`RefitError` (a
    transport's own, naming what failed), else its first other ``Exception``, looking
    into nested groups; None when it holds only cancellations and exits."""
    flat: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        e = stack.pop(0)
        if isinstance(e, BaseExceptionGroup):
            stack[:0] = list(e.exceptions)
        else:
            flat.append(e)
    for kind in (RefitError, Exception):
        found = next((e for e in flat if isinstance(e, kind)), None)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def one_error() -> Iterator[None]:
    """Raise a task group's failure as :func:`first_error` (``raise ... from None``):
    a :class:`asyncio.TaskGroup` wraps even one failure (``PeerLost`` when a source died
    mid-read) in an ExceptionGroup, and its callers fail with the transport's own
    error. A group of nothing but cancellations propagates as it is."""
    try:
        yield
    except BaseExceptionGroup as group:
        first = first_error(group)
        if first is None:
            raise
        raise first from None


async def move(
    job: Progress,
    conn: Peer,
    reads: ReadBatch,
    ends: np.ndarray,
    spans: Iterable[tuple[int, int]],
    *,
    in_flight: int = IN_FLIGHT,
    ready: Callable[[int, int], Awaitable[None]] | None = None,
    landed: Callable[[int, int], None] | None = None,
    deadline_s: Callable[[int], float] | None = None,
    late: Callable[[], None] | None = None,
    check: Callable[[int, int], Awaitable[None]] | None = None,
) -> None:
    """Read ``reads`` (validated against the source's records) through ``conn``, span
    by span (``[lo, hi)`` of ``reads``), as the module docstring says. ``ends[i]`` is
    how many descriptors read ``i`` completes (its job's ``descriptors_done``)."""
    window = asyncio.Semaphore(in_flight)

    async def one(lo: int, hi: int) -> None:
        try:
            part = reads[lo:hi]
            nbytes = int(part["nbytes"].sum())
            if deadline_s is None:
                await conn.get(part)
            else:
                try:
                    async with asyncio.timeout(deadline_s(nbytes)):
                        await conn.get(part)
                except TimeoutError:
                    if late is not None:
                        late()
                    raise
            if check is not None:
                await check(lo, hi)
            job.progress(int(ends[lo:hi].sum()), nbytes)
            if landed is not None:
                landed(lo, hi)
        finally:
            window.release()

    with one_error():
        async with asyncio.TaskGroup() as tg:
            for lo, hi in spans:
                if ready is not None:
                    await ready(lo, hi)
                await window.acquire()
                tg.create_task(one(lo, hi))
