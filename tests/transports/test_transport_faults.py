"""UCX fault isolation: a dying peer costs one pull, never the owner.

Real processes throughout: each peer is `python -m transports.servepeer` (its own
owner plus data-plane child), killed with SIGKILL while this process pulls from it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import uvloop

from transports.checks import LOCAL, Pair, open_pair, shuffled_batch
from transports.core import PeerInfo, PeerLost, TransportClosed
from transports.servepeer import REGION_ID, SECRET_ENV, pattern
from transports.shm import SHM_DIR, SharedSegment, cleanup_stale
from transports.ucx import UcxTransport

SECRET = b"fault-test-secret-0123456789"
SIZE = 32 << 20


@asynccontextmanager
async def peer_process(seed: int) -> AsyncIterator[tuple[asyncio.subprocess.Process, PeerInfo]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "transports.servepeer",
        "--size",
        str(SIZE),
        "--seed",
        str(seed),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=dict(os.environ, **{SECRET_ENV: SECRET.hex()}),
    )
    try:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        yield proc, PeerInfo.decode(bytes.fromhex(line.decode()))
    finally:
        if proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()  # asks the peer to shut down cleanly
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
        await proc.wait()
        # A killed peer leaves its segment behind; the crash cleanup must find it.
        await asyncio.to_thread(cleanup_stale)
        assert not list(SHM_DIR.glob(f"refitd.{proc.pid}.*")), (
            "a dead peer's segment survived cleanup"
        )


def full_batch() -> np.ndarray:
    b = shuffled_batch(SIZE // 4096, 4096, seed=3)
    b["remote_region"] = REGION_ID
    return b


def landed(dst: SharedSegment, batch: np.ndarray, seed: int) -> bool:
    src = pattern(SIZE, seed).reshape(-1, 4096)
    got = dst.numpy().reshape(-1, 4096)
    return bool(
        np.array_equal(got[batch["local_offset"] // 4096], src[batch["remote_offset"] // 4096])
    )


async def test_killing_a_peer_mid_pull_ten_times_fails_only_that_pull_and_the_next_succeeds() -> (
    None
):
    restarts: list[int] = []
    batch = full_batch()
    with SharedSegment.create(SIZE, "faults") as dst:
        async with UcxTransport(secret=SECRET, on_restart=restarts.append) as t:
            await t.register(LOCAL, dst)
            for round_ in range(10):
                async with peer_process(round_) as (proc, info):
                    peer = await t.connect(info)
                    await peer.get(batch)
                    assert landed(dst, batch, round_), (
                        f"round {round_}: the pull before the kill was wrong"
                    )
                    first_done = asyncio.Event()

                    async def pull_until_it_fails() -> None:
                        while True:  # back-to-back pulls, so the kill lands inside one
                            await peer.get(batch)  # noqa: B023
                            first_done.set()  # noqa: B023

                    task = asyncio.create_task(pull_until_it_fails())
                    await first_done.wait()
                    proc.kill()
                    with pytest.raises(PeerLost) as failure:
                        await task
                    # The failure names the destination bytes that may be torn.
                    assert [(r.region, r.offset, r.nbytes) for r in failure.value.suspect] == [
                        (LOCAL, 0, SIZE)
                    ]
                    assert f"region {LOCAL} [0, {SIZE})" in str(failure.value)
                # The owner keeps serving: its region is registered again under a new epoch.
                await t.wait_ready()
                assert t.advertise().regions[0].region_id == LOCAL
            assert len(restarts) == 10
            async with peer_process(99) as (_, info):
                peer = await t.connect(info)
                await peer.get(batch)
                assert landed(dst, batch, 99)


async def test_a_killed_data_plane_is_restarted_and_an_existing_peer_reconnects_on_its_next_get() -> (
    None
):
    async with open_pair("ucx", 1 << 20, 1 << 20) as pair:
        t = pair.puller
        assert isinstance(t, UcxTransport)
        old_pid, old_epoch = t.pid, t.regions[LOCAL].epoch
        restarted = asyncio.Event()
        t.on_restart = lambda generation: restarted.set()
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        await restarted.wait()
        assert t.pid not in (None, old_pid)
        assert t.regions[LOCAL].epoch > old_epoch, "re-registration must advertise a new epoch"
        b = shuffled_batch(256, 4096)
        await pair.peer.get(b)
        assert np.array_equal(
            pair.local.numpy()[:4096], pair.remote.numpy()[b[0]["remote_offset"] :][:4096]
        )


async def test_a_same_host_get_is_one_sided_it_completes_while_the_source_process_is_stopped() -> (
    None
):
    # The cma path reads the source's memory with no help from it; the tcp emulation
    # would wait forever for a stopped target.
    async with open_pair("ucx", 4 << 20, 4 << 20) as pair:
        source = pair.source
        assert isinstance(source, UcxTransport) and source.pid is not None
        os.kill(source.pid, signal.SIGSTOP)
        try:
            async with asyncio.timeout(60):
                await pair.peer.get(shuffled_batch(1024, 4096))
        finally:
            os.kill(source.pid, signal.SIGCONT)
        assert np.array_equal(
            pair.local.numpy()[:4096],
            pair.remote.numpy()[shuffled_batch(1024, 4096)[0]["remote_offset"] :][:4096],
        )


def test_the_ucx_transport_runs_under_uvloop() -> None:
    async def pull() -> Pair:
        async with open_pair("ucx", 1 << 20, 1 << 20) as pair:
            await pair.peer.get(shuffled_batch(256, 4096, seed=5))
            assert np.array_equal(
                pair.local.numpy(),
                pair.remote.numpy()[
                    shuffled_batch(256, 4096, seed=5)["remote_offset"][:, None] + np.arange(4096)
                ].reshape(-1),
            )
            assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
            return pair

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(pull())


async def test_a_closed_ucx_transport_refuses_new_work_and_leaves_no_child() -> None:
    t = UcxTransport(secret=SECRET)
    await t.start()
    pid = t.pid
    await t.close()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with SharedSegment.create(1) as seg, pytest.raises(TransportClosed):
        await t.register(1, seg)


async def test_the_data_plane_uses_the_libucp_that_ucxx_loaded() -> None:
    # One libucp mapped in the data-plane process: our helper did not load a second copy.
    async with UcxTransport(secret=SECRET) as t:
        assert t.pid is not None
        maps = await asyncio.to_thread(Path(f"/proc/{t.pid}/maps").read_text)
        paths = {line.split()[-1] for line in maps.splitlines() if "libucp.so" in line}
        assert len(paths) == 1, paths


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


async def test_an_idle_data_plane_sleeps_instead_of_spinning() -> None:
    async with open_pair("ucx", 1 << 20, 1 << 20) as pair:
        await pair.peer.get(shuffled_batch(256, 4096))
        pids = [t.pid for t in (pair.puller, pair.source) if isinstance(t, UcxTransport)]
        assert all(pids)
        before = [_cpu_ticks(p) for p in pids if p]
        await asyncio.sleep(1.0)  # an observation window, not synchronisation
        after = [_cpu_ticks(p) for p in pids if p]
        spent = [a - b for a, b in zip(after, before, strict=True)]
        # A spinning thread would burn ~100 ticks per second; a sleeping one ~0.
        assert max(spent) < 20, f"idle data-plane processes used {spent} CPU ticks in 1 s"
