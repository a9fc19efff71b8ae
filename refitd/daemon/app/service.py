"""The daemon as an operated service: configuration, access control, metrics, the API
document, systemd notifications and logs, assembled around the app in one place.

``refitd serve`` builds one :class:`Service` from the loaded :class:`~refitd.config.Config`
and hands its hooks to :func:`refitd.daemon.app.process.serve`:

- ``setup(app)`` (a ``create_app`` setup hook) installs the metrics middleware and
  ``/metrics``, the access middleware, ``/v1/openapi.json``, and a task that pings
  the systemd watchdog from READY until the app is cleaned up;
- ``on_ready(record)`` sends READY=1 — serve calls it only once the listener and the
  data plane are both up;
- ``on_stopping()`` sends STOPPING=1 before the drain starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import IO, Any

from aiohttp import web

from refitd.config import Config, LoggingConfig, resolve_group
from refitd.daemon.access.auth import AccessPolicy, principal_of, setup_auth
from refitd.daemon.app.metrics import StateSnapshot, setup_metrics
from refitd.daemon.app.openapi import Operation, operations_of, setup_openapi
from refitd.daemon.app.sdnotify import Notifier
from refitd.wire import PoolStats
from refitd.wire.routes import ROUTES

__all__ = [
    "Service",
    "configure_logging",
    "daemon_operations",
    "share_memory_with",
]

log = logging.getLogger("refitd")


class _JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UNIX seconds), level, logger, msg, and exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(cfg: LoggingConfig, stream: IO[str] | None = None) -> None:
    """Send refitd's (and aiohttp's) logs to ``stream`` (stderr), as text or JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if cfg.json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.level.upper())


def daemon_operations() -> dict[tuple[str, str], Operation]:
    """The body schemas of every route the daemon serves, for the API document: its
    route table (:data:`refitd.wire.routes.ROUTES`), where each is declared once."""
    return operations_of(ROUTES)


def _snapshot(app: web.Application) -> StateSnapshot:
    from refitd.daemon.app.handlers import DAEMON, PULLS
    from refitd.daemon.mirror.routes import MIRRORS
    from refitd.wire import PullState

    daemon = app[DAEMON]
    regions: dict[str, int] = {}
    registered: dict[str, int] = {}
    for region in daemon.store.regions:
        kind = str(region.kind)
        regions[kind] = regions.get(kind, 0) + 1
        # Regions are registered with the data plane whole, once.
        registered[kind] = registered.get(kind, 0) + region.nbytes
    versions: dict[str, int] = {}
    leases = 0
    for info in daemon.registry.versions():
        versions[str(info.state)] = versions.get(str(info.state), 0) + 1
        leases += info.leases
    running = (PullState.PENDING, PullState.RUNNING)
    in_flight = sum(1 for job in app[PULLS].jobs.values() if job.state in running)
    from refitd.daemon.app.metrics import SCRAPE

    scrape = SCRAPE.get()
    who = principal_of(scrape) if scrape is not None else None

    def scraper_sees(owner: str) -> bool:
        # as the API's listings decide (a scrape outside a request: the daemon's own)
        return who is None or who.sees(owner)

    from refitd.daemon.experts.pools import POOLS

    pools: list[PoolStats] = app[POOLS].stats(scraper_sees) if POOLS in app else []
    return StateSnapshot(
        regions=regions,
        registered_bytes=registered,
        versions=versions,
        leases=leases,
        pulls_in_flight=in_flight,
        pools=pools,
        mirror_bytes=app[MIRRORS].held_bytes() if MIRRORS in app else 0,
        mirror_budget_bytes=app[MIRRORS].budget if MIRRORS in app else 0,
    )


def share_memory_with(group: str | None) -> None:
    """Create (and accept) shared-memory segments for ``group``, or 0600 when None.

    Process-wide, through the variable ``transports.segments`` reads, so the worker
    processes the data plane starts later inherit it.
    """
    from transports.segments import GROUP_ENV

    if group is None:
        os.environ.pop(GROUP_ENV, None)
    else:
        os.environ[GROUP_ENV] = str(resolve_group(group))


class Service:
    """The operator-facing hooks of one daemon process."""

    def __init__(
        self, config: Config, policy: AccessPolicy, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.policy = policy
        self.notifier = notifier or Notifier()
        self._ready = asyncio.Event()

    @property
    def ready_sent(self) -> bool:
        """Whether READY was reported (a later failure is not a failed start)."""
        return self._ready.is_set()

    def setup(self, app: web.Application) -> None:
        """``create_app`` setup hook: metrics, access control, the API document, and
        the group shared memory is shared with (``server.shm_group``)."""
        share_memory_with(self.config.server.shm_group)
        if self.config.metrics.enabled:
            metrics = setup_metrics(app)
            metrics.bind_state(lambda: _snapshot(app))
        setup_auth(app, self.policy)
        setup_openapi(app, daemon_operations())
        app.cleanup_ctx.append(self._watchdog)

    async def _watchdog(self, app: web.Application) -> AsyncIterator[None]:
        async def ping_after_ready() -> None:
            await self._ready.wait()
            await self.notifier.watchdog_loop()

        task = asyncio.create_task(ping_after_ready(), name="refitd-watchdog")
        try:
            yield
        finally:
            task.cancel("daemon shutting down")
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.notifier.close()

    def on_ready(self, record: dict[str, Any]) -> None:
        """READY=1, once serve has the listener and the data plane both up."""
        where = record.get("url", "")
        if record.get("unix"):
            where += f" and {record['unix']}"
            # Anyone may connect; the peer's uid (SO_PEERCRED) decides who is served.
            # Under the unit's UMask the socket would otherwise admit only our own user.
            os.chmod(record["unix"], 0o666)
        self.notifier.ready(f"serving {where}")
        self._ready.set()
        log.info("ready: serving %s (node %s)", where, record.get("node_id", ""))
        from transports.segments import SHM_DIR, huge_page_mode

        mode = huge_page_mode()
        if mode in ("never", "deny"):
            log.info(
                "shared memory: %s is mounted huge=%s, so regions get 4 KiB pages; same-host "
                "UCX pulls from them move about half as much per thread as from huge pages "
                "(systemd/refitd-shm-huge.service remounts it huge=advise)",
                SHM_DIR,
                mode,
            )

    def on_stopping(self) -> None:
        """STOPPING=1, before serve stops accepting and drains pulls."""
        grace = self.config.pulls.shutdown_grace_s
        self.notifier.stopping(f"draining pulls for up to {grace:g} s")
        log.info("stopping: draining in-flight pulls for up to %g s", grace)
