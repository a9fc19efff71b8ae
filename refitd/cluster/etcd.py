"""The ``etcd`` cluster registry, through the maintained asyncio client ``aetcd``.

One supervisor task per daemon runs *sessions*. A session connects to one of the
endpoints, grants a lease of ``ttl_s`` seconds, writes this daemon's record and every
source record it publishes under that lease, loads the whole prefix into the
:class:`~refitd.cluster.directory.Directory`, then watches the prefix from the
snapshot's revision on while refreshing the lease every third of its TTL. Any
failure (etcd down or restarted, the lease gone, the watch stream broken) ends the
session; the next one starts after a short backoff and registers again, so a daemon
re-registers after an etcd restart without an operator. While etcd is unreachable
the directory keeps its last view.

A daemon that dies stops refreshing: etcd drops its keys when the lease expires
(within ``ttl_s``), every watcher sees the deletes, and their daemons fail the pulls
reading from it (see ``PullManager.fail_source``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import urlsplit

from refitd.cluster.registry import ClusterRegistry
from refitd.errors import ConfigError, TransportError
from refitd.wire import DaemonRecord, SourceRecord

__all__ = ["EtcdRegistry", "parse_endpoint"]

log = logging.getLogger("refitd.cluster")

BACKOFF_S = (0.2, 0.5, 1.0, 2.0)
"""Waits between failed sessions (the last one repeats)."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``) -> ``(host, port)``; TLS is not
    supported by this registry yet, so ``https`` is refused."""
    parts = urlsplit(endpoint if "//" in endpoint else f"http://{endpoint}")
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(
            f"registry.endpoints: {endpoint!r} refused; expected http://HOST:PORT "
            "(plain gRPC; TLS endpoints are not supported yet)"
        )
    return parts.hostname, parts.port or 2379


class _LeaseLost(Exception):
    """etcd no longer knows our lease (it restarted without its data, or we were
    partitioned longer than the TTL): register again."""


class EtcdRegistry(ClusterRegistry):
    kind = "etcd"

    def __init__(
        self,
        endpoints: list[str],
        prefix: str,
        secret: bytes,
        *,
        ttl_s: float = 10.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(prefix, secret)
        if not endpoints:
            raise ConfigError("registry.kind is 'etcd' but registry.endpoints is empty")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.ttl_s = max(2.0, ttl_s)
        self.start_timeout_s = start_timeout_s
        self._client: object | None = None  # aetcd.Client of the live session
        self._lease_id: int | None = None
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        #: held while this daemon's keys are written (a session's re-registration, or
        #: a publish), so a withdrawn key is never written back by the other
        self._lock = asyncio.Lock()
        self.registrations = 0  # sessions that registered (1 + re-registrations)
        self.last_error = ""

    # ------------------------------------------------------------ lifecycle

    async def start(self, me: DaemonRecord) -> None:
        """Register and load the directory; :class:`TransportError` if no endpoint
        answers within ``start_timeout_s`` (the daemon then does not start)."""
        self.me = me
        self._task = asyncio.create_task(self._supervise(), name="refitd-etcd")
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await self._registered.wait()
        except TimeoutError:
            await self.close()
            where = ", ".join(f"{h}:{p}" for h, p in self.endpoints)
            raise TransportError(
                f"etcd registry at {where} did not accept this daemon's registration in "
                f"{self.start_timeout_s:g} s: {self.last_error or 'no answer'}"
            ) from None

    async def close(self) -> None:
        """Stop the session and revoke the lease, so this daemon's keys go now."""
        self._closing = True
        if self._task is not None:
            self._task.cancel("daemon shutting down")
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._changed.set()

    @property
    def connected(self) -> bool:
        return self._client is not None

    # ------------------------------------------------------------ sessions

    async def _supervise(self) -> None:
        import aetcd
        import grpc

        failures = 0
        while not self._closing:
            host, port = self.endpoints[failures % len(self.endpoints)]
            try:
                await self._session(host, port)
                failures = 0
            except (aetcd.exceptions.ClientError, grpc.RpcError, OSError, _LeaseLost) as exc:
                self.last_error = f"{host}:{port}: {type(exc).__name__}: {exc}"
                if self._registered.is_set():
                    log.warning("etcd registry session ended (%s); registering again", exc)
                failures += 1
            finally:
                self._client = self._lease_id = None
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])

    async def _session(self, host: str, port: int) -> None:
        import aetcd

        timeout = max(1, int(self.ttl_s / 3))
        async with aetcd.Client(host, port, timeout=timeout) as c:
            lease = await c.lease(int(self.ttl_s))
            key, value = self._me_item()
            async with self._lock:  # a publish meanwhile waits, then writes itself
                await c.put(key.encode(), value, lease=lease.id)
                for k, v in self._mine.items():
                    await c.put(k.encode(), v, lease=lease.id)
                self._client, self._lease_id = c, lease.id
            snap = await c.get_prefix(f"{self.prefix}/".encode())
            self._apply(
                self.directory.replace((kv.key.decode(), bytes(kv.value)) for kv in snap.kvs)
            )
            watch = await c.watch_prefix(
                f"{self.prefix}/".encode(), start_revision=snap.header.revision + 1
            )
            self.registrations += 1
            self._registered.set()
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._keepalive(c, lease.id))
                    tg.create_task(self._consume(watch))
            except BaseExceptionGroup as group:
                raise group.exceptions[0] from None
            finally:
                with contextlib.suppress(Exception):
                    await watch.cancel()
                if self._closing:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(2):
                            await c.revoke_lease(lease.id)

    async def _keepalive(self, c: object, lease_id: int) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            reply = await c.refresh_lease(lease_id)  # type: ignore[attr-defined]
            if reply is None or reply.TTL <= 0:
                raise _LeaseLost(f"lease {lease_id:x} is gone from etcd")

    async def _consume(self, watch: object) -> None:
        async for event in watch:  # type: ignore[attr-defined]
            key = event.kv.key.decode()
            if event.kind == "PUT":
                self._apply(self.directory.put(key, bytes(event.kv.value)))
            else:
                self._apply(self.directory.delete(key))
        raise _LeaseLost("the watch stream ended")

    # ------------------------------------------------------------ publishing

    async def publish(self, model: str, records: list[SourceRecord]) -> None:
        """Write this daemon's records of ``model`` (and delete withdrawn ones) under
        the live lease; while disconnected they are kept and written on the next
        registration. The directory sees them through the watch, like everyone's."""
        import aetcd
        import grpc

        async with self._lock:
            want, stale = self._diff(model, records)
            c, lease = self._client, self._lease_id
            if c is None:
                return
            try:
                for key in stale:
                    await c.delete(key.encode())  # type: ignore[attr-defined]
                for key, value in want.items():
                    await c.put(key.encode(), value, lease=lease)  # type: ignore[attr-defined]
            except (aetcd.exceptions.ClientError, grpc.RpcError) as exc:
                # The session is failing too: it will write everything in _mine again.
                log.warning(
                    "publishing %s to etcd deferred to the next registration: %s", model, exc
                )
