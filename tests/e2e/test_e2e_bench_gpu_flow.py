"""``refitd bench gpu``'s flow on the CPU: its pulls and refits, on host memory, so the
benchmark's own logic (publishing, replays, checks, keys) is tested before its first
GPU run. The GPU figures themselves come only from a GPU (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
from support.daemons import daemon_config, served

from refitd.bench.gpu import GpuResult, pulls, refit
from refitd.daemon.app.node import Daemon

pytestmark = pytest.mark.timeout(300)


async def test_the_gpu_benchmarks_pulls_and_refits_verify_every_byte_on_host_memory() -> None:
    cpu = torch.device("cpu")
    res = GpuResult()
    d = Daemon(daemon_config(node_id="bench-flow", transport="shm"))
    async with served(d) as s:
        c = s.client
        await pulls(c, res, 4 << 20, 512, cpu)
        from_memory = await refit(c, 0.01, 2, True, res, cpu)  # its "GPU" buffers: segments
        from_host = await refit(c, 0.01, 2, False, res, cpu)
    assert res.verified, res.notes
    assert res.pull_gbps > 0 and res.gpu_4k_gbps > 0
    assert from_memory > 0 and from_host > 0, "no replayed version was measured"
    assert sum("replayed" in n for n in res.notes) == 2, res.notes
    keys = res.keys()
    assert keys["verified"] == 1 and keys["gpu_cross_host_ratio"] == "pending"
