"""Client death, stale segments and ``refitd gc``: what the daemon frees, and when.

The clients here are real processes that die with ``os._exit`` (no cleanup of any
kind); the daemon is real, served on loopback in the test's process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import daemons
from support.daemons import daemon_config

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.wire import ManifestIn, ShardEntry, TensorEntry, VersionState
from transports.segments import PREFIX, SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(180)  # real processes start (and import) here

CLIENT = """
import asyncio, json, os, sys
from refitd.client.http import RefitClient
from refitd.wire import ManifestIn, ShardEntry, TensorEntry
from transports.segments import SharedSegment

async def main(url, publish):
    async with RefitClient(url) as c:
        made = await c.create_region(64, label="crash-made")
        seg = SharedSegment.create(64, "crash-own")
        attached = await c.attach_region(seg.name, 64, label="crash-own")
        if publish:
            shard = ShardEntry((0,), (64,), made.region_id, 0)
            await c.publish(ManifestIn(publish, 1, 0, 1, [TensorEntry("w", (64,), "uint8", [shard])]))
        out = {"made": made.region_id, "made_handle": made.handle,
               "attached": attached.region_id, "own_segment": seg.name,
               "process": made.process}
    sys.stdout.write(json.dumps(out) + "\\n")
    sys.stdout.flush()
    os._exit(0)  # a crash: nothing is closed, released or unlinked

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture
async def served() -> AsyncIterator[tuple[Daemon, RefitClient, str]]:
    d = Daemon(daemon_config(node_id="life", transport="shm"))
    async with daemons.served(d) as s:
        yield d, s.client, s.url


async def crashing_client(url: str, publish: str = "") -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, url, publish, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return dict(json.loads(out))


async def gone(c: RefitClient, *region_ids: int) -> bool:
    """Whether the regions are gone within a few seconds (the reap runs in a task)."""
    for _ in range(100):
        if not {r.region_id for r in await c.regions()} & set(region_ids):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_client_that_dies_has_its_regions_released_and_its_segments_unlinked(
    served: tuple[Daemon, RefitClient, str],
) -> None:
    _, c, url = served
    got = await crashing_client(url)
    assert got["process"].startswith(f"{got['process'].split('.')[0]}.")  # the client's tag
    assert await gone(c, got["made"], got["attached"])
    assert not (SHM_DIR / got["made_handle"]).exists()
    assert not (SHM_DIR / got["own_segment"]).exists()


async def test_a_dead_clients_region_a_ready_version_publishes_from_stays_until_it_is_retired(
    served: tuple[Daemon, RefitClient, str],
) -> None:
    _, c, url = served
    got = await crashing_client(url, publish="crashy")
    await asyncio.sleep(0.3)  # the exit was seen; the READY version keeps its region
    assert got["made"] in {r.region_id for r in await c.regions()}
    assert (await c.version("crashy", 1)).state is VersionState.READY
    # A newer version retires it: the dead client's region goes with that change.
    mine = await c.create_region(64)
    shard = ShardEntry((0,), (64,), mine.region_id, 0)
    await c.publish(ManifestIn("crashy", 2, 0, 1, [TensorEntry("w", (64,), "uint8", [shard])]))
    assert await gone(c, got["made"])


def _dead_tag() -> str:
    """``<pid>.<start>`` of a process that existed and is gone."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                       capture_output=True, text=True)  # fmt: skip
    return f"{p.stdout.strip()}.1"


def _stale_segment(label: str) -> str:
    name = f"{PREFIX}{_dead_tag()}.{label}"
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    return name


async def test_a_daemon_removes_stale_segments_of_earlier_lives_at_start() -> None:
    stale = _stale_segment("earlier-life")
    with SharedSegment.create(64, "alive") as alive:
        d = Daemon(daemon_config(node_id="restart", transport="shm"))
        async with daemons.served(d):
            # (another process sweeping stale segments at the same moment may take it first)
            assert stale in d.removed_at_start or not (SHM_DIR / stale).exists()
            assert not (SHM_DIR / stale).exists()
            assert (SHM_DIR / alive.name).exists()  # its creator (this test) lives


async def test_refitd_gc_shows_what_it_would_free_and_then_frees_it(
    served: tuple[Daemon, RefitClient, str],
) -> None:
    _, c, url = served
    got = await crashing_client(url, publish="gc-me")
    await c.wait_drain("gc-me", 1, timeout_s=1, retire=True)  # no lease: retired at once
    stale = _stale_segment("gc-me")

    async def gc(*flags: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "refitd.cli", "gc", "--url", url, *flags,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        return out.decode()

    shown = json.loads(await gc("--dry-run", "--json"))
    assert shown["dry_run"] is True
    assert [r["region_id"] for r in shown["regions"]] == [got["made"]]
    # (Another process sweeping stale segments at the same moment may take it first.)
    assert stale in shown["segments"] or not (SHM_DIR / stale).exists()
    assert got["made"] in {r.region_id for r in await c.regions()}
    text = await gc()
    assert "freed" in text and str(got["made"]) in text
    assert not (SHM_DIR / stale).exists()
    assert got["made"] not in {r.region_id for r in await c.regions()}
    again = await c.gc(dry_run=True)
    assert again.regions == [] and stale not in again.segments
