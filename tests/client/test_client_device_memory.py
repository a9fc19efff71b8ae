"""The receiver's path for parameters in device memory, run on a host without a GPU.

:class:`~refitd.client.engine.EngineMemory` places GPU parameters in memory that is
no shared segment, registered as a GPU allocation is; the daemon pulls into it through
its device engine, and the one install lands the pull with torch copies on it. Here
that memory is ``hostdev`` (tests/support/devices.py: a device kind over host memory
with a copy engine of its own, recorded by the daemon as an opened GPU allocation),
so everything but the CUDA calls runs: the placing, the scratch on the device, the
install in staging and direct mode, swap mode falling back to staging, and a delta
receiver refitting in full. tests/gpu/test_gpu_regions.py runs the same on a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch
from support.daemons import daemon_config, serving_daemons
from support.devices import HostDeviceEngine, HostDeviceMemory
from support.engines import mismatched

from refitd.bench.refit import capture_for, publish_layout
from refitd.client.deltarefit import DeltaReceiver
from refitd.client.engine import Area, EngineMemory
from refitd.client.receiver import DaemonReceiver
from refitd.daemon.app.node import Daemon
from refitd.testing.engines import EngineParallel, ToyEngine, moe_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep
from refitd.wire import MemoryKind, RegionAttach

pytestmark = pytest.mark.timeout(120)


class HostDevEngineMemory(EngineMemory):
    """An engine's memory allocated as ``hostdev`` device memory, recorded by the
    in-process daemon ``daemon`` as an opened GPU allocation (its own opening: the
    engine keeps the first, as a GPU allocation's owner does)."""

    def __init__(self, daemon: Daemon, *args: Any) -> None:
        super().__init__(*args)
        self.daemon = daemon
        self.kept: list[HostDeviceMemory] = []
        self.device_engine = HostDeviceEngine()

    async def allocate(self, nbytes: int, label: str) -> Area:
        memory = HostDeviceMemory(max(nbytes, 1), self.device_engine)
        self.kept.append(memory)
        req = RegionAttach(memory.name, memory.size, MemoryKind.CUDA, label=label)
        region = await self.daemon.store.record_attached(memory.opened_again(), req)
        raw = (ctypes.c_ubyte * memory.size).from_address(memory.address)
        return Area(region, torch.from_numpy(np.ctypeslib.as_array(raw)))


CFG = moe_toy_config()  # fused experts: full reads replayed from scratch
PAR = EngineParallel(2, 1, 1)


def layout_of(state: dict[str, torch.Tensor]) -> Any:
    return megatron_tp_ep(CFG, 2, 1, state)


@pytest.mark.parametrize("mode", ["staging", "direct", "swap"])
async def test_an_engine_in_device_memory_refits_each_version_exactly_on_the_device_path(
    mode: str,
) -> None:
    d = Daemon(daemon_config(node_id="devices", transport="shm"))
    async with serving_daemons(d) as (c,):
        engine = ToyEngine(CFG, PAR)
        r = DaemonReceiver(
            local=c,
            source=c,
            model="m",
            engine=engine,
            twin=lambda: ToyEngine(CFG, PAR),
            capture=capture_for(layout_of(full_state(CFG, seed=1))),
            mode=mode,  # type: ignore[arg-type]
            max_reads_per_copy=2,
        )
        r.memory = HostDevEngineMemory(d, c, r._params)
        pubs = []
        try:
            for version in (1, 2):
                state = full_state(CFG, seed=version)
                pubs += await publish_layout(c, "m", layout_of(state), version)
                stats = await r.refit(version)
                assert mismatched(engine, CFG, PAR, state) == []
                assert stats.pull.path == "shm+hostdev"
            assert stats.full_reads > 0  # replayed from scratch in device memory
            assert r.memory.on_device and r.memory.shadow is None
            assert r.mode == ("staging" if mode == "swap" else mode)
            kinds = {x.kind for x in await c.regions() if x.label in ("engine", "scratch")}
            assert kinds == {MemoryKind.CUDA}
        finally:
            await r.close()
            for p in pubs:
                await p.close()
        assert not [x for x in await c.regions() if x.label in ("engine", "scratch")]


async def test_a_delta_receiver_in_device_memory_refits_in_full_and_says_why() -> None:
    d = Daemon(daemon_config(node_id="devices", transport="shm", deltas=True))
    async with serving_daemons(d) as (c,):
        engine = ToyEngine(CFG, PAR)
        r = DeltaReceiver(
            local=c,
            source=c,
            model="m",
            engine=engine,
            twin=lambda: ToyEngine(CFG, PAR),
            capture=capture_for(layout_of(full_state(CFG, seed=1))),
            max_reads_per_copy=2,
        )
        r.memory = HostDevEngineMemory(d, c, r._params)
        pubs = []
        try:
            for version in (1, 2):
                state = full_state(CFG, seed=version)
                pubs += await publish_layout(c, "m", layout_of(state), version)
                await r.refit(version)
                assert mismatched(engine, CFG, PAR, state) == []
            assert r.last is not None and r.last.kind == "full"
            assert "GPU memory" in r.last.reason
        finally:
            await r.close()
            for p in pubs:
                await p.close()
