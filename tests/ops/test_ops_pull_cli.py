"""``refitd pull`` and ``refitd experts`` as real subprocesses against a real daemon."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.daemons import GatedCopier, daemon_config, served
from support.ops import refitd

from refitd.cli import _build_parser
from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.wire import ManifestIn, RegionInfo, ShardEntry, TensorEntry
from transports.segments import SharedSegment


@dataclass
class Setup:
    base: str
    client: RefitClient
    src: RegionInfo
    dst: RegionInfo


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    """A daemon with a 64 KiB source region (bytes 0..255 repeating) published as
    version 1 and 2 of model ``m`` (2 retires 1), and an empty destination region."""
    async with served() as d:
        base, c = d.url, d.client
        src = await c.create_region(1 << 16, label="trainer")
        dst = await c.create_region(1 << 16, label="engine")
        seg = SharedSegment.attach(src.handle, src.nbytes)
        seg.numpy()[:] = np.arange(1 << 16) % 256
        seg.close()
        shard = ShardEntry((0,), (1 << 16,), src.region_id, 0)
        for version in (1, 2):
            tensors = [TensorEntry("w", (1 << 16,), "uint8", [shard])]
            await c.publish(ManifestIn("m", version, 0, 1, tensors))
        yield Setup(base, c, src, dst)


def dst_bytes(s: Setup) -> np.ndarray:
    seg = SharedSegment.attach(s.dst.handle, s.dst.nbytes)
    try:
        return seg.numpy().copy()
    finally:
        seg.close()


def pull_file(tmp_path: Path, s: Setup, rows: list[list[int]], **extra: object) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"model": "m", "descriptors": rows, **extra}))
    return str(path)


def test_pull_is_registered_with_examples_of_the_file_in_its_help() -> None:
    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["pull"].format_help()  # type: ignore[attr-defined]
    assert "examples:" in text and "refitd pull plan.json" in text
    assert '"descriptors": [[1, 0, 2, 0, 4096]]' in text


async def test_pull_moves_the_described_bytes_and_prints_the_result_as_json(
    setup: Setup, tmp_path: Path
) -> None:
    s = setup
    rows = [
        [s.src.region_id, 0, s.dst.region_id, 4096, 8192],
        [s.src.region_id, 100, s.dst.region_id, 0, 50],
    ]
    code, out, err = await refitd("pull", pull_file(tmp_path, s, rows), "--url", s.base, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["state"] == "done" and result["bytes_done"] == 8192 + 50
    got = dst_bytes(s)
    want = np.arange(1 << 16) % 256
    assert np.array_equal(got[4096 : 4096 + 8192], want[:8192])
    assert np.array_equal(got[:50], want[100:150])
    assert not got[50:4096].any()
    # The command leased the newest READY version for the pull and released it after.
    assert [v.leases for v in await s.client.versions("m")] == [0, 0]
    assert {p.state for p in await s.client.pulls()} == {"done"}


async def test_pull_draws_a_progress_bar_and_reads_the_file_from_stdin(setup: Setup) -> None:
    s = setup
    rows = [[s.src.region_id, 0, s.dst.region_id, 0, 1 << 16]]
    body = json.dumps({"model": "m", "version": 2, "descriptors": rows}).encode()
    code, out, err = await refitd("pull", "-", "--url", s.base, stdin=body)
    assert code == 0, err
    assert "pull p" in out and "64.0/64.0 KiB" in out
    assert np.array_equal(dst_bytes(s), np.arange(1 << 16) % 256)


async def test_a_pull_the_daemon_refuses_exits_1_naming_the_descriptor(
    setup: Setup, tmp_path: Path
) -> None:
    s = setup
    rows = [[s.src.region_id, 0, s.dst.region_id, (1 << 16) - 10, 20]]
    code, out, err = await refitd("pull", pull_file(tmp_path, s, rows), "--url", s.base)
    assert code == 1 and out == ""
    assert "descriptor 0 refused" in err and "past the destination region" in err
    assert not dst_bytes(s).any()  # nothing moved
    assert [v.leases for v in await s.client.versions("m")] == [0, 0]  # lease released


async def test_a_malformed_pull_file_exits_2_saying_what_was_expected(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"model": "m", "descriptors": [[1, 2, 3]]}))
    code, _, err = await refitd("pull", str(path), "--url", "http://127.0.0.1:9")
    assert code == 2
    assert "pull file" in err and "src_region, src_offset, dst_region, dst_offset, nbytes" in err


async def test_experts_lists_each_hosted_pool_with_its_counters(setup: Setup) -> None:
    s = setup
    await s.client.create_pool("moe", layers=2, experts=4, slots=4, row_bytes=[1024, 512])
    await s.client.ensure("moe", 0, [0, 1])
    await s.client.ensure("moe", 0, [1, 2])
    code, out, err = await refitd("experts", "--url", s.base)
    assert code == 0, err
    assert "moe" in out and "2 x 4" in out and "3/4" in out and "25.0%" in out
    assert "4.5 KiB" in out  # three experts of 1.5 KiB copied
    code, out, _ = await refitd("experts", "--url", s.base, "--json")
    (pool,) = json.loads(out)
    assert (pool["hits"], pool["misses"], pool["copied_bytes"]) == (1, 3, 3 * 1536)


async def test_experts_shows_what_prefetches_copied_and_how_much_a_step_used(
    setup: Setup,
) -> None:
    s = setup
    await s.client.create_pool("moe", layers=2, experts=4, slots=4, row_bytes=[1024, 512])
    await s.client.prefetch("moe", 1, [0, 3])
    await s.client.ensure("moe", 1, [3])
    code, out, err = await refitd("experts", "--url", s.base)
    assert code == 0, err
    assert "prefetched" in out and "3.0 KiB" in out  # two experts of 1.5 KiB
    code, out, _ = await refitd("experts", "--url", s.base, "--json")
    (pool,) = json.loads(out)
    assert (pool["prefetch_used"], pool["prefetched_bytes"]) == (1, 2 * 1536)


async def test_status_names_the_hosted_expert_pools(setup: Setup) -> None:
    s = setup
    await s.client.create_pool("moe", layers=1, experts=2, slots=2, row_bytes=[64])
    code, out, _ = await refitd("status", "--url", s.base, "--json")
    assert code == 0 and json.loads(out)["expert_pools"] == ["moe"]
    code, out, _ = await refitd("status", "--url", s.base)
    assert code == 0 and "expert pools" in out and "moe" in out


async def test_status_reports_whether_shared_memory_gets_huge_pages(setup: Setup) -> None:
    from transports.segments import huge_page_mode

    code, out, _ = await refitd("status", "--url", setup.base, "--json")
    assert code == 0 and json.loads(out)["shm_huge_pages"] == huge_page_mode()
    code, out, _ = await refitd("status", "--url", setup.base)
    assert code == 0 and "shm huge pages" in out and huge_page_mode() in out


async def test_pull_keeps_the_lease_it_took_alive_past_its_ttl(tmp_path: Path) -> None:
    """The command leases the version for 1.5 s; the copy is held for three times
    that. The pull lands only because the command's lease keeper renewed the lease
    (the daemon checks it again once the bytes have moved)."""
    copier = GatedCopier()
    daemon = Daemon(daemon_config(node_id="t", transport="shm"), copier=copier)
    async with served(daemon) as d:
        c = d.client
        src = await c.create_region(4096, label="trainer")
        dst = await c.create_region(4096, label="engine")
        seg = SharedSegment.attach(src.handle, src.nbytes)
        seg.numpy()[:] = 7
        seg.close()
        shard = ShardEntry((0,), (4096,), src.region_id, 0)
        await c.publish(ManifestIn("m", 1, 0, 1, [TensorEntry("w", (4096,), "uint8", [shard])]))
        s = Setup(d.url, c, src, dst)
        plan = pull_file(tmp_path, s, [[src.region_id, 0, dst.region_id, 0, 4096]])
        pulling = asyncio.create_task(
            refitd("pull", plan, "--url", d.url, "--json", "--lease-ttl", "1.5")
        )
        await asyncio.wait_for(copier.entered.wait(), 60)
        await asyncio.sleep(4.5)  # three TTLs: a lease nobody renewed has expired
        copier.gate.set()
        code, out, err = await pulling
        assert code == 0, err
        assert json.loads(out)["state"] == "done"
        assert (dst_bytes(s) == 7).all()
        assert [v.leases for v in await c.versions("m")] == [0]  # released after
