"""The README's quickstart for your own trainer and engine runs as written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm_models import readme_blocks

from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon

pytestmark = pytest.mark.timeout(120)


async def test_the_readme_quickstart_publishes_and_refits_a_custom_engine(secret_file: str) -> None:
    publisher_block, receiver_block = readme_blocks(
        "## Using refitd from your own trainer and engine"
    )
    ns: dict[str, Any] = {}
    exec(publisher_block + "\n" + receiver_block, ns)
    full = torch.arange(64, dtype=torch.float32).view(8, 8)
    async with spawn_daemon(secret_file=secret_file) as d, RefitClient(d.url) as client:
        pub = await ns["publish_two_blocks"](client, full)
        engine = ns["Engine"]()
        await ns["refit_engine"](client, engine)
        assert torch.equal(engine.w, full[2:6])
        await pub.close()
