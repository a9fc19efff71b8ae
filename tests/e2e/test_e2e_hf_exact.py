"""``engine_exact`` on the CPU: the check ``refitd bench gpu`` runs on a GPU, here on
host memory, so its logic is tested before its GPU run (real daemon, real HTTP,
real shared memory, real Hugging Face models)."""

from __future__ import annotations

import pytest
import torch
from support.daemons import daemon_config, served

from refitd.daemon.app.node import Daemon

pytestmark = pytest.mark.timeout(300)


async def test_hugging_face_models_refitted_from_tp2_serve_what_fresh_ones_do() -> None:
    pytest.importorskip("transformers")
    from refitd.bench.hfexact import engine_exact

    lines: list[str] = []
    d = Daemon(daemon_config(node_id="hf", transport="shm"))
    async with served(d) as s:
        c = s.client
        assert await engine_exact(c, torch.device("cpu"), lines.append), lines
    assert len(lines) == 4 and all("same tokens and logits=True" in line for line in lines)
    assert "replayed" in lines[1] and "replayed" in lines[3]
