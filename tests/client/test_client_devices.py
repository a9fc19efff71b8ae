"""Where an engine's parameters live decides where refitd puts them; CPU checks.

GPU parameters stay on their GPU (tests/gpu/test_gpu_regions.py, on a GPU); host
parameters keep the shared-segment path (tests/e2e). Here: an engine whose
parameters are spread over devices is refused before anything is registered
(:class:`~refitd.client.engine.EngineMemory`), and a host tensor is not placed.
"""

from __future__ import annotations

import pytest
import torch
from support.daemons import daemon_config, served

from refitd.client.http import RefitClient
from refitd.client.receiver import DaemonReceiver
from refitd.daemon.app.node import Daemon
from refitd.errors import ConflictError

pytestmark = pytest.mark.timeout(60)


class Split(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.b = torch.nn.Parameter(torch.zeros(4, device="meta"))


async def test_an_engine_with_parameters_on_two_devices_is_refused_before_anything_is_registered() -> (
    None
):
    d = Daemon(daemon_config(node_id="split", transport="shm"))
    async with served(d) as s:
        c = s.client
        r = DaemonReceiver(
            local=c, source=c, model="m", engine=Split(), twin=Split, capture=lambda m, s: None
        )
        with pytest.raises(ConflictError, match="2 devices"):
            await r.refit(1)
        assert await c.regions() == []


async def test_a_host_tensor_is_published_by_copy_not_in_place() -> None:
    from refitd.client.publisher import Publisher
    from refitd.errors import PlanError

    async with RefitClient("http://127.0.0.1:9") as c:  # refused before any request
        with pytest.raises(PlanError, match="goes through put"):
            await Publisher(c, "m").place("w", torch.zeros(4))
