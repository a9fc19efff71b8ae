"""UCX isolation: a hung or dead peer fails only the pulls that read from it.

Real UCX and real processes throughout. A peer "hangs" by having its serving
data-plane process stopped with SIGSTOP while UCX runs over tcp only
(``UCX_TLS=tcp``, set before any data-plane process starts): a GET over tcp needs
the target process to answer, so a stopped target never completes one, which is
what a hung or unreachable host looks like. (On the default same-host ``cma`` path
a GET is one-sided and a stopped source does not hang it: see
test_transport_faults.) A peer "dies" by SIGKILL of its whole process while it is
read over cma, which aborts the process reading from it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from support.peers import peer_process

from refitd.errors import TransportError
from transports.checks import LOCAL, REMOTE, shuffled_batch
from transports.interface import PeerInfo, PeerLost, PullFailed
from transports.segments import SharedSegment
from transports.servepeer import REGION_ID, pattern
from transports.ucx import BACKSTOP_S, UcxPeer, UcxTransport

pytestmark = pytest.mark.timeout(120)

SECRET = b"isolation-secret-0123456789abcdef"
SIZE = 4 << 20
DEADLINE_S = 3.0
PIECE = 64 << 10


def serve(
    seed: int,
) -> AbstractAsyncContextManager[tuple[asyncio.subprocess.Process, PeerInfo]]:
    """A servepeer process with this module's region size and secret."""
    return peer_process(seed, SIZE, SECRET)


def reads(local: int = LOCAL, remote: int = REMOTE, seed: int = 0) -> np.ndarray:
    b = shuffled_batch(SIZE // PIECE, PIECE, seed=seed)
    b["local_region"], b["remote_region"] = local, remote
    return b


def landed(dst: SharedSegment, src: np.ndarray, batch: np.ndarray) -> bool:
    got = dst.numpy().reshape(-1, PIECE)[batch["local_offset"] // PIECE]
    want = src.reshape(-1, PIECE)[batch["remote_offset"] // PIECE]
    return bool(np.array_equal(got, want))


@asynccontextmanager
async def source(stack: AsyncExitStack, name: str, seed: int) -> AsyncIterator[UcxTransport]:
    """A started UCX transport named ``name`` serving one region of random bytes."""
    seg = stack.enter_context(SharedSegment.create(SIZE, f"src-{name}"))
    seg.numpy()[:] = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    async with UcxTransport(secret=SECRET, peer_id=name) as t:
        await t.register(REMOTE, seg)
        yield t


async def timed(coro: Awaitable[None]) -> tuple[float, BaseException | None]:
    """Run ``coro``; return when it ended (monotonic s) and what it raised."""
    try:
        await coro
    except Exception as exc:
        return time.monotonic(), exc
    return time.monotonic(), None


async def test_a_hung_peer_fails_only_its_own_pull_at_the_deadline_while_a_healthy_peer_finishes_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    async with AsyncExitStack() as stack:
        dst_a = stack.enter_context(SharedSegment.create(SIZE, "dst-a"))
        dst_b = stack.enter_context(SharedSegment.create(SIZE, "dst-b"))
        a = await stack.enter_async_context(source(stack, "A", 1))
        b = await stack.enter_async_context(source(stack, "B", 2))
        puller = await stack.enter_async_context(
            UcxTransport(secret=SECRET, peer_id="puller", pull_timeout=DEADLINE_S)
        )
        await puller.register(LOCAL, dst_a)
        await puller.register(LOCAL + 1, dst_b)
        peer_a = await puller.connect(a.advertise())
        peer_b = await puller.connect(b.advertise())
        assert isinstance(peer_a, UcxPeer) and isinstance(peer_b, UcxPeer)
        assert peer_a.pid != peer_b.pid, "each peer is read by its own process"
        serving, b_pid = puller.pid, peer_b.pid
        src_a = a.regions[REMOTE].segment
        src_b = b.regions[REMOTE].segment
        batch_a, batch_b = reads(LOCAL, seed=1), reads(LOCAL + 1, seed=2)

        assert a.pid is not None
        os.kill(a.pid, signal.SIGSTOP)  # A hangs: over tcp nothing it serves completes
        try:
            t0 = time.monotonic()
            # A's batch is handed over first: a shared reader would stall B behind it.
            task_a = asyncio.create_task(timed(peer_a.get(batch_a)))
            await asyncio.sleep(0.1)
            task_b = asyncio.create_task(timed(peer_b.get(batch_b)))
            (end_a, err_a), (end_b, err_b) = await asyncio.gather(task_a, task_b)
        finally:
            os.kill(a.pid, signal.SIGCONT)

        assert err_b is None, f"the pull from healthy B failed beside hung A: {err_b}"
        assert end_b - t0 < DEADLINE_S * 0.75, (
            f"B's pull took {end_b - t0:.2f} s: it waited for hung A (deadline {DEADLINE_S} s)"
        )
        assert landed(dst_b, src_b.numpy(), batch_b)
        assert isinstance(err_a, PeerLost), err_a
        assert "'A'" in str(err_a) and f"timed out after {DEADLINE_S} s" in str(err_a), str(err_a)
        assert f"region {LOCAL} [0, {SIZE})" in str(err_a), "it names the suspect bytes"
        assert DEADLINE_S <= end_a - t0 < DEADLINE_S + BACKSTOP_S, (
            f"A's pull failed after {end_a - t0:.2f} s, not at its {DEADLINE_S} s deadline"
        )
        # Only A's reader was stopped: the serving process and B's reader are as before.
        assert puller.pid == serving and peer_b.pid == b_pid and puller.restarts == 0
        await peer_b.get(batch_b)
        # A answers again: the next pull from it starts a new reader and completes.
        dst_a.numpy()[:] = 0
        await peer_a.get(batch_a)
        assert landed(dst_a, src_a.numpy(), batch_a)
        assert peer_a.pid is not None


async def test_a_batch_queued_behind_a_hung_pull_fails_with_it_and_names_the_same_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two batches in flight to one hung peer (as the daemon sends them): both fail,
    # both name the peer, and neither waits past the first one's deadline + backstop.
    monkeypatch.setenv("UCX_TLS", "tcp")
    async with AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst"))
        a = await stack.enter_async_context(source(stack, "A", 1))
        puller = await stack.enter_async_context(
            UcxTransport(secret=SECRET, pull_timeout=DEADLINE_S)
        )
        await puller.register(LOCAL, dst)
        peer = await puller.connect(a.advertise())
        half = SIZE // PIECE // 2
        batch = reads(seed=3)
        assert a.pid is not None
        os.kill(a.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(
                peer.get(batch[:half]), peer.get(batch[half:]), return_exceptions=True
            )
            elapsed = time.monotonic() - t0
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert all(isinstance(r, PeerLost) and "'A'" in str(r) for r in results), results
        assert elapsed < DEADLINE_S + BACKSTOP_S, f"the second batch waited {elapsed:.2f} s"
        await peer.get(batch)
        assert landed(dst, a.regions[REMOTE].segment.numpy(), batch)


async def test_a_peer_dying_mid_read_on_the_cma_path_fails_only_its_pulls_while_another_peers_pulls_go_on() -> (
    None
):
    def servepeer_batch(local: int, seed: int) -> np.ndarray:
        b = reads(local, REGION_ID, seed)
        return b

    with (
        SharedSegment.create(SIZE, "dst-a") as dst_a,
        SharedSegment.create(SIZE, "dst-b") as dst_b,
    ):
        async with (
            UcxTransport(secret=SECRET) as t,
            serve(1) as (victim, info_a),
            serve(2) as (_, info_b),
        ):
            await t.register(LOCAL, dst_a)
            await t.register(LOCAL + 1, dst_b)
            peer_a, peer_b = await t.connect(info_a), await t.connect(info_b)
            batch_a, batch_b = servepeer_batch(LOCAL, 1), servepeer_batch(LOCAL + 1, 2)
            a_started = asyncio.Event()
            a_failed = asyncio.Event()

            async def pull_a_until_it_fails() -> BaseException:
                try:
                    while True:  # back to back, so the kill lands inside a pull
                        await peer_a.get(batch_a)
                        a_started.set()
                except PullFailed as exc:  # PeerLost when the kill lands mid-read
                    return exc
                finally:
                    a_failed.set()

            async def pull_b_meanwhile() -> int:
                done = 0
                while not a_failed.is_set():
                    dst_b.numpy()[:] = 0
                    await peer_b.get(batch_b)
                    assert landed(dst_b, pattern(SIZE, 2), batch_b)
                    done += 1
                return done

            task_a = asyncio.create_task(pull_a_until_it_fails())
            task_b = asyncio.create_task(pull_b_meanwhile())
            await a_started.wait()
            victim.kill()
            err = await task_a
            pulls_b = await task_b  # every pull from B beside A's death was exact
            assert pulls_b > 0
            assert "'peer-" in str(err) and f"region {LOCAL} [0, {SIZE})" in str(err), str(err)
            assert t.restarts == 0, "the serving process was not touched"
            await peer_b.get(batch_b)
            assert landed(dst_b, pattern(SIZE, 2), batch_b)


async def test_deregistering_a_region_unmaps_it_in_the_pulling_process_too() -> None:
    async with AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst-gone"))
        other = stack.enter_context(SharedSegment.create(SIZE, "dst-other"))
        a = await stack.enter_async_context(source(stack, "A", 1))
        puller = await stack.enter_async_context(UcxTransport(secret=SECRET))
        await puller.register(LOCAL, dst)
        await puller.register(LOCAL + 1, other)
        peer = await puller.connect(a.advertise())
        assert isinstance(peer, UcxPeer)
        await peer.get(reads(LOCAL))
        assert peer.pid is not None
        maps = Path(f"/proc/{peer.pid}/maps")
        mapped = await asyncio.to_thread(maps.read_text)
        assert dst.name in mapped, "a region is mapped where a pull writes it"
        await puller.deregister(LOCAL)
        # Requests to one process are handled in order: once this pull is done, the
        # deregistration before it was too.
        await peer.get(reads(LOCAL + 1))
        mapped = await asyncio.to_thread(maps.read_text)
        assert dst.name not in mapped and other.name in mapped


async def test_pulling_processes_above_the_bound_stop_least_recently_used_first_and_restart_on_use() -> (
    None
):
    async with AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst"))
        a = await stack.enter_async_context(source(stack, "A", 1))
        b = await stack.enter_async_context(source(stack, "B", 2))
        puller = await stack.enter_async_context(UcxTransport(secret=SECRET, max_peer_children=1))
        await puller.register(LOCAL, dst)
        peer_a = await puller.connect(a.advertise())
        await peer_a.get(reads())
        assert list(puller.puller_pids) == ["A"]
        peer_b = await puller.connect(b.advertise())
        assert list(puller.puller_pids) == ["B"], "A's idle reader was stopped"
        await peer_a.get(reads(seed=4))  # A's reader starts again, lazily
        assert landed(dst, a.regions[REMOTE].segment.numpy(), reads(seed=4))
        await peer_b.get(reads(seed=5))
        assert landed(dst, b.regions[REMOTE].segment.numpy(), reads(seed=5))


async def test_closing_a_peer_connection_stops_its_pulling_process() -> None:
    async with AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst"))
        a = await stack.enter_async_context(source(stack, "A", 1))
        puller = await stack.enter_async_context(UcxTransport(secret=SECRET))
        await puller.register(LOCAL, dst)
        peer = await puller.connect(a.advertise())
        assert isinstance(peer, UcxPeer)
        pid = peer.pid
        assert pid is not None
        await peer.close()
        assert puller.puller_pids == {}
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_reader_that_does_not_give_up_by_itself_is_killed_past_the_deadline_and_only_its_pull_fails() -> (
    None
):
    # The reader itself is stopped, so its own deadline cannot end the batch: the
    # owner's backstop (deadline + BACKSTOP_S) kills it.
    async with AsyncExitStack() as stack:
        dst = stack.enter_context(SharedSegment.create(SIZE, "dst"))
        a = await stack.enter_async_context(source(stack, "A", 1))
        puller = await stack.enter_async_context(UcxTransport(secret=SECRET, pull_timeout=1.0))
        await puller.register(LOCAL, dst)
        peer = await puller.connect(a.advertise())
        assert isinstance(peer, UcxPeer) and peer.pid is not None
        await peer.get(reads())  # the destination is mapped in the reader
        stuck = peer.pid
        os.kill(stuck, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(PeerLost) as failure:
            await peer.get(reads(seed=6))
        elapsed = time.monotonic() - t0
        assert "'A'" in str(failure.value) and "did not give up" in str(failure.value)
        assert 1.0 + BACKSTOP_S <= elapsed < 1.0 + BACKSTOP_S + 5, elapsed
        assert puller.restarts == 0
        await peer.get(reads(seed=6))  # from a new reader
        assert landed(dst, a.regions[REMOTE].segment.numpy(), reads(seed=6))
        assert peer.pid not in (None, stuck)
        with pytest.raises(ProcessLookupError):  # the stuck one was killed and reaped
            os.kill(stuck, 0)


async def test_a_serving_process_that_does_not_answer_a_registration_in_time_is_killed_and_restarted() -> (
    None
):
    restarted = asyncio.Event()
    async with AsyncExitStack() as stack:
        seg = stack.enter_context(SharedSegment.create(SIZE, "region"))
        t = await stack.enter_async_context(
            UcxTransport(secret=SECRET, request_timeout=1.0, on_restart=lambda g: restarted.set())
        )
        stuck = t.pid
        assert stuck is not None
        os.kill(stuck, signal.SIGSTOP)
        with pytest.raises(TransportError, match=r"timed out after 1\.0 s"):
            await t.register(LOCAL, seg)
        async with asyncio.timeout(60):
            await restarted.wait()
        assert t.pid not in (None, stuck)
        region = await t.register(LOCAL, seg)
        assert region.info.key, "the new serving process registers and advertises it"
