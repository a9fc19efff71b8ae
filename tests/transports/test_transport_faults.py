"""UCX fault isolation: a dying peer costs one pull, never the owner.

Real processes throughout: each peer is `python -m transports.servepeer` (its own
owner plus data-plane children), killed with SIGKILL while this process pulls from
it. The puller reads each peer from a process of its own (see `transports.ucx`), so
a peer's death costs that process only; test_transport_isolation has the hung peer
beside a healthy one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import numpy as np
import pytest
import uvloop
from support.peers import peer_process

from refitd.errors import TransportError
from transports.checks import LOCAL, Pair, open_pair, shuffled_batch
from transports.interface import PeerInfo, PeerLost, TransportClosed
from transports.segments import SharedSegment
from transports.servepeer import REGION_ID, pattern
from transports.ucx import UcxPeer, UcxTransport, supervisor
from transports.ucx.supervisor import SERVING, START_ATTEMPTS, STOP_LIMIT_S, Child, start_child

SECRET = b"fault-test-secret-0123456789"
SIZE = 32 << 20


def serve(
    seed: int,
) -> AbstractAsyncContextManager[tuple[asyncio.subprocess.Process, PeerInfo]]:
    """A servepeer process with this module's region size and secret."""
    return peer_process(seed, SIZE, SECRET)


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
    readers: set[int] = set()
    batch = full_batch()
    with SharedSegment.create(SIZE, "faults") as dst:
        async with UcxTransport(secret=SECRET, on_restart=restarts.append) as t:
            await t.register(LOCAL, dst)
            serving = t.pid
            for round_ in range(10):
                async with serve(round_) as (proc, info):
                    peer = await t.connect(info)
                    assert isinstance(peer, UcxPeer) and peer.pid is not None
                    readers.add(peer.pid)
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
                    assert f"'peer-{proc.pid}'" in str(failure.value), "it names the peer"
                    # Only the process reading from that peer died (cma aborts it).
                    assert peer.pid is None
                # The owner keeps serving, from the same serving process as before.
                assert t.pid == serving
                assert t.advertise().regions[0].region_id == LOCAL
            assert restarts == [] and len(readers) == 10
            async with serve(99) as (_, info):
                peer = await t.connect(info)
                await peer.get(batch)
                assert landed(dst, batch, 99)


async def test_a_killed_serving_process_is_restarted_with_new_generations_and_pulls_go_on_in_their_own_process() -> (
    None
):
    async with open_pair("ucx", 1 << 20, 1 << 20) as pair:
        t, peer = pair.puller, pair.peer
        assert isinstance(t, UcxTransport) and isinstance(peer, UcxPeer)
        old_pid, old_generation, reader = t.pid, t.regions[LOCAL].generation, peer.pid
        restarted = asyncio.Event()
        t.on_restart = lambda incarnation: restarted.set()
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        await restarted.wait()
        assert t.pid not in (None, old_pid)
        assert t.regions[LOCAL].generation > old_generation, (
            "re-registration must advertise a new generation"
        )
        b = shuffled_batch(256, 4096)
        await peer.get(b)
        assert peer.pid == reader, "the process pulling from the peer was not touched"
        assert np.array_equal(
            pair.local.numpy()[:4096], pair.remote.numpy()[b[0]["remote_offset"] :][:4096]
        )


async def test_a_killed_pulling_process_fails_nothing_else_and_the_next_get_starts_a_new_one() -> (
    None
):
    async with open_pair("ucx", 1 << 20, 1 << 20) as pair:
        t, peer = pair.puller, pair.peer
        assert isinstance(t, UcxTransport) and isinstance(peer, UcxPeer)
        serving, reader = t.pid, peer.pid
        assert reader is not None
        os.kill(reader, signal.SIGKILL)
        b = shuffled_batch(256, 4096, seed=2)
        await peer.get(b)  # reconnects from a new process
        assert peer.pid not in (None, reader)
        assert t.pid == serving and t.restarts == 0
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
    async with open_pair("ucx", 1 << 20, 1 << 20) as pair:
        t = pair.puller
        assert isinstance(t, UcxTransport) and isinstance(pair.peer, UcxPeer)
        pids = [t.pid, pair.peer.pid]
        await t.close()
    for pid in pids:
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
        pids.append(getattr(pair.peer, "pid", None))  # the process pulling from the peer
        assert len(pids) == 3 and all(pids)
        before = [_cpu_ticks(p) for p in pids if p]
        await asyncio.sleep(1.0)  # an observation window, not synchronisation
        after = [_cpu_ticks(p) for p in pids if p]
        spent = [a - b for a, b in zip(after, before, strict=True)]
        # A spinning thread would burn ~100 ticks per second; a sleeping one ~0.
        assert max(spent) < 20, f"idle data-plane processes used {spent} CPU ticks in 1 s"


@contextlib.contextmanager
def crashing_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> Iterator[Path]:
    """The next ``n`` starts of `support.crashing_ucx_worker` die by SIGSEGV."""
    counter = tmp_path / "start-crashes"
    counter.write_text(str(n))
    monkeypatch.setenv("REFITD_TEST_START_CRASHES", str(counter))
    children_see_support(monkeypatch)
    yield counter


def children_see_support(monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes import the test children of ``tests/support``."""
    support = Path(__file__).resolve().parents[1]  # where `support` is a package
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(filter(None, [str(support), os.environ.get("PYTHONPATH", "")])),
    )


async def _exited(child: Child, code: int) -> None:
    return None


async def test_a_ucx_child_killed_by_a_signal_before_its_hello_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once seen under load: a child died by SIGSEGV while starting, and the pull
    failed although no request had reached it. A second start costs nothing and
    risks nothing; the first one's death is logged with the frame it hit."""
    with crashing_starts(tmp_path, monkeypatch, 1) as counter:
        child = await start_child(1, SERVING, "", _exited, module="support.crashing_ucx_worker")
        try:
            assert child.address and counter.read_text() == "0"
            assert child.proc.returncode is None
        finally:
            await child.stop(STOP_LIMIT_S)
    assert "Segmentation fault" in caplog.text and "string_at" in caplog.text
    assert "starting it again" in caplog.text


async def test_a_ucx_child_that_dies_at_every_start_is_refused_naming_the_frame_it_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        crashing_starts(tmp_path, monkeypatch, START_ATTEMPTS),
        pytest.raises(TransportError) as refused,
    ):
        await start_child(1, SERVING, "", _exited, module="support.crashing_ucx_worker")
    text = str(refused.value)
    assert "failed to start: Fatal Python error: Segmentation fault" in text
    assert "string_at" in text and "SIGSEGV" in text and f"after {START_ATTEMPTS} tries" in text


async def test_a_ucx_child_whose_output_has_a_line_past_the_limit_is_read_on_and_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the daemon stopped reading a child's output at its first line over
    64 KiB: the child then blocked on a full pipe and never said hello. Now the long
    line is logged cut short, reading goes on, and the child starts."""
    with odd_child(tmp_path, monkeypatch, "chatty"):
        child = await start_child(1, SERVING, "", _exited, module="support.odd_ucx_worker")
        try:
            assert child.address and child.proc.returncode is None
        finally:
            await child.stop(STOP_LIMIT_S)
    assert "[cut short]" in caplog.text and "chatty: done" in caplog.text


async def test_a_ucx_child_that_says_no_hello_is_refused_naming_the_wait_not_a_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child silent past the hello bound is killed by the daemon; the refusal says
    that (before, it named the SIGKILL, which reads as the kernel's out-of-memory
    killer), and it is not started again."""
    monkeypatch.setattr(supervisor, "HELLO_S", 1.0)
    with odd_child(tmp_path, monkeypatch, "silent"), pytest.raises(TransportError) as refused:
        await start_child(1, SERVING, "", _exited, module="support.odd_ucx_worker")
    text = str(refused.value)
    assert "no hello within 1 s" in text and "SIGKILL" not in text
    assert "tries" not in text  # one start: a silent child is not a crash to retry


@contextlib.contextmanager
def odd_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> Iterator[None]:
    """The next starts of `support.odd_ucx_worker` misbehave as ``mode`` says."""
    monkeypatch.setenv("REFITD_TEST_CHILD", mode)
    children_see_support(monkeypatch)
    yield
