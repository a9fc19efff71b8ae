"""Many replicas across simulated hosts with shaped links: ``refitd bench fanout`` on a
tiny model, and its straggler, kill and restart cases at N = 3; a replica reading its
host's mirror while it fills; a relay killed, stopped or slow mid-transfer while the
host behind it reads through it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from support.hosts import cluster_of, needs_hosts, tx_bytes

from refitd.bench.fanout import summary
from refitd.bench.fanoutcases import MIB, fanout, faults, shape_both, start_worker

pytestmark = [needs_hosts, pytest.mark.timeout(400)]


async def test_the_fanout_bench_sends_the_model_once_from_the_trainer_and_every_replica_is_exact(
    tmp_path: Path,
) -> None:
    cases = await fanout(tmp_path, 8 * MIB, 1.0, max_hosts=2, replicas=2)
    by = {(c.n, c.mode): c for c in cases}
    assert sorted(by) == [
        (1, "direct"),
        (1, "link"),
        (1, "mirrored"),
        (2, "direct"),
        (2, "mirrored"),
    ]
    assert all(c.verified for c in cases)
    assert by[2, "direct"].paths == ("tcp",)
    assert by[2, "mirrored"].paths == ("shm",)  # every replica read its host's mirror
    # Direct: the trainer's link carries every replica's copy; mirrored: about one.
    assert by[2, "direct"].uplink_ratio >= 3.9
    assert by[2, "mirrored"].uplink_ratio <= 1.1
    line = summary(cases)
    assert line["verified"] == "1"
    assert {"fanout_ratio_2", "direct_ratio_2", "uplink_ratio_2", "mirrored_n1_ratio"} <= set(line)
    assert float(line["mirrored_n1_ratio"]) > 0


async def test_the_fanout_benchs_straggler_and_kill_leave_the_others_exact_and_a_restarted_host_refits(
    tmp_path: Path,
) -> None:
    """At N = 3 engine hosts: one host's link at a quarter of the others' (every replica,
    its own included, exact), one host's mirrored daemon SIGKILLed mid-version (the
    other two exact), then started again (its replicas refit the next version
    exactly); the last line has the ratios of both against the plain case."""
    cases = await faults(tmp_path, 16 * MIB, 0.25, n=3, replicas=1)
    by = {c.mode: c for c in cases}
    assert sorted(by) == ["kill", "mirrored", "restarted", "straggler"]
    assert all(c.n == 3 and len(c.hosts) == 3 for c in cases)
    assert all(h.exact for h in by["straggler"].hosts)  # the straggler's replicas too
    kill = by["kill"]
    assert kill.faulted and kill.faulted != by["straggler"].faulted
    assert all(h.exact for h in kill.hosts if h.name != kill.faulted)
    restarted = by["restarted"]
    assert restarted.faulted == kill.faulted
    assert all(h.exact for h in restarted.hosts)  # the restarted host's included
    assert all(c.verified for c in cases)
    line = summary(cases)
    assert {"straggler_ratio_3", "kill_ratio_3", "restarted_refit", "verified"} <= set(line)
    assert line["restarted_refit"] == "1"
    assert line["verified"] == "1"
    assert float(line["straggler_ratio_3"]) > 0 and float(line["kill_ratio_3"]) > 0


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
        tw, aw, bw = [await start_worker(cluster, h) for h in hosts]
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


async def test_a_replica_reads_its_hosts_mirror_while_the_mirror_still_fills(
    tmp_path: Path,
) -> None:
    """The replica's pull does not wait for the whole mirror: it has read bytes (each
    from a complete chunk) while chunks of the mirror were still to come, and it ends
    bit-exact."""
    nbytes = 48 * MIB  # about 2 s over a 200 Mbit/s link
    async with cluster_of(tmp_path, "trainer", "engine") as (cluster, hosts):
        t, e = hosts
        for h in hosts:
            await shape_both(cluster.net, h, 0.2)
        src = await cluster.daemon(t, "trainer")
        de = await cluster.daemon(e, "engine", "--set", "mirrors.policy=always")
        tw, ew = [await start_worker(cluster, h) for h in hosts]
        assert (await tw.call("publish", url=src.url, version=1, nbytes=nbytes))["ok"]
        assert (await ew.call("prepare", local=de.url, count=1, nbytes=nbytes))["ok"]
        common = {"source": src.url, "version": 1, "count": 1, "nbytes": nbytes}
        replica = asyncio.create_task(ew.call("replicas", local=de.url, **common))
        seen_early = False
        deadline = time.monotonic() + 120.0  # a safety net, not a measure
        while not replica.done() and time.monotonic() < deadline:
            # the pulls first: a mirror still incomplete after them was so before them
            pulls = (await tw.call("pulls", url=de.url))["pulls"]
            st = await tw.call("mirror", url=de.url, version=1)
            read = sum(p["bytes_done"] for p in pulls if p["path"] == "shm")
            if (
                read
                and not st.get("complete")
                and st.get("chunks_done", 0) < st.get("chunks_total", 0)
            ):
                seen_early = True
                break
            await asyncio.sleep(0.05)
        got = await replica
        assert got["ok"], got
        assert (await ew.call("verify", version=1, nbytes=nbytes))["verified"]
        assert seen_early, "the replica read nothing before its host's mirror was complete"


async def test_a_slow_host_is_left_by_the_others_and_the_next_version_is_dealt_without_it(
    tmp_path: Path,
) -> None:
    """Three engine hosts start each version together; ``slow``'s link is a tenth of
    the others'. In the first version every host seeds a third; the fast ones find
    ``slow`` sending under half the other holders' rate and read its chunks elsewhere.
    The book then deals the next version to the fast hosts only: they read nothing
    from ``slow``, the trainer sends each version about once, and every host ends
    exact, ``slow`` included."""
    nbytes = 32 * MIB
    async with cluster_of(tmp_path, "trainer", "fast1", "fast2", "slow") as (cluster, hosts):
        t, a, b, r = hosts
        for h, gbit in ((t, 0.5), (a, 0.5), (b, 0.5), (r, 0.05)):
            await shape_both(cluster.net, h, gbit)
        mirror = ("--set", "mirrors.policy=always")
        src = await cluster.daemon(t, "trainer")
        ds = [await cluster.daemon(h, h.name, *mirror) for h in (a, b, r)]
        tw, *ws = [await start_worker(cluster, h) for h in hosts]
        for version in (1, 2):
            assert (await tw.call("publish", url=src.url, version=version, nbytes=nbytes))["ok"]
            for w, d in zip(ws, ds, strict=True):
                assert (await w.call("prepare", local=d.url, count=1, nbytes=nbytes))["ok"]
            sent = await tx_bytes(t)
            common = {"source": src.url, "version": version, "count": 1, "nbytes": nbytes}
            got = await asyncio.gather(
                *(w.call("replicas", local=d.url, **common) for w, d in zip(ws, ds, strict=True))
            )
            assert all(g["ok"] for g in got), got
            for w in ws:
                assert (await w.call("verify", version=version, nbytes=nbytes))["verified"]
            assert (await tx_bytes(t) - sent) / nbytes < 1.5  # about once from the trainer
            states = [await tw.call("mirror", url=d.url, version=version) for d in ds]
            assert all(st["complete"] for st in states)
        slow_url = ds[2].url.rstrip("/")
        for st in states[:2]:  # the second version: the fast hosts never read slow
            assert slow_url not in {u.rstrip("/") for u in st["reads"]}, st["reads"]
            assert sum(st["reads"].values()) == st["chunks_total"]


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
