"""``/metrics`` tells a tenant no more than the API does: another tenant's expert-pool
names, which ``GET /v1/experts`` hides, are not in the scrape either.

A real daemon in this process on 127.0.0.1:0 with two tokens, wired as ``refitd
serve`` wires it (its metrics and access control among the rest).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from support.daemons import daemon_config, served, token_file

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon

pytestmark = pytest.mark.timeout(60)


async def scrape(url: str, token: str) -> str:
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics", headers=headers) as r:
        assert r.status == 200
        return await r.text()


async def test_a_scrape_shows_only_the_scrapers_own_expert_pools(tmp_path: Path) -> None:
    tokens = token_file(tmp_path, {"a": "token-of-a", "b": "token-of-b"})
    access = ServerConfig(port=0, token_file=tokens)
    opts = daemon_config(node_id="metrics", transport="shm", max_bytes=1 << 30)
    async with (
        served(Daemon(opts), access=access, wired=True) as s,
        RefitClient(s.url, token="token-of-a") as a,
        RefitClient(s.url, token="token-of-b") as b,
    ):
        url = s.url
        await a.create_pool("pool-of-a", layers=1, experts=2, slots=2, row_bytes=[16])
        await b.create_pool("pool-of-b", layers=1, experts=2, slots=2, row_bytes=[16])
        seen_by_b = await scrape(url, "token-of-b")
        assert "pool-of-a" not in seen_by_b
        assert 'pool="pool-of-b"' in seen_by_b
        seen_by_a = await scrape(url, "token-of-a")
        assert 'pool="pool-of-a"' in seen_by_a and "pool-of-b" not in seen_by_a
        # what the daemon holds on its own behalf is visible: its mirrors and their budget
        assert "refitd_mirror_bytes 0.0" in seen_by_a
        assert "refitd_mirror_budget_bytes " in seen_by_a
