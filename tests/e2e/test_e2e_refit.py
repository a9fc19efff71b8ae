"""End to end: a trainer publishes through daemon A, engines refit through daemon B.

Both daemons are real `refitd serve` processes on 127.0.0.1:0, each with its own
shared memory, exchanging region records over HTTP and bytes over real UCX. Every
engine parameter is compared bit for bit with the engine's own loader run on the
full checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.client.spawn import spawn_daemon
from refitd.errors import ConflictError, ProtocolError
from refitd.reshard.types import UnsupportedReshard
from refitd.testing.engines import (
    EngineParallel,
    ModelConfig,
    ToyEngine,
    dense_toy_config,
    moe_toy_config,
)
from refitd.testing.layouts import Published, fsdp_dim0, full_state, megatron_tp_ep
from refitd.wire import DescriptorTable, PullRequest
from transports.segments import SharedSegment

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


@dataclass
class Pair:
    trainer: RefitClient  # daemon A: holds the published versions
    engine: RefitClient  # daemon B: pulls into the engines' memory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    async with (
        spawn_daemon(secret_file=str(secret), transport="ucx", node_id="trainer-host") as a,
        spawn_daemon(
            secret_file=str(secret), transport="ucx", node_id="engine-host", peers=[a.url]
        ) as b,
        RefitClient(a.url) as ca,
        RefitClient(b.url) as cb,
    ):
        yield Pair(ca, cb)


def engine_par(cfg: ModelConfig, tp: int, rank: int) -> EngineParallel:
    return EngineParallel(tp, rank, 2 if cfg.num_experts else 1)


def receiver(
    pair: Pair,
    model: str,
    cfg: ModelConfig,
    par: EngineParallel,
    pub: Published,
    engine: torch.nn.Module,
    **kw: Any,
) -> DaemonReceiver:
    return DaemonReceiver(
        local=pair.engine,
        source=pair.trainer,
        model=model,
        engine=engine,
        twin=lambda: ToyEngine(cfg, par),
        capture=capture_for(pub),
        **kw,
    )


LAYOUTS: dict[str, tuple[Callable[[ModelConfig, Any], Published], int]] = {
    # trainer layout -> (publish, engine TP)
    "megatron-tp2-to-engine-tp4": (
        lambda c, s: megatron_tp_ep(c, 2, 2 if c.num_experts else 1, s),
        4,
    ),
    "fsdp4-to-engine-tp2": (lambda c, s: fsdp_dim0(c, 4, s), 2),
}
MODELS = {"dense": dense_toy_config, "moe": moe_toy_config}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", sorted(MODELS))
async def test_every_engine_rank_refits_bit_exact_and_the_next_version_replays_the_plan(
    pair: Pair, kind: str, layout: str
) -> None:
    cfg = MODELS[kind]()
    make, tp = LAYOUTS[layout]
    model = f"{kind}-{layout}"
    state1 = full_state(cfg)
    pub1 = make(cfg, state1)
    pubs = await publish_layout(pair.trainer, model, pub1, 1)
    # A small descriptor budget makes the planner use pack specs and full reads too.
    budget = 2 if kind == "moe" else 64
    receivers = []
    for rank in range(tp):
        par = engine_par(cfg, tp, rank)
        eng = zeroed_engine(cfg, par)
        r = receiver(pair, model, cfg, par, pub1, eng, max_reads_per_copy=budget)
        stats = await r.refit()
        assert stats.version == 1 and not stats.replayed
        assert mismatched(eng, cfg, par, state1) == []
        receivers.append((r, eng, par))
    # Version 2 rewrites the same memory: wait for readers, write, publish, replay.
    await pubs[0].wait_drain(1)
    state2 = full_state(cfg, seed=7)
    await publish_layout(pair.trainer, model, make(cfg, state2), 2, pubs)
    for r, eng, par in receivers:
        stats = await r.refit()
        assert stats.version == 2 and stats.replayed and r.plans == 1
        assert mismatched(eng, cfg, par, state2) == []
        await r.close()
    for p in pubs:
        await p.close()


async def test_a_changed_trainer_layout_is_detected_and_replanned(pair: Pair) -> None:
    cfg = dense_toy_config()
    state1, state2 = full_state(cfg), full_state(cfg, seed=3)
    p1 = fsdp_dim0(cfg, 4, state1)
    await publish_layout(pair.trainer, "relayout", p1, 1)
    par = engine_par(cfg, 2, 1)
    eng = zeroed_engine(cfg, par)
    r = receiver(pair, "relayout", cfg, par, p1, eng)
    assert not (await r.refit()).replayed
    # The trainer reshards to FSDP-2 (new regions, new shard boxes) for version 2.
    p2 = fsdp_dim0(cfg, 2, state2)
    await publish_layout(pair.trainer, "relayout", p2, 2)
    stats = await r.refit()
    assert stats.version == 2 and not stats.replayed and r.plans == 2
    assert mismatched(eng, cfg, par, state2) == []
    await r.close()


async def test_strict_mode_refuses_to_replan_a_changed_layout(pair: Pair) -> None:
    cfg = dense_toy_config()
    state = full_state(cfg)
    await publish_layout(pair.trainer, "strict", fsdp_dim0(cfg, 4, state), 1)
    par = engine_par(cfg, 2, 0)
    eng = zeroed_engine(cfg, par)
    r = receiver(pair, "strict", cfg, par, fsdp_dim0(cfg, 4, None), eng, strict=True)
    await r.refit()
    await publish_layout(pair.trainer, "strict", fsdp_dim0(cfg, 2, full_state(cfg, seed=1)), 2)
    with pytest.raises(ConflictError, match="warm the exact signature"):
        await r.refit()
    assert mismatched(eng, cfg, par, state) == []  # still version 1, untouched
    await r.close()


class Doubling(torch.nn.Module):
    """An engine whose loader computes on the checkpoint tensor: not a movement op."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)

    def load_weights(self, weights: Any) -> None:
        for _, loaded in weights:
            self.w.copy_(loaded * 2)


def doubling_capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
    from refitd.reshard.geometry import capture_geometry
    from refitd.testing.engines import default_weight_loader

    return capture_geometry(twin, manifest, default_weight_loader)


async def test_an_unsupported_source_refuses_the_refit_before_any_transfer(pair: Pair) -> None:
    from refitd.client.publisher import Publisher

    pub = Publisher(pair.trainer, "doubling")
    await pub.reserve(4096)
    pub.put("w", torch.arange(32, dtype=torch.float32).view(4, 8))
    await pub.publish(1)
    before = len(await pair.engine.pulls())
    eng = Doubling()
    r = DaemonReceiver(
        local=pair.engine,
        source=pair.trainer,
        model="doubling",
        engine=eng,
        twin=Doubling,
        capture=doubling_capture,
    )
    with pytest.raises(UnsupportedReshard, match=r"refused before any transfer.*'w'"):
        await r.refit()
    assert len(await pair.engine.pulls()) == before
    assert not eng.w.any()
    assert (await pair.trainer.version("doubling", 1)).leases == 0
    await r.close()
    await pub.close()


@pytest_asyncio.fixture(loop_scope="module")
async def published_toy(pair: Pair) -> AsyncIterator[tuple[int, int, SharedSegment, str]]:
    """Model 'raw': one 4x8 float32 tensor at daemon A, and an empty 64-byte
    destination region at daemon B. Yields (src region, dst region, dst segment, model)."""
    from refitd.client.publisher import Publisher

    model = f"raw{os.urandom(3).hex()}"
    pub = Publisher(pair.trainer, model)
    src = await pub.reserve(128)
    pub.put("w", torch.arange(32, dtype=torch.float32).view(4, 8))
    await pub.publish(1)
    dst = SharedSegment.create(64, "dst")
    info = await pair.engine.attach_region(dst.name, 64)
    yield src.region_id, info.region_id, dst, model
    await pair.engine.delete_region(info.region_id)
    dst.close()
    await pub.close()


def table(rows: list[list[int]]) -> DescriptorTable:
    return DescriptorTable.pack(np.array(rows, dtype=np.int64).reshape(-1, 5))


async def test_an_out_of_bounds_descriptor_is_refused_naming_it_and_nothing_is_written(
    pair: Pair, published_toy: tuple[int, int, SharedSegment, str]
) -> None:
    src, dst, seg, model = published_toy
    lease = await pair.trainer.acquire_lease(model, 1)
    rows = [[src, 0, dst, 0, 32], [src, 0, dst, 40, 32]]  # the second overruns 64 bytes
    req = PullRequest(model, 1, lease.lease_id, table(rows), [], pair.trainer.base_url)
    with pytest.raises(ProtocolError, match=r"descriptor 1 refused.*destination range"):
        await pair.engine.submit_pull(req)
    assert not seg.numpy().any()
    ok = PullRequest(model, 1, lease.lease_id, table(rows[:1]), [], pair.trainer.base_url)
    assert (await pair.engine.pull(ok)).bytes_done == 32
    assert seg.numpy(np.float32)[:8].tolist() == [float(i) for i in range(8)]


async def test_an_unleased_or_stale_version_is_refused_with_409(
    pair: Pair, published_toy: tuple[int, int, SharedSegment, str]
) -> None:
    src, dst, seg, model = published_toy
    lease = await pair.trainer.acquire_lease(model, 1)
    await pair.trainer.release_lease(lease.lease_id)
    req = PullRequest(
        model, 1, lease.lease_id, table([[src, 0, dst, 0, 32]]), [], pair.trainer.base_url
    )
    with pytest.raises(ConflictError, match="unknown or was released"):
        await pair.engine.submit_pull(req)
    # Version 2 retires version 1: a new lease on it, and so any read, is refused.
    from refitd.client.publisher import Publisher

    pub = Publisher(pair.trainer, model)
    await pub.reserve(128)
    pub.put("w", torch.ones(4, 8))
    await pub.publish(2)
    with pytest.raises(ConflictError, match=r"retired|newer version"):
        await pair.trainer.acquire_lease(model, 1)
    assert not seg.numpy().any()
    await pub.close()


class ColumnSwap(torch.nn.Module):
    """An engine that loads columns 4..7 of the checkpoint tensor into columns 0..3 of
    its parameter: strided on both sides, so a pack spec lands scattered."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16, 8), requires_grad=False)
        self.w.weight_loader = self._columns  # type: ignore[attr-defined]

    @staticmethod
    def _columns(param: torch.Tensor, loaded: torch.Tensor) -> None:
        param[:, 0:4].copy_(loaded[:, 4:8])

    def load_weights(self, weights: Any) -> None:
        for _, loaded in weights:
            self.w.weight_loader(self.w, loaded)  # type: ignore[attr-defined]


def column_capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
    from refitd.reshard.geometry import capture_geometry
    from refitd.testing.engines import default_weight_loader

    return capture_geometry(twin, manifest, default_weight_loader)


@pytest.mark.parametrize("mode", ["staging", "direct"])
async def test_a_packed_block_for_a_strided_destination_is_scattered_on_arrival(
    pair: Pair, mode: str
) -> None:
    from refitd.client.publisher import Publisher

    model = f"columns-{mode}"
    full = torch.arange(128, dtype=torch.float32).view(16, 8)
    pubs = []
    for part in (0, 1):
        pub = Publisher(pair.trainer, model, part, 2)
        await pub.reserve(1024)
        # Column blocks (not dim-0 rows), so a full read of bounding rows is no option.
        pub.put("w", full[:, part * 4 : part * 4 + 4].clone(), (16, 8), (0, part * 4))
        await pub.publish(1)
        pubs.append(pub)
    eng = ColumnSwap()
    r = DaemonReceiver(
        local=pair.engine,
        source=pair.trainer,
        model=model,
        engine=eng,
        twin=ColumnSwap,
        capture=column_capture,
        mode=mode,  # type: ignore[arg-type]
        max_reads_per_copy=1,
        allow_unwritten=["w"],  # this engine's loader fills columns 0..3 only, by design
    )
    stats = await r.refit()
    assert stats.pack_specs >= 1
    assert stats.scattered >= 1  # the packed bytes landed strided
    want = torch.zeros(16, 8)
    want[:, 0:4] = full[:, 4:8]
    assert torch.equal(eng.w, want)
    await r.close()
    for p in pubs:
        await p.close()


async def test_a_double_buffered_trainer_is_planned_once_per_buffer_then_replayed(
    pair: Pair,
) -> None:
    """A trainer that double-buffers publishes odd versions from one set of memory and
    even ones from another (each its own regions: the planner's sessions). The engine
    plans each set once and replays both from then on (it kept one plan, and planned
    every version again), every version bit exact."""
    cfg = dense_toy_config()
    model = "double-buffered"
    buffers: list[list[Any] | None] = [None, None]
    par = engine_par(cfg, 2, 0)
    eng = zeroed_engine(cfg, par)
    r: DaemonReceiver | None = None
    for version in range(1, 6):
        state = full_state(cfg, seed=version)
        pub = fsdp_dim0(cfg, 2, state)
        which = (version - 1) % 2
        if buffers[which] is not None:  # that buffer's last version: readers first
            await buffers[which][0].wait_drain(version - 2)  # type: ignore[index]
        buffers[which] = await publish_layout(pair.trainer, model, pub, version, buffers[which])
        if r is None:
            r = receiver(pair, model, cfg, par, pub, eng)
        stats = await r.refit()
        assert stats.version == version
        assert stats.replayed is (version > 2), version  # each buffer planned once
        assert r.plans == min(version, 2)
        assert mismatched(eng, cfg, par, state) == []
    assert r is not None
    await r.close()
    for pubs in buffers:
        for p in pubs or []:
            await p.close()


async def test_pulls_kept_for_a_buffer_are_lowered_again_once_the_scratch_they_name_is_replaced(
    pair: Pair,
) -> None:
    """A double-buffered trainer under a descriptor budget small enough that the engine
    gathers through a scratch region. When the receiver replaces that region (a plan
    needing a larger one does), the pulls it kept for the buffers name the region
    gone: they are lowered again, and the next versions are bit exact (a kept pull
    that still named it failed the third version)."""
    cfg = moe_toy_config()
    model = "buffers-and-scratch"
    buffers: list[list[Any] | None] = [None, None]
    par = engine_par(cfg, 2, 0)
    eng = zeroed_engine(cfg, par)
    r: DaemonReceiver | None = None
    for version in range(1, 5):
        state = full_state(cfg, seed=version)
        pub = fsdp_dim0(cfg, 2, state)
        which = (version - 1) % 2
        if buffers[which] is not None:
            await buffers[which][0].wait_drain(version - 2)  # type: ignore[index]
        buffers[which] = await publish_layout(pair.trainer, model, pub, version, buffers[which])
        if r is None:
            r = receiver(pair, model, cfg, par, pub, eng, max_reads_per_copy=2)
        await r.refit()
        assert mismatched(eng, cfg, par, state) == []
        if version == 2:  # as a plan needing more scratch would: a new, larger region
            assert r.memory.scratch is not None
            old = r.memory.scratch.region
            assert (await r._scratch(2 * old.nbytes)).region_id != old.region_id
    assert r is not None
    await r.close()
    for pubs in buffers:
        for p in pubs or []:
            await p.close()
