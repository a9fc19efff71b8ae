"""Prometheus metrics served by a real aiohttp app on loopback."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from support.daemons import serving_app

from refitd.daemon.app.handlers import error_middleware
from refitd.daemon.app.metrics import METRICS_KEY, Metrics, PoolStats, StateSnapshot, setup_metrics
from refitd.errors import ConflictError


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def stale(request: web.Request) -> web.Response:
    raise ConflictError("version 3 of m was retired while you read it")


async def plain(request: web.Request) -> web.Response:
    return web.Response(status=404, text="not in our error shape")


def small_app() -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/v1/regions/{region_id}", ok)
    app.router.add_post("/v1/stale", stale)
    app.router.add_get("/v1/plain", plain)
    setup_metrics(app)
    return app


async def scrape(session: aiohttp.ClientSession, base: str) -> dict:  # type: ignore[type-arg]
    async with session.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        return samples(await resp.text())


async def test_pulls_are_counted_by_transport_outcome_and_latency() -> None:
    app = small_app()
    app[METRICS_KEY].pull_finished(transport="ucx", outcome="done", nbytes=4096, seconds=0.003)
    app[METRICS_KEY].pull_finished(transport="ucx", outcome="done", nbytes=1024, seconds=0.2)
    app[METRICS_KEY].pull_finished(transport="ucx", outcome="failed", nbytes=0, seconds=1.5)
    async with serving_app(app) as base, aiohttp.ClientSession() as session:
        got = await scrape(session, base)
    assert got[("refitd_pulled_bytes_total", (("transport", "ucx"),))] == 5120
    assert got[("refitd_pulls_total", (("outcome", "done"),))] == 2
    assert got[("refitd_pulls_total", (("outcome", "failed"),))] == 1
    assert got[("refitd_pull_duration_seconds_count", (("outcome", "done"),))] == 2
    bucket = ("refitd_pull_duration_seconds_bucket", (("le", "0.005"), ("outcome", "done")))
    assert got[bucket] == 1


async def test_error_responses_count_as_refusals_by_error_class() -> None:
    app = small_app()
    async with serving_app(app) as base, aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v1/stale") as resp:
            assert resp.status == 409
        async with session.get(f"{base}/v1/regions/r7") as resp:
            assert resp.status == 200
        async with session.get(f"{base}/nope") as resp:
            assert resp.status == 404
        async with session.get(f"{base}/v1/plain") as resp:
            assert resp.status == 404
        got = await scrape(session, base)
    assert got[("refitd_refusals_total", (("reason", "ConflictError"),))] == 1
    # No route: the daemon's error middleware refuses it in its shape, as NotFoundError.
    assert got[("refitd_refusals_total", (("reason", "NotFoundError"),))] == 1
    # A refusal not in the error shape is counted by its status.
    assert got[("refitd_refusals_total", (("reason", "http_404"),))] == 1
    # Route templates, not concrete ids, label requests.
    key = (("method", "GET"), ("route", "/v1/regions/{region_id}"), ("status", "200"))
    assert got[("refitd_http_requests_total", key)] == 1


async def test_state_gauges_are_read_from_the_bound_snapshot_at_scrape_time() -> None:
    app = small_app()
    state = {"leases": 1}
    app[METRICS_KEY].bind_state(
        lambda: StateSnapshot(
            regions={"host": 3},
            registered_bytes={"host": 3 << 20},
            versions={"ready": 1, "pending": 2},
            leases=state["leases"],
            pools=[PoolStats(pool="moe", layers=2, slots=8, occupied_slots=5, hits=10, misses=4)],
        )
    )
    async with serving_app(app) as base, aiohttp.ClientSession() as session:
        first = await scrape(session, base)
        state["leases"] = 4
        second = await scrape(session, base)
    assert first[("refitd_regions", (("kind", "host"),))] == 3
    assert first[("refitd_registered_bytes", (("kind", "host"),))] == 3 << 20
    assert first[("refitd_versions", (("state", "pending"),))] == 2
    assert first[("refitd_leases", ())] == 1
    assert second[("refitd_leases", ())] == 4
    assert first[("refitd_expert_pool_occupied_slots", (("pool", "moe"),))] == 5
    assert first[("refitd_expert_pool_misses_total", (("pool", "moe"),))] == 4


async def test_pool_metrics_appear_only_when_pools_exist() -> None:
    metrics = Metrics()
    metrics.bind_state(lambda: StateSnapshot())
    assert b"refitd_expert_pool" not in metrics.render()
    assert b"refitd_leases 0.0" in metrics.render()


def test_two_daemons_in_one_process_keep_separate_numbers() -> None:
    a, b = Metrics(), Metrics()
    a.refused("ConflictError")
    assert b'refitd_refusals_total{reason="ConflictError"} 1.0' in a.render()
    assert b"ConflictError" not in b.render()


def test_pool_stats_are_built_from_the_expert_planner_and_executor_counters() -> None:
    from refitd.experts.cache import CacheStats
    from refitd.experts.slots import SlotStats

    stats = PoolStats.from_pool(
        "moe",
        layers=4,
        slots=16,
        occupied_slots=9,
        cache=CacheStats(steps=3, routes=12, hits=7, misses=5, evictions=2),
        executor=SlotStats(plans=3, host_rows=5, host_bytes=5 << 20, device_bytes=1 << 20),
    )
    metrics = Metrics()
    metrics.bind_state(lambda: StateSnapshot(pools=[stats]))
    text = metrics.render().decode()
    assert 'refitd_expert_pool_hits_total{pool="moe"} 7.0' in text
    assert 'refitd_expert_pool_evictions_total{pool="moe"} 2.0' in text
    assert 'refitd_expert_pool_copied_bytes_total{pool="moe"} 6.291456e+06' in text
    assert 'refitd_expert_pool_occupied_slots{pool="moe"} 9.0' in text
