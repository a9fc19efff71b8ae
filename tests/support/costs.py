"""The cost harness (issue 47): a real daemon attacked, route by route, by a tenant
sending the worst inputs its caps allow, and what each attack cost the daemon.

:func:`daemon_in_a_thread` serves a daemon with two token tenants (``a``, ``b``) on
an event loop of its own, in a thread of this process, so what it holds and how
long its loop runs without a break are measured apart from the tenants' clients:

- **memory**: the peak of Python's traced allocations (numpy's included) over an
  attack, less what was traced before it (:func:`traced_peak`). The bodies a client
  sends are built before, so what is left is the daemon's (and the few buffers of
  the client's answers). Shared-memory regions are not heap: the region caps count
  them.
- **loop stall**: the most CPU time the daemon's loop thread spends between two
  wake-ups of a 2 ms ticker on that loop (:class:`LoopStall`): the longest the loop
  served nothing else. It is read from the loop thread's own CPU clock, so another
  process's load on the host (a busy CI machine) does not count; only the daemon's
  own work does.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from support.daemons import InAThread, served_in_a_thread, token_file

__all__ = ["TOKENS", "InThread", "LoopStall", "daemon_in_a_thread", "traced_peak"]

TOKENS = {"a": "token-of-a", "b": "token-of-b"}
TICK_S = 0.002


class LoopStall:
    """On the daemon's loop: the most loop-thread CPU time between two ticks, s."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None
        self._last: float | None = None
        self._thread = threading.current_thread()

    def start(self) -> None:
        self._thread = threading.current_thread()
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def reset(self) -> None:
        self.longest = 0.0

    async def _tick(self) -> None:
        self._last = time.thread_time()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.thread_time()
            self.longest = max(self.longest, now - self._last)
            self._last = now

    def stop(self) -> None:
        """Stop ticking; on the loop's thread, the time since the last tick counts too
        (a stall just before ``stop`` whose tick has not run yet)."""
        if self._task is not None:
            self._task.cancel()
            if self._last is not None and threading.current_thread() is self._thread:
                self.longest = max(self.longest, time.thread_time() - self._last)


@dataclass(frozen=True)
class InThread(InAThread):
    """The daemon served in its thread (:class:`~support.daemons.InAThread`), and its
    loop's stall meter."""

    stall: LoopStall


@contextlib.contextmanager
def daemon_in_a_thread(
    tmp: Path, daemon: Callable[[], Daemon] | None = None, **settings: Any
) -> Iterator[InThread]:
    """A daemon (``daemon()``, else one of ``daemon_config(**settings)``) requiring the
    tokens of :data:`TOKENS`, served by a loop of its own in a thread for the block
    (:func:`~support.daemons.served_in_a_thread`), its stall meter ticking on it."""
    access = ServerConfig(port=0, token_file=token_file(tmp, TOKENS))
    with served_in_a_thread(daemon, access=access, **settings) as t:
        stall = LoopStall()
        t.call(stall.start)  # on the daemon's loop, which it meters
        try:
            yield InThread(t.served, t.loop, stall)
        finally:
            t.call(stall.stop)


@contextlib.contextmanager
def traced_peak() -> Iterator[list[int]]:
    """Trace allocations for the block; the list it yields holds, after it, the peak
    traced over the block less what was traced at its start (bytes)."""
    out: list[int] = []
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield out
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out.append(max(0, peak - base))
