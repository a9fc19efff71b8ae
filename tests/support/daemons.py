"""Fakes for driving an in-process daemon: a settable clock and a gated copier.

Both implement the daemon's own interfaces (the ``clock`` callable and
:class:`refitd.daemon.copier.Copier`); everything else a test builds is real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from refitd.daemon.copier import Progress, ThreadCopier


class FakeClock:
    """A clock in seconds that moves only when the test sets or advances ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class GatedCopier:
    """A real copy (:class:`ThreadCopier`) that first waits for the test to open
    ``gate``; ``entered`` is set once a copy is waiting there.

    This is the only way to hold a pull "mid-flight" deterministically: a real memory
    copy cannot be made to pause at a chosen point."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.inner = ThreadCopier()

    async def copy(
        self,
        srcs: Sequence[memoryview],
        dsts: Sequence[memoryview],
        rows: np.ndarray,
        progress: Progress,
    ) -> None:
        self.entered.set()
        await self.gate.wait()
        await self.inner.copy(srcs, dsts, rows, progress)
