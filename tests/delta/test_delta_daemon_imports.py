"""The source daemon compares versions without importing torch.

A daemon process does not import torch (it moves bytes, and torch costs it hundreds
of MiB and, the first time, seconds with Python's GIL held). A version's delta
comparison sizes each tensor's elements by dtype; it did so through torch, so the
first version compared with deltas on loaded torch into the daemon. Here a real
``refitd serve`` child compares two versions, and its memory maps show no libtorch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon
from refitd.wire import DeltaState, ManifestIn, ShardEntry, TensorEntry
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

NBYTES = 1 << 20
SAFETY_S = 60.0
"""How long the comparison may take before the test gives up (a safety net)."""


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def test_a_version_compared_for_deltas_leaves_the_daemon_without_torch(
    secret_file: str,
) -> None:
    async with (
        spawn_daemon(secret_file=secret_file, extra_args=["--set", "pulls.deltas=true"]) as d,
        RefitClient(d.url) as c,
    ):
        for version in (1, 2):
            region = await c.create_region(NBYTES, label=f"v{version}")
            seg = SharedSegment.attach(region.handle, NBYTES)
            seg.numpy()[: NBYTES // 2] = version  # half of the bytes change
            seg.close()
            count = NBYTES // 2  # bfloat16 elements
            shard = ShardEntry((0,), (count,), region.region_id, 0)
            tensor = TensorEntry("w", (count,), "bfloat16", [shard])
            await c.publish(ManifestIn("m", version, 0, 1, [tensor]))
        info = await c.delta_info("m", 2, wait_s=SAFETY_S)
        assert info.state is DeltaState.READY, info  # compared: the dtype was sized
        assert info.changed > 0
        assert not _maps_torch(d.pid)
