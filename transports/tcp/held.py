"""The ``tcp`` data server's held reads: a read of bytes still filling waits for them.

A relay's mirror fills chunk by chunk, and the host behind it reads each chunk as soon
as it is complete there. Learning of each chunk first and asking for it after costs a
round of wake-ups per chunk on both hosts; instead the reader asks ahead, for chunks
not complete yet, and the data server holds each such read until its bytes are
complete, then answers it at once. The server never sends a byte that is not
complete: it asks :class:`Completion` (the daemon's, which knows its mirrors) before
it sends, and only the daemon marks bytes complete, once the read that filled them
returned.

Every held read is bounded: it is checked against its grant and lease before it is
held and again after (the data server does both), it waits at most ``hold_s``
(``HOLD_S``), it is refused at once when its fill failed, and one peer address holds
at most ``MAX_HELD_PER_ADDRESS`` at a time (a connection answers in order, so it holds
one read at most). A held read blocks only its own connection's thread.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

import numpy as np
import numpy.typing as npt

__all__ = ["HOLD_S", "MAX_HELD_PER_ADDRESS", "Completion", "Holds"]

HOLD_S = 10.0
"""Seconds the data server holds a read of bytes still filling before it refuses it
(as long as a relay has to answer a request)."""

MAX_HELD_PER_ADDRESS = 64
"""Reads held at once for one peer address (every loopback address is one): as many
as one peer daemon's lanes (``data_plane.lanes`` is at most 64)."""


class Completion(ABC):
    """Which bytes of the served regions are complete: what a data server waits on
    before it answers a read of bytes still filling (a relay's mirror).

    A subclass says, in :meth:`why_held`, where the bytes of some reads stand; this
    class answers the data server from that alone (:meth:`pending`, :meth:`wait`), so
    every kind of completion waits the same way. Whoever completes bytes, or fails
    them, calls :meth:`changed` so the held reads look again."""

    def __init__(self) -> None:
        self._cond = threading.Condition()

    @abstractmethod
    def why_held(
        self,
        region: npt.NDArray[np.int64],
        offset: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> str | None:
        """None when every byte of these reads is complete; "" when some are still
        filling; why, when they never will be (their fill failed). Quick: no waiting."""

    def changed(self) -> None:
        """Bytes completed, or a fill failed: the held reads look again."""
        with self._cond:
            self._cond.notify_all()

    def pending(
        self,
        region: npt.NDArray[np.int64],
        offset: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> bool:
        """Whether any byte of these reads is not complete yet (quick: no waiting)."""
        return self.why_held(region, offset, nbytes) is not None

    def wait(
        self,
        region: npt.NDArray[np.int64],
        offset: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        timeout_s: float,
    ) -> str | None:
        """Block the calling thread until every byte of these reads is complete: None
        then, or why they never will be (their fill failed, or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                why = self.why_held(region, offset, nbytes)
                if why is None:
                    return None
                if why:  # the fill failed: it never completes
                    return why
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"the bytes it reads were still filling {timeout_s:g} s later"
                self._cond.wait(left)


class Holds:
    """The reads a data server holds now, by peer address; ``completion`` (None:
    nothing here ever fills, no read is held) may be set after the server started."""

    def __init__(self, completion: Completion | None, hold_s: float = HOLD_S) -> None:
        if hold_s <= 0:
            raise ValueError("hold_s must be > 0 seconds")
        self.completion = completion
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._by_address: dict[str, int] = {}

    def pending(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` (``READ_ROW``s) read any byte not complete yet."""
        c = self.completion
        return c is not None and c.pending(rows["region"], rows["offset"], rows["nbytes"])

    def wait(self, rows: np.ndarray, key: str) -> str | None:
        """Hold ``rows``, read by the peer at address ``key``, until their bytes are
        complete: None then, or why the read is refused."""
        c = self.completion
        if c is None:
            return None
        with self._lock:
            held = self._by_address.get(key, 0)
            if held >= MAX_HELD_PER_ADDRESS:
                return (
                    f"read refused by the source: {held} reads of bytes still filling are "
                    f"held for this peer already (at most {MAX_HELD_PER_ADDRESS})"
                )
            self._by_address[key] = held + 1
        try:
            why = c.wait(rows["region"], rows["offset"], rows["nbytes"], self.hold_s)
        finally:
            with self._lock:
                left = self._by_address[key] - 1
                if left:
                    self._by_address[key] = left
                else:
                    del self._by_address[key]
        return None if why is None else f"read refused by the source: {why}"

    @property
    def held(self) -> int:
        """Reads held now, waiting for their bytes to complete."""
        with self._lock:
            return sum(self._by_address.values())
