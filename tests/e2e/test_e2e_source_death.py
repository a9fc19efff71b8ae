"""End to end: the source daemon is SIGKILLed while the engine's daemon pulls from it.

DESIGN.md §5, "fail closed": a dying peer costs the pull in flight a clear error that
names the source and the destination bytes now suspect; it never yields wrong bytes
as a success, never hangs the pull, and never takes the pulling daemon down.

Real parts throughout: every daemon is a ``refitd serve`` child process on
127.0.0.1:0 with its own shared memory; the engine daemon reads either over UCX
(``--transport ucx``: on one host UCX reads the source's memory through cma, and a
dead source aborts the data-plane reader) or in the default ``auto`` mode (the
proven shared-memory path, where the bytes stay readable after the source died and
the pull must fail on the lease check that follows the copy).

How the kill lands mid-pull without timing assumptions: each raw pull reads the same
source bytes many times over (a volume far larger than the memory involved, in
descriptors small enough that progress is reported batch by batch); the test polls
the pull until some bytes moved, then kills the source. A pull found already ended
at that point would make the round meaningless, and is reported as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from refitd.client.http import RefitClient
from refitd.client.publisher import Publisher
from refitd.client.receiver import DaemonReceiver
from refitd.client.spawn import SpawnedDaemon, spawn_daemon
from refitd.errors import RefitError
from refitd.testing.engines import default_weight_loader
from refitd.wire import DescriptorTable, PullProgress, PullRequest, PullState
from transports.segments import SharedSegment, cleanup_stale

pytestmark = [pytest.mark.timeout(180)]

#: the engine daemon reads from source daemons started after it, on ports unknown
#: until they are up: it trusts every daemon on loopback
LOOPBACK_PEERS = ["http://127.0.0.1:*"]

REGION = 8 << 20
"""Bytes of the source tensor of a raw pull."""
ROW = 4 << 10
"""Bytes per descriptor: small, so both paths report progress batch by batch."""
PASSES = 32
"""Copies of the source tensor a raw pull lays side by side in its destination
(a plan writes each destination byte once, but may read a source byte many times)."""
DST = REGION * PASSES
KILLS = 3
"""Source daemons killed mid-pull per test."""
PULL_BOUND_S = 60.0
"""A failed pull must end within this many seconds of the kill (else: a hang)."""
TERMINAL = {PullState.DONE, PullState.FAILED, PullState.CANCELLED}


@pytest.fixture
def secret(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@contextlib.asynccontextmanager
async def source_daemon(
    secret: str, name: str, transport: str = "auto"
) -> AsyncIterator[tuple[SpawnedDaemon, RefitClient]]:
    """A trainer-side daemon (data plane ``transport``) and its client; it may be
    SIGKILLed inside the block."""
    async with (
        spawn_daemon(secret_file=secret, node_id=name, transport=transport) as d,
        RefitClient(d.url) as c,
    ):
        yield d, c
    # A killed daemon leaves its segments behind (SIGKILL runs no cleanup).
    await asyncio.to_thread(cleanup_stale)


def pattern(seed: int) -> torch.Tensor:
    """REGION bytes of seed-dependent int32 values (two rounds never agree)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (REGION // 4,), dtype=torch.int32, generator=g)


async def publish_raw(c: RefitClient, model: str, seed: int) -> tuple[Publisher, int]:
    """Publish ``pattern(seed)`` as tensor "w" of ``model`` v1; returns the publisher
    and the source region it lives in."""
    pub = Publisher(c, model)
    info = await pub.reserve(REGION)
    pub.put("w", pattern(seed))
    await pub.publish(1)
    return pub, info.region_id


def repeated_reads(src: int, dst: int, passes: int) -> DescriptorTable:
    """Descriptors reading all of source region ``src`` ``passes`` times, copy k landing
    at byte ``k * REGION`` of ``dst``, in ROW-byte rows."""
    offs = np.arange(0, REGION, ROW, dtype=np.int64)
    rows = np.tile(
        np.stack(
            [np.full_like(offs, src), offs, np.full_like(offs, dst), offs, np.full_like(offs, ROW)],
            axis=1,
        ),
        (passes, 1),
    )
    rows[:, 3] += np.repeat(np.arange(passes, dtype=np.int64) * REGION, offs.size)
    return DescriptorTable.pack(rows)


async def kill_once_bytes_moved(
    engine: RefitClient, pull_id: str, victim: SpawnedDaemon
) -> PullProgress:
    """Poll ``pull_id`` until some of its bytes moved, then SIGKILL ``victim``.
    Returns the last snapshot seen before the kill."""
    while True:
        p = await engine.pull_status(pull_id)
        if p.bytes_done > 0 or p.state in TERMINAL:
            break
    os.kill(victim.pid, signal.SIGKILL)
    return p


async def failed_pull(engine: RefitClient, pull_id: str) -> tuple[RefitError, PullProgress]:
    """Wait (bounded) for ``pull_id`` to end; it must fail. Returns error and result."""
    async with asyncio.timeout(PULL_BOUND_S):
        with pytest.raises(RefitError) as caught:
            await engine.wait_pull(pull_id)
    progress = getattr(caught.value, "progress", None)
    assert isinstance(progress, PullProgress)
    return caught.value, progress


async def engine_still_serves(engine: RefitClient, dst_region: int) -> None:
    """The engine daemon answers health and regions, and a new local pull (both regions
    on the engine daemon itself) moves bytes correctly."""
    assert (await engine.health())["status"] == "ok"
    assert dst_region in {r.region_id for r in await engine.regions()}
    model = f"local{os.urandom(3).hex()}"
    pub = Publisher(engine, model)
    src = await pub.reserve(4096)
    value = torch.arange(256, dtype=torch.float32)
    pub.put("w", value)
    await pub.publish(1)
    with SharedSegment.create(1024, "local-dst") as seg:
        dst = await engine.attach_region(seg.name, 1024)
        lease = await engine.acquire_lease(model, 1)
        rows = np.array([[src.region_id, 0, dst.region_id, 0, 1024]], dtype=np.int64)
        req = PullRequest(model, 1, lease.lease_id, DescriptorTable.pack(rows), [], "")
        async with asyncio.timeout(PULL_BOUND_S):
            done = await engine.pull(req)
        assert done.state is PullState.DONE and done.bytes_done == 1024
        assert torch.equal(torch.from_numpy(seg.numpy(np.float32).copy()), value)
        await engine.release_lease(lease.lease_id)
        await engine.delete_region(dst.region_id)
    await pub.close()


@pytest.mark.parametrize("transport", ["ucx", "tcp", "auto"])
async def test_killing_the_source_daemon_mid_pull_fails_that_pull_closed_and_the_engine_daemon_serves_on(
    secret: str, transport: str
) -> None:
    model = f"raw-{transport}"
    async with (
        spawn_daemon(
            secret_file=secret, transport=transport, node_id="engine-host", peers=LOOPBACK_PEERS
        ) as e,
        RefitClient(e.url) as engine,
    ):
        with SharedSegment.create(DST, "dst") as seg:
            dst = (await engine.attach_region(seg.name, DST)).region_id
            for round_ in range(KILLS):
                seg.numpy()[:] = 0
                async with source_daemon(secret, f"trainer-{round_}", transport) as (
                    victim,
                    src_c,
                ):
                    pub, src = await publish_raw(src_c, model, round_)
                    lease = await src_c.acquire_lease(model, 1, ttl_s=120)
                    req = PullRequest(
                        model, 1, lease.lease_id, repeated_reads(src, dst, PASSES), [], victim.url
                    )
                    started = await engine.submit_pull(req)
                    seen = await kill_once_bytes_moved(engine, started.pull_id, victim)
                    assert seen.state not in TERMINAL, (
                        f"round {round_}: the pull ended ({seen.state}) before the kill landed; "
                        "raise PASSES so it lasts longer"
                    )
                    err, result = await failed_pull(engine, started.pull_id)
                    await pub.close()
                assert result.state is PullState.FAILED, result
                # The failure names the source it read from and every destination
                # byte that may be torn: here the whole destination region.
                assert f"'trainer-{round_}' at {victim.url}" in str(err), str(err)
                assert [tuple(s) for s in result.suspect] == [(dst, 0, DST)], result.suspect
                await engine_still_serves(engine, dst)
            # A new source daemon republishes; the same pull now completes bit-exact.
            seg.numpy()[:] = 0
            async with source_daemon(secret, "trainer-new", transport) as (_, src_c):
                pub, src = await publish_raw(src_c, model, 99)
                lease = await src_c.acquire_lease(model, 1)
                req = PullRequest(
                    model, 1, lease.lease_id, repeated_reads(src, dst, PASSES), [], src_c.base_url
                )
                async with asyncio.timeout(PULL_BOUND_S):
                    done = await engine.pull(req)
                assert done.state is PullState.DONE and done.bytes_done == DST
                want = np.tile(pattern(99).numpy(), PASSES)
                assert np.array_equal(seg.numpy(np.int32), want)
                await src_c.release_lease(lease.lease_id)
                await pub.close()


# ---------------------------------------------------------------- staging refit

PARAMS = 4
SHAPE = (2048, 4096)  # float32: 32 MiB per parameter, 128 MiB per engine


class Wide(torch.nn.Module):
    """An engine of PARAMS plain float32 matrices, each loaded whole."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        for i in range(PARAMS):
            w = torch.nn.Parameter(torch.zeros(SHAPE, device=device), requires_grad=False)
            w.weight_loader = self._whole  # type: ignore[attr-defined]
            self.register_parameter(f"w{i}", w)

    @staticmethod
    def _whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.copy_(loaded)

    def load_weights(self, weights: Any) -> None:
        params = dict(self.named_parameters())
        for name, loaded in weights:
            params[name].weight_loader(params[name], loaded)  # type: ignore[attr-defined]


def wide_capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
    from refitd.reshard.geometry import capture_geometry

    return capture_geometry(twin, manifest, default_weight_loader)


def wide_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(SHAPE, generator=g) for i in range(PARAMS)}


async def publish_wide(c: RefitClient, model: str, state: dict[str, torch.Tensor]) -> Publisher:
    pub = Publisher(c, model)
    await pub.reserve(sum(t.numel() * 4 for t in state.values()) + 4096 * PARAMS)
    for name, t in state.items():
        pub.put(name, t)
    await pub.publish(1)
    return pub


async def test_a_staging_refit_whose_source_daemon_dies_installs_nothing_and_a_new_source_refits_bit_exact(
    secret: str,
) -> None:
    model = "wide"
    eng = Wide()
    async with (
        spawn_daemon(
            secret_file=secret, transport="ucx", node_id="engine-host", peers=LOOPBACK_PEERS
        ) as e,
        RefitClient(e.url) as engine,
    ):
        first = wide_state(1)
        async with source_daemon(secret, "trainer-1", "ucx") as (_, src_c):
            pub = await publish_wide(src_c, model, first)
            r = DaemonReceiver(
                local=engine,
                source=src_c,
                model=model,
                engine=eng,
                twin=lambda: Wide("meta"),
                capture=wide_capture,
            )
            await r.refit()
            await pub.close()
        assert all(torch.equal(p, first[n]) for n, p in eng.named_parameters())
        before = {n: p.detach().clone() for n, p in eng.named_parameters()}

        async with source_daemon(secret, "trainer-2", "ucx") as (victim, src_c):
            pub = await publish_wide(src_c, model, wide_state(2))
            r.source = src_c
            refit = asyncio.create_task(r.refit())
            # Kill once the refit's pull is running at the engine daemon.
            while not refit.done():
                running = [p for p in await engine.pulls() if p.state is PullState.RUNNING]
                if running:
                    os.kill(victim.pid, signal.SIGKILL)
                    break
            assert not refit.done(), "the refit ended before its pull was seen running"
            async with asyncio.timeout(PULL_BOUND_S):
                with pytest.raises(RefitError) as caught:
                    await refit
            await pub.close()
        progress = getattr(caught.value, "progress", None)
        assert progress is not None and progress.state is PullState.FAILED, caught.value
        assert "'trainer-2'" in str(caught.value), str(caught.value)
        assert progress.suspect, "a pull that failed after bytes moved names suspect ranges"
        # Staging mode: the failed pull wrote scratch only; the parameters are as before.
        assert all(torch.equal(p, before[n]) for n, p in eng.named_parameters())
        assert (await engine.health())["status"] == "ok"

        third = wide_state(3)
        async with source_daemon(secret, "trainer-3", "ucx") as (_, src_c):
            pub = await publish_wide(src_c, model, third)
            r.source = src_c
            async with asyncio.timeout(PULL_BOUND_S):
                stats = await r.refit()
            assert stats.version == 1
            assert all(torch.equal(p, third[n]) for n, p in eng.named_parameters())
            await pub.close()
        await r.close()
