"""systemd's notify protocol, the few lines of it refitd needs.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a Unix datagram socket path,
or ``@name`` for the abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC``
(and ``WATCHDOG_PID``). A state change is one datagram of ``KEY=VALUE`` lines.

Contract with the daemon's lifecycle:

- ``ready()`` only once the HTTP listener *and* the data plane are up: systemd
  orders dependants on it, so READY=1 must be true when sent;
- ``watchdog_loop()`` runs for the daemon's life and sends WATCHDOG=1 every half
  ``WATCHDOG_USEC`` (systemd's advice), so a wedged event loop is restarted;
- ``stopping()`` first thing on shutdown, before draining.

Without ``NOTIFY_SOCKET`` (not under systemd, or in tests) every call is a no-op
that returns False, so callers never branch on "am I under systemd".
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier"]


class Notifier:
    """Sends sd_notify datagrams; a no-op when ``NOTIFY_SOCKET`` is unset.

    ``env`` defaults to ``os.environ``; it is read once, here. Sending never raises:
    a lost notification must not take the daemon down (systemd then reports the
    start or the watchdog as failed, which is the truthful outcome).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        # "@name" is Linux's abstract namespace, spelt with a leading NUL on the wire.
        self._address: str | None = ("\0" + raw[1:] if raw.startswith("@") else raw) or None
        self._sock: socket.socket | None = None
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is for; a child that inherited
        # the environment must not ping on the parent's behalf.
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 2 / 1_000_000

    @property
    def enabled(self) -> bool:
        """True when running under a supervisor that listens for notifications."""
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; True if it was sent."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(assignments).encode(), self._address)
        except OSError:
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd the service is up (listener and data plane both serving)."""
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd shutdown has begun."""
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status refitd`` shows."""
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        """One keep-alive ping."""
        return self.notify("WATCHDOG=1")

    async def watchdog_loop(self) -> None:
        """Ping every half watchdog interval until cancelled; returns at once without one.

        Run it as a task of the daemon's TaskGroup: it pings only while the event
        loop runs, which is exactly what the watchdog should attest.
        """
        if self.watchdog_interval_s is None or not self.enabled:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(self.watchdog_interval_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
