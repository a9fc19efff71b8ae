"""What a pending version makes the daemon hold is counted and ends on time.

A version waiting for its other parts holds its manifests in the daemon's memory;
those manifests are charged to the principal that published them, in bytes
(``limits.max_manifest_bytes_per_principal``, 429 past it; issue 47 charges READY
manifests too), and a version pending past ``limits.pending_ttl_s`` stops protecting
its regions at once, not at the next unrelated publish.

A real daemon in this process on 127.0.0.1:0 with two tokens and a settable clock
(`support.daemons.FakeClock`, the daemon's own clock interface).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.daemons import FakeClock, daemon_config, served, token_file

from refitd.client.http import RefitClient
from refitd.config import LimitsConfig, ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.daemon.state.manifestcheck import MANIFEST_SHARD_BYTES, MANIFEST_TENSOR_BYTES
from refitd.daemon.state.registry import Registry
from refitd.errors import QuotaExceeded
from refitd.wire import ManifestIn, ShardEntry, TensorEntry

pytestmark = pytest.mark.timeout(60)

TOKENS = {"a": "token-of-a", "b": "token-of-b"}
SHARDS = 4  # limits.max_manifest_shards in these tests
PENDING_MANIFESTS = 8
"""Manifests of :func:`part0` one principal's cap holds in these tests."""
SLOT0_BYTES = SHARDS * MANIFEST_SHARD_BYTES + MANIFEST_TENSOR_BYTES + len("w")


@contextlib.asynccontextmanager
async def tenants(
    tmp: Path, clock: FakeClock, ttl_s: float = 3600.0
) -> AsyncIterator[tuple[RefitClient, RefitClient]]:
    access = ServerConfig(port=0, token_file=token_file(tmp, TOKENS))
    limits = LimitsConfig(
        max_manifest_shards=SHARDS,
        pending_ttl_s=ttl_s,
        max_manifest_bytes_per_principal=PENDING_MANIFESTS * SLOT0_BYTES,
    )
    opts = daemon_config(node_id="pending", transport="shm", limits=limits)
    async with (
        served(Daemon(opts, clock=clock), access=access) as s,
        RefitClient(s.url, token=TOKENS["a"]) as a,
        RefitClient(s.url, token=TOKENS["b"]) as b,
    ):
        yield a, b


async def part0(c: RefitClient, model: str, version: int = 1) -> int:
    """Part 0 of 2 of ``model`` (``SHARDS`` shards), in a new region; the version stays
    pending. Returns the region id."""
    info = await c.create_region(SHARDS * 64, label=model)
    shards = [ShardEntry((i * 16,), (16,), info.region_id, i * 64) for i in range(SHARDS)]
    t = TensorEntry("w", (SHARDS * 16,), "float32", shards)
    await c.publish(ManifestIn(model, version, 0, 2, [t]))
    return info.region_id


async def test_a_principals_pending_shards_are_capped_and_another_principal_is_not_affected(
    tmp_path: Path,
) -> None:
    async with tenants(tmp_path, FakeClock()) as (a, b):
        for i in range(PENDING_MANIFESTS):
            await part0(a, f"a{i}")
        with pytest.raises(QuotaExceeded, match="pending"):
            await part0(a, "one-too-many")
        await part0(b, "b0")  # the cap is a's, not the daemon's


async def test_a_pending_version_past_its_ttl_frees_its_region_without_another_publish(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with tenants(tmp_path, clock, ttl_s=60.0) as (a, _):
        region = await part0(a, "m")
        clock.now += 61.0
        await a.delete_region(region)  # no longer protected: the version expired
        assert await a.all_versions() == []


async def test_an_expired_pending_version_no_longer_counts_against_its_publisher(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with tenants(tmp_path, clock, ttl_s=60.0) as (a, _):
        for i in range(PENDING_MANIFESTS):
            await part0(a, f"a{i}")
        clock.now += 61.0
        await part0(a, "after-expiry")


# ---------------------------------------------------------------- retired versions


def ready(reg: Registry, version: int, shards: int = 64) -> None:
    t = TensorEntry(
        "w",
        (shards * 16,),
        "float32",
        [ShardEntry((i * 16,), (16,), 1, i * 64) for i in range(shards)],
    )
    reg.publish(ManifestIn("m", version, 0, 1, [t]))


def test_a_retired_version_no_lease_holds_keeps_no_manifest_in_memory() -> None:
    """A trainer publishing a version per step must not grow the daemon without bound:
    once a version is retired and unleased, nothing can read it again, and its
    manifests go (its record stays, with the parts it published)."""
    reg = Registry("node", 1, FakeClock())
    ready(reg, 1)
    lease = reg.acquire("m", 1, 60.0)
    for v in range(2, 12):
        ready(reg, v)
    assert reg.held_shards() == 2 * 64  # the leased v1, and the READY v11
    reg.release(lease.lease_id)
    ready(reg, 12)
    assert reg.held_shards() == 64
    assert reg.version("m", 1).published_parts == [0]
    assert [v.state.value for v in reg.versions("m")][-2:] == ["retired", "ready"]
