"""Prometheus metrics for one daemon, served at ``GET /metrics``.

Each app gets its own :class:`prometheus_client.CollectorRegistry` (never the
process-global one), so a test that runs several daemons in one process sees each
daemon's numbers apart and nothing collides.

Two kinds of numbers:

- **events** the daemon reports as they happen: :meth:`Metrics.pull_finished`
  (told by :class:`PullMetrics`, a listener on the daemon's pulls)
  (bytes by transport, pulls by outcome, the latency histogram) and
  :meth:`Metrics.refused`. Refusals returned as HTTP errors are also counted
  automatically by the middleware (reason = the ``error`` field of the JSON body,
  i.e. the RefitError class name, or ``http_<status>``), so handlers need not.
- **state** read at scrape time from a callback the daemon binds once with
  :meth:`Metrics.bind_state`, returning a :class:`StateSnapshot`: region counts
  and registered bytes, versions by state, leases, pulls in flight, expert pools.
  Reading at scrape time means no gauge can drift from the daemon's own records.

Integration (one line in the app factory)::

    metrics = setup_metrics(app)          # adds /metrics and the counting middleware
    metrics.bind_state(lambda: snapshot)  # once the daemon's state object exists
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from refitd.daemon.pull.listeners import Job, PullListener
from refitd.wire import PoolStats
from refitd.wire import routes as api

__all__ = [
    "METRICS_KEY",
    "PULL_SECONDS_BUCKETS",
    "Metrics",
    "PoolStats",
    "PullMetrics",
    "StateSnapshot",
    "setup_metrics",
]

log = logging.getLogger(__name__)

#: Pull latency buckets, seconds: a small same-host pull takes milliseconds, a full
#: refit of a large model over RDMA seconds to a minute.
PULL_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class StateSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The daemon's state at one instant, for the gauges. Bytes are bytes."""

    #: memory kind (``"host"``, ``"cuda"``: a ``MemoryKind``) -> number of regions
    regions: dict[str, int] = {}
    #: memory kind -> bytes registered with the data plane
    registered_bytes: dict[str, int] = {}
    #: version state (``"pending"``, ``"ready"``, ``"retired"``) -> number of versions
    versions: dict[str, int] = {}
    leases: int = 0
    pulls_in_flight: int = 0
    pools: list[PoolStats] = []
    #: bytes this daemon's host mirrors hold, and what they may hold together
    mirror_bytes: int = 0
    mirror_budget_bytes: int = 0


StateSource = Callable[[], StateSnapshot]


class _StateCollector:
    """Turns the bound :class:`StateSnapshot` into gauge families at scrape time."""

    def __init__(self) -> None:
        self.source: StateSource | None = None

    def describe(self) -> Iterable[Metric]:
        # Nothing up front: the families depend on the state (pools come and go).
        return []

    def collect(self) -> Iterable[Metric]:
        if self.source is None:
            return
        snap = self.source()
        regions = GaugeMetricFamily("refitd_regions", "Regions by kind.", labels=["kind"])
        for kind, n in sorted(snap.regions.items()):
            regions.add_metric([kind], n)
        yield regions
        registered = GaugeMetricFamily(
            "refitd_registered_bytes",
            "Bytes of region memory registered with the data plane, by memory kind.",
            labels=["kind"],
        )
        for kind, n in sorted(snap.registered_bytes.items()):
            registered.add_metric([kind], n)
        yield registered
        versions = GaugeMetricFamily(
            "refitd_versions", "Model versions by state.", labels=["state"]
        )
        for state, n in sorted(snap.versions.items()):
            versions.add_metric([state], n)
        yield versions
        yield GaugeMetricFamily("refitd_leases", "Leases held on versions.", value=snap.leases)
        yield GaugeMetricFamily(
            "refitd_pulls_in_flight", "Pulls accepted and not finished.", value=snap.pulls_in_flight
        )
        yield GaugeMetricFamily(
            "refitd_mirror_bytes", "Bytes host mirrors hold.", value=snap.mirror_bytes
        )
        yield GaugeMetricFamily(
            "refitd_mirror_budget_bytes",
            "Bytes host mirrors may hold together ([mirrors] max_bytes).",
            value=snap.mirror_budget_bytes,
        )
        if not snap.pools:
            return
        labels = ["pool"]
        gauges = {
            "layers": GaugeMetricFamily("refitd_expert_pool_layers", "MoE layers.", labels=labels),
            "slots": GaugeMetricFamily(
                "refitd_expert_pool_slots", "GPU expert slots in the pool.", labels=labels
            ),
            "occupied_slots": GaugeMetricFamily(
                "refitd_expert_pool_occupied_slots", "Slots holding an expert.", labels=labels
            ),
        }
        counters = {
            "hits": CounterMetricFamily(
                "refitd_expert_pool_hits", "Routed experts already resident.", labels=labels
            ),
            "misses": CounterMetricFamily(
                "refitd_expert_pool_misses",
                "Routed experts that had to be copied in.",
                labels=labels,
            ),
            "evictions": CounterMetricFamily(
                "refitd_expert_pool_evictions", "Experts evicted from a slot.", labels=labels
            ),
            "copied_bytes": CounterMetricFamily(
                "refitd_expert_pool_copied_bytes", "Bytes copied into slots.", labels=labels
            ),
            "stale_invalidations": CounterMetricFamily(
                "refitd_expert_pool_stale_invalidations",
                "Slots invalidated because a refit rewrote their expert.",
                labels=labels,
            ),
        }
        for pool in snap.pools:
            for name, family in gauges.items():
                family.add_metric([pool.pool], getattr(pool, name))
            for name, cfamily in counters.items():
                cfamily.add_metric([pool.pool], getattr(pool, name))
        yield from gauges.values()
        yield from counters.values()


class Metrics:
    """One daemon's metrics and the registry that holds them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.pulled_bytes = Counter(
            "refitd_pulled_bytes",
            "Bytes moved by completed pulls, by transport.",
            ["transport"],
            registry=self.registry,
        )
        self.pulls = Counter(
            "refitd_pulls",
            "Pulls finished, by outcome (done, failed, cancelled).",
            ["outcome"],
            registry=self.registry,
        )
        self.pull_seconds = Histogram(
            "refitd_pull_duration_seconds",
            "Wall time of a pull from acceptance to its last byte, seconds.",
            ["outcome"],
            buckets=PULL_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.refusals = Counter(
            "refitd_refusals",
            "Requests refused, by reason (RefitError class or http_<status>).",
            ["reason"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "refitd_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self._state = _StateCollector()
        self.registry.register(self._state)

    def pull_finished(self, *, transport: str, outcome: str, nbytes: int, seconds: float) -> None:
        """Record one finished pull: ``nbytes`` bytes actually moved, ``seconds`` wall time."""
        self.pulls.labels(outcome).inc()
        self.pull_seconds.labels(outcome).observe(seconds)
        if nbytes:
            self.pulled_bytes.labels(transport).inc(nbytes)

    def refused(self, reason: str) -> None:
        """Count a refusal that is not an HTTP error response (those count themselves)."""
        self.refusals.labels(reason).inc()

    def bind_state(self, source: StateSource) -> None:
        """Read gauges from ``source()`` at every scrape. It must be cheap and not block."""
        self._state.source = source

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


METRICS_KEY = web.AppKey("refitd_metrics", Metrics)


class PullMetrics(PullListener):
    """Records every pull of a daemon when it ends: its outcome, its wall time and
    the bytes it moved, by the path it took (``job.path``), in the :class:`Metrics`
    ``metrics()`` returns then (None: the app has none, nothing is recorded)."""

    def __init__(self, metrics: Callable[[], Metrics | None]) -> None:
        self.metrics = metrics

    def ended(self, job: Job) -> None:
        metrics = self.metrics()
        if metrics is None:
            return
        ended = job.ended if job.ended is not None else job.started
        metrics.pull_finished(
            transport=job.path,
            outcome=str(job.state),
            nbytes=int(job.bytes_done),
            seconds=max(0.0, ended - job.started),
        )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route_label(request: web.Request) -> str:
    # The template, never the concrete path: ids in paths would explode cardinality.
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _reason(response: web.StreamResponse) -> str:
    body = getattr(response, "body", None)
    if isinstance(body, bytes) and body[:1] == b"{":
        try:
            error = msgspec.json.decode(body).get("error")
        except (msgspec.DecodeError, AttributeError):
            error = None
        if isinstance(error, str) and error:
            return error
    return f"http_{response.status}"


def _middleware(metrics: Metrics) -> Middleware:
    @web.middleware
    async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            _count(metrics, request, exc)
            raise
        _count(metrics, request, response)
        return response

    return count_requests


def _count(metrics: Metrics, request: web.Request, response: web.StreamResponse) -> None:
    route = _route_label(request)
    metrics.http_requests.labels(request.method, route, str(response.status)).inc()
    if response.status >= 400:
        metrics.refusals.labels(_reason(response)).inc()


#: the scrape request, while a scrape renders: the state callback reads who asks, so
#: a principal sees in ``/metrics`` no more than the API shows it (its own pools)
SCRAPE: contextvars.ContextVar[web.Request | None] = contextvars.ContextVar(
    "refitd_scrape", default=None
)


async def _serve_metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this daemon's metrics, as the caller may see them."""
    token = SCRAPE.set(request)
    try:
        body = request.app[METRICS_KEY].render()
    finally:
        SCRAPE.reset(token)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


def setup_metrics(app: web.Application, metrics: Metrics | None = None) -> Metrics:
    """Give ``app`` its own :class:`Metrics`, ``GET /metrics`` and the counting middleware.

    Call before the app starts (middlewares freeze then). The middleware is put
    first, outermost, so it sees the final status of every response, including
    the JSON error bodies the error middleware makes from exceptions.
    """
    metrics = metrics or Metrics()
    app[METRICS_KEY] = metrics
    app.middlewares.insert(0, _middleware(metrics))
    app.router.add_get(api.METRICS.path, _serve_metrics, name="metrics")
    return metrics
