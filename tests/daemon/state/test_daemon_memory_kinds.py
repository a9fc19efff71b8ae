"""A daemon speaks one spelling of a memory kind (``host``, ``cuda``), over real HTTP.

A client of an older build that sends a region kind the wire once spelled ``shm`` or
``cuda_ipc`` is refused (400, ``ProtocolError``) by value and field, and nothing is
made; a region the daemon records is listed under the memory kind its transports
compare (the ``/metrics`` label: tests/ops/test_ops_serve.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from support.daemons import Served, served

from refitd.memory_kinds import MemoryKind


@pytest.fixture
async def daemon() -> AsyncIterator[Served]:
    async with served(node_id="kinds", transport="shm") as s:
        yield s


async def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize(("path", "old"), [("regions", "shm"), ("regions/attach", "cuda_ipc")])
async def test_an_old_spelling_of_a_regions_kind_is_refused_and_nothing_is_made(
    daemon: Served, path: str, old: str
) -> None:
    body: dict[str, object] = {"nbytes": 4096, "kind": old, "handle": "refitd.none"}
    if path == "regions":
        del body["handle"]
    status, answer = await _post(f"{daemon.url}/v1/{path}", body)
    assert status == 400 and answer["error"] == "ProtocolError", answer
    assert f"'{old}'" in answer["detail"] and "$.kind" in answer["detail"], answer
    assert await daemon.client.regions() == []


async def test_a_region_is_made_and_listed_under_its_memory_kind(daemon: Served) -> None:
    status, made = await _post(f"{daemon.url}/v1/regions", {"nbytes": 4096, "kind": "host"})
    assert status == 201 and made["kind"] == "host", made
    (listed,) = await daemon.client.regions()
    assert listed.kind is MemoryKind.HOST
    assert daemon.daemon.store.segments[listed.region_id].kind is listed.kind
