"""Many replicas across simulated hosts with shaped links: ``refitd bench fanout`` on a
tiny model, and a relay killed or stopped mid-transfer while the host behind it reads
through it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from support.hosts import cluster_of, needs_hosts

from refitd.bench.fanout import MIB, _worker, fanout, shape_both, summary

pytestmark = [needs_hosts, pytest.mark.timeout(400)]


async def test_the_fanout_bench_sends_the_model_once_from_the_trainer_and_every_replica_is_exact(
    tmp_path: Path,
) -> None:
    cases = await fanout(tmp_path, 8 * MIB, 1.0, max_hosts=2, replicas=2)
    by = {(c.n, c.mode): c for c in cases}
    assert sorted(by) == [(1, "direct"), (1, "mirrored"), (2, "direct"), (2, "mirrored")]
    assert all(c.verified for c in cases)
    assert by[2, "direct"].paths == ("tcp",)
    assert by[2, "mirrored"].paths == ("shm",)  # every replica read its host's mirror
    # Direct: the trainer's link carries every replica's copy; mirrored: about one.
    assert by[2, "direct"].uplink_ratio >= 3.9
    assert by[2, "mirrored"].uplink_ratio <= 1.1
    line = summary(cases)
    assert line["verified"] == "1"
    assert {"fanout_ratio_2", "direct_ratio_2", "uplink_ratio_2"} <= set(line)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_a_relay_killed_or_stopped_mid_transfer_is_replaced_and_the_host_behind_it_is_exact(
    tmp_path: Path, fault: str
) -> None:
    nbytes = 48 * MIB  # about 2 s over a 200 Mbit/s link: time to fault the relay mid-way
    async with cluster_of(tmp_path, "trainer", "relay", "behind") as (cluster, hosts):
        t, a, b = hosts
        for h in hosts:
            await shape_both(cluster.net, h, 0.2)
        mirror = ("--set", "mirrors.policy=always")
        src = await cluster.daemon(t, "trainer")
        da = await cluster.daemon(a, "relay", *mirror)
        db = await cluster.daemon(b, "behind", *mirror, "--set", "data_plane.pull_timeout_s=3")
        tw, aw, bw = [await _worker(cluster, h) for h in hosts]
        assert (await tw.call("publish", url=src.url, version=1, nbytes=nbytes))["ok"]
        common = {"source": src.url, "version": 1, "count": 1, "nbytes": nbytes}
        for w, d in ((aw, da), (bw, db)):
            assert (await w.call("prepare", local=d.url, count=1, nbytes=nbytes))["ok"]
        first = asyncio.create_task(aw.call("replicas", local=da.url, **common))
        # (each worker answers one request at a time: the trainer's one watches)
        await _until_mirror_has_chunks(tw, da.url)  # the relay joined first and is filling
        second = asyncio.create_task(bw.call("replicas", local=db.url, **common))
        await _until_mirror_has_chunks(tw, db.url)  # the host behind reads through it
        os.kill(da.pid, getattr(signal, fault))
        try:
            got = await second
            assert got["ok"], got
            assert (await bw.call("verify", version=1, nbytes=nbytes))["verified"]
            st = await tw.call("mirror", url=db.url, version=1)
            assert st["complete"]
            assert st["tried"] == [da.url, src.url]  # the relay, then the source
        finally:
            if fault == "SIGSTOP":
                os.kill(da.pid, signal.SIGCONT)
            first.cancel()


async def _until_mirror_has_chunks(worker: object, url: str, timeout_s: float = 60.0) -> None:
    """Return once the mirror at ``url`` holds at least one complete chunk."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = await worker.call("mirror", url=url, version=1)  # type: ignore[attr-defined]
        if st.get("chunks_done", 0) >= 1 and not st.get("complete"):
            return
        assert not st.get("complete"), "the mirror completed before the fault: slow the link"
        await asyncio.sleep(0.05)
    raise AssertionError(f"no chunk of the mirror at {url} completed in {timeout_s} s")
