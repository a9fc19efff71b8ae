"""A wire field that was renamed is refused under its old name, over real HTTP.

The region requests' ``holder`` is now ``process``: a client of an older build that
still sends ``holder`` gets a 400 (``ProtocolError``) naming that field, and nothing is
made. Silently dropping it would make a region that no process is bound to, one that
outlives its client (``RegionCreate``/``RegionAttach`` forbid unknown fields). A lease
request's ``holder`` is now ``label`` and is refused the same way (``LeaseRequest``).
A manifest's ``slot``/``expected_slots`` are now ``part``/``expected_parts`` (a
publisher's part of a version; a slot is an expert pool's): a publish still naming
either is refused and no version is recorded (``ManifestIn`` forbids unknown fields).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from support.daemons import Served, served

from transports.segments import owner_tag


@pytest.fixture
async def daemon() -> AsyncIterator[Served]:
    async with served(node_id="renamed", transport="shm") as s:
        yield s


async def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("path", ["regions", "regions/attach"])
async def test_a_region_request_naming_its_process_holder_is_refused_and_nothing_is_made(
    daemon: Served, path: str
) -> None:
    body: dict[str, object] = {"nbytes": 4096, "holder": owner_tag()}
    if path == "regions/attach":
        body["handle"] = "refitd.none"
    status, answer = await _post(f"{daemon.url}/v1/{path}", body)
    assert status == 400 and answer["error"] == "ProtocolError", answer
    assert "holder" in answer["detail"], answer
    assert await daemon.client.regions() == []


async def test_a_region_made_with_its_process_is_bound_to_it(daemon: Served) -> None:
    tag = owner_tag()
    status, made = await _post(f"{daemon.url}/v1/regions", {"nbytes": 4096, "process": tag})
    assert status == 201 and made["process"] == tag, made
    assert tag in daemon.daemon.store.processes.watching()


async def test_a_lease_request_naming_its_reader_holder_is_refused(daemon: Served) -> None:
    body = {"model": "m", "version": 1, "holder": "receiver"}
    status, answer = await _post(f"{daemon.url}/v1/leases", body)
    # 400 for the field, not 404 for the version this daemon has never heard of
    assert status == 400 and answer["error"] == "ProtocolError", answer
    assert "holder" in answer["detail"], answer


@pytest.mark.parametrize(
    ("old", "new"), [("slot", {"expected_parts": 1}), ("expected_slots", {"part": 0})]
)
async def test_a_publish_naming_its_part_by_the_old_slot_field_is_refused_and_records_nothing(
    daemon: Served, old: str, new: dict[str, int]
) -> None:
    body: dict[str, object] = {"model": "m", "version": 1, old: 0 if old == "slot" else 1}
    body |= new
    body["tensors"] = []
    status, answer = await _post(f"{daemon.url}/v1/sources", body)
    assert status == 400 and answer["error"] == "ProtocolError", answer
    assert old in answer["detail"], answer
    assert await daemon.client.all_versions() == []


async def test_a_publish_naming_its_part_and_expected_parts_is_recorded(daemon: Served) -> None:
    body = {"model": "m", "version": 1, "part": 0, "expected_parts": 2, "tensors": []}
    status, made = await _post(f"{daemon.url}/v1/sources", body)
    assert status == 201 and made["published_parts"] == [0], made
    assert made["expected_parts"] == 2 and made["state"] == "pending", made
