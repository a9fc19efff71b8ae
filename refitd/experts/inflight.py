"""Asynchronous slot copies: completion fences and the host backend's copier thread.

A prefetch copies expert rows while the model computes, so its copies must not block
the caller. A ``SlotDevice`` issues them on its copy queue and returns a
``CopyFence``; the executor (``ExpertSlots``) keeps the slots *in flight* until the
fence completes. The shape maps onto a GPU backend one to one: the queue is a copy
stream, ``write_slots_async`` is one ``cudaMemcpyAsync`` per row followed by an event
record, ``CopyFence.done`` is the event query and ``CopyFence.wait`` the event
synchronise (where an asynchronous copy error surfaces).

``HostCopier`` is the host backend's queue: one thread that runs jobs in submission
order, so a copy issued later lands later, as on a stream.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from refitd.errors import TransportError

__all__ = ["CompletedFence", "CopyFence", "HostCopier", "ThreadFence"]


class CopyFence(ABC):
    """Completion of one batch of asynchronous copies.

    ``wait`` raises ``refitd.experts.SlotDeviceError`` when any copy of the batch
    failed; the backend need not say which (a stream reports an error, not a row).
    """

    @abstractmethod
    def done(self) -> bool:
        """Whether every copy has landed or the batch has failed. Never blocks."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the batch completes; raise ``SlotDeviceError`` if it failed."""


class CompletedFence(CopyFence):
    """A batch that completed before its fence was handed out: the fallback of a
    backend whose copies are synchronous. ``error`` fails it."""

    def __init__(self, error: TransportError | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        if self._error is not None:
            raise self._error


class ThreadFence(CopyFence):
    """Completed by ``HostCopier``'s thread when its job returns or raises."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: TransportError | None = None

    def _finish(self, error: TransportError | None) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error


class HostCopier:
    """One background thread running copy jobs in submission order.

    A job that raises a ``TransportError`` (``SlotDeviceError`` among them) fails its
    own fence and no other: later jobs still run, as later copies on a stream do
    after an error the backend recovered from. Any other exception is a bug in the
    job and fails its fence with that exception's text rather than killing the
    thread, so no waiter hangs. The thread starts on the first ``submit`` and is a
    daemon thread; ``close`` stops it after the jobs already queued.
    """

    def __init__(self, name: str = "refitd-slot-copier") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], ThreadFence] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> ThreadFence:
        fence = ThreadFence()
        with self._lock:
            if self._closed:
                raise TransportError("the slot copier is closed: no copy can be issued")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((job, fence))
        return fence

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fence = item
            try:
                job()
            except TransportError as e:
                fence._finish(e)
            except Exception as e:
                fence._finish(TransportError(f"copy job failed: {e!r}"))
            else:
                fence._finish(None)

    def close(self) -> None:
        """Stop after the queued jobs; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join()
