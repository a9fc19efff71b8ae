"""``refitd serve`` as systemd runs it: a real child process, a real NOTIFY_SOCKET,
a real SIGTERM; plus the operator pieces wired into the real daemon app."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path

import aiohttp
import msgspec
import pytest
from support.daemons import served
from support.ops import serving_tenants
from support.toy import publish_tensor, pull_rows

from refitd.client.spawn import serve_command
from refitd.config import ServerConfig
from refitd.daemon.app.openapi import OPENAPI_PATH, documented_paths, route_table
from refitd.daemon.app.service import daemon_operations
from refitd.wire import ManifestIn, ShardEntry, TensorEntry

ROOT = Path(__file__).resolve().parents[2]


async def start_serve(*argv: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *serve_command(*argv),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
        cwd=ROOT,
    )


async def test_serve_notifies_ready_then_watchdog_then_stopping(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "200000"}
    proc = await start_serve("--port", "0", "--grace", "1", env=env)
    assert proc.stdout is not None
    messages: list[str] = []
    try:
        async with asyncio.timeout(60):
            ready_line = json.loads(await proc.stdout.readline())
            assert ready_line["event"] == "ready"
            # READY first, then watchdog pings (every 0.1 s here).
            while sum(m == "WATCHDOG=1" for m in messages) < 2:
                messages.append((await loop.sock_recv(sock, 4096)).decode())
            proc.send_signal(signal.SIGTERM)
            while not any(m.startswith("STOPPING=1") for m in messages):
                messages.append((await loop.sock_recv(sock, 4096)).decode())
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        sock.close()
    assert messages[0].startswith("READY=1\nSTATUS=serving http://127.0.0.1:")
    first_ping = messages.index("WATCHDOG=1")
    stopping = next(i for i, m in enumerate(messages) if m.startswith("STOPPING=1"))
    assert 0 < first_ping < stopping
    assert "draining pulls" in messages[stopping]


async def test_serve_refuses_a_non_loopback_bind_without_a_token_file() -> None:
    proc = await start_serve("--host", "0.0.0.0", "--port", "0", env={})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert out == b""
    assert b"refusing to start" in err and b"server.token_file" in err


async def test_serve_refuses_an_unknown_config_key_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "refitd.toml"
    config.write_text("[server]\nport = 0\nhots = '127.0.0.1'\n")
    proc = await start_serve("--config", str(config), env={})
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"server.hots: unknown key" in err


async def test_serve_logs_json_lines_when_asked(tmp_path: Path) -> None:
    proc = await start_serve("--port", "0", "--set", "logging.json=true", env={})
    assert proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            await proc.stdout.readline()
            line = await proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 60)
    record = json.loads(line)
    assert record["level"] == "info" and record["msg"].startswith("ready: serving")


async def test_every_daemon_route_is_documented_and_every_documented_route_exists() -> None:
    async with served(wired=True) as daemon, aiohttp.ClientSession() as s:
        async with s.get(daemon.url + OPENAPI_PATH) as resp:
            assert resp.status == 200
            doc = await resp.json()
        listed = set(documented_paths(doc))
        assert listed == set(route_table(daemon.app))
        # The schema table names exactly the routes the daemon has.
        assert set(daemon_operations()) == set(route_table(daemon.app))
        for method, path in sorted(listed):
            url = daemon.url + path.format(
                region_id="999",
                model="m",
                version="1",
                lease_id="nope",
                pull_id="nope",
                pool="nope",
            )
            async with s.request(method, url, params={"timeout": "0.01"}) as resp:
                # Reaching a handler: never the router's 405, and a 404 only as our JSON.
                assert resp.status != 405, (method, path)
                if resp.status == 404:
                    assert "error" in await resp.json(), (method, path)


async def test_the_wired_daemon_reports_its_state_in_metrics() -> None:
    async with served(wired=True) as daemon, aiohttp.ClientSession() as s:
        async with s.post(f"{daemon.url}/v1/regions", json={"nbytes": 4096}) as resp:
            region = await resp.json()
        shard = ShardEntry((0,), (1024,), region["region_id"], 0)
        manifest = ManifestIn("m", 1, 0, 1, [TensorEntry("w", (1024,), "float32", [shard])])
        async with s.post(f"{daemon.url}/v1/sources", data=msgspec.json.encode(manifest)) as resp:
            assert resp.status == 201
        async with s.post(f"{daemon.url}/v1/leases", json={"model": "m", "version": 1}) as resp:
            assert resp.status == 201
        async with s.get(f"{daemon.url}/v1/regions/12345") as resp:
            assert resp.status == 404
        async with s.get(f"{daemon.url}/metrics") as resp:
            text = await resp.text()
    assert 'refitd_regions{kind="host"} 1.0' in text
    assert 'refitd_registered_bytes{kind="host"} 4096.0' in text
    assert 'refitd_versions{state="ready"} 1.0' in text
    assert "refitd_leases 1.0" in text
    assert 'refitd_refusals_total{reason="NotFoundError"} 1.0' in text


async def test_the_wired_daemon_refuses_an_oversized_body_with_413() -> None:
    async with (
        served(wired=True, access=ServerConfig(port=0, max_request_bytes=1024)) as daemon,
        aiohttp.ClientSession() as s,
        s.post(f"{daemon.url}/v1/regions", data=b"{" + b" " * 2048 + b"}") as resp,
    ):
        assert resp.status == 413
        body = await resp.json()
    assert body["error"] == "RequestTooLarge"
    assert "server.max_request_bytes" in body["detail"]


async def test_a_completed_pull_is_counted_with_its_bytes_and_latency() -> None:
    from refitd.client.http import RefitClient

    async with served(wired=True) as daemon, RefitClient(daemon.url) as c:
        src = await c.create_region(4096, label="src")
        dst = await c.create_region(4096, label="dst")
        await publish_tensor(c, "m", 1, src.region_id, 4096, "float32")
        lease = await c.acquire_lease("m", 1)
        done = await c.pull(
            pull_rows("m", 1, lease.lease_id, (src.region_id, 0, dst.region_id, 0, 3000))
        )
        assert done.bytes_done == 3000
        async with aiohttp.ClientSession() as s, s.get(f"{daemon.url}/metrics") as resp:
            text = await resp.text()
    assert 'refitd_pulled_bytes_total{transport="shm"} 3000.0' in text
    assert 'refitd_pulls_total{outcome="done"} 1.0' in text
    assert 'refitd_pull_duration_seconds_count{outcome="done"} 1.0' in text


async def test_on_the_daemon_a_token_holder_touches_only_its_own_regions(tmp_path: Path) -> None:
    from refitd.client.http import RefitClient
    from refitd.errors import RefitError

    tenants = {"trainer": "t-secret", "engine": "e-secret"}
    async with (
        serving_tenants(tmp_path, tenants) as (daemon, c),
        RefitClient(daemon.url) as anonymous,
    ):
        trainer, engine = c["trainer"], c["engine"]
        src = await trainer.create_region(4096)
        assert src.owner == "trainer"
        dst = await engine.create_region(4096)
        assert dst.owner == "engine"
        await publish_tensor(trainer, "m", 1, src.region_id, 4096, "float32")
        lease = await engine.acquire_lease("m", 1)
        # The trainer may not pull into the engine's region, nor delete it.
        into_engine = pull_rows("m", 1, lease.lease_id, (src.region_id, 0, dst.region_id, 0, 64))
        with pytest.raises(RefitError, match=f"trainer may not write region {dst.region_id}"):
            await trainer.submit_pull(into_engine)
        with pytest.raises(RefitError, match=f"trainer may not delete region {dst.region_id}"):
            await trainer.delete_region(dst.region_id)
        # The engine may: its region, the trainer's published version under its lease.
        done = await engine.pull(into_engine)
        assert done.bytes_done == 64
        with pytest.raises(
            RefitError, match=r"GET /v1/regions needs 'Authorization: Bearer TOKEN'"
        ):
            await anonymous.regions()
        assert (await engine.delete_region(dst.region_id)).region_id == dst.region_id
