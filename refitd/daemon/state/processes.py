"""Client processes the daemon's regions live with: watched with pidfds.

A client names itself when it creates or attaches a region (``process``, its
``<pid>.<start time>`` tag from :func:`transports.segments.owner_tag`). The daemon checks
that tag against the process it sees under that pid (same start time, so not a
reused pid, and not a process of another pid namespace), opens a pidfd on it and
watches it on the event loop. When the process exits — however it dies, ``os._exit``
and SIGKILL included — :class:`ProcessWatch` reports the tag once, and the daemon
releases that client's regions (:meth:`refitd.daemon.state.store.RegionStore.reap`).

A tag that does not match a visible process is not watched: such a region lives
until it is deleted (the client is in another pid namespace, or already gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from transports.segments import owner_tag

__all__ = ["ProcessWatch"]


class ProcessWatch:
    """Watch client processes; ``on_exit(tag)`` runs once when a watched one exits."""

    def __init__(self, on_exit: Callable[[str], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, tag: str) -> bool:
        """Start watching the process ``tag`` names; False if it is not visible here."""
        if tag in self._fds:
            return True
        pid_text, _, _ = tag.partition(".")
        if not pid_text.isdigit():
            return False
        pid = int(pid_text)
        if owner_tag(pid) != tag:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        if owner_tag(pid) != tag:  # the pid was reused between the check and the open
            os.close(fd)
            return False
        self._loop = asyncio.get_running_loop()
        self._fds[tag] = fd
        self._loop.add_reader(fd, self._exited, tag)
        return True

    def watching(self) -> list[str]:
        return sorted(self._fds)

    def _exited(self, tag: str) -> None:
        fd = self._fds.pop(tag, None)
        if fd is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)
        self._on_exit(tag)

    def close(self) -> None:
        for fd in self._fds.values():
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(fd)
            os.close(fd)
        self._fds.clear()
