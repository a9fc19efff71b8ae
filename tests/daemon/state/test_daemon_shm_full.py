"""A full ``/dev/shm`` is a clear refusal when a region is made, never a dead daemon.

The daemon runs in a private mount namespace whose ``/dev/shm`` is an 8 MiB tmpfs
(``unshare -m``; root only, skipped elsewhere with the reason). One tenant makes
1 MiB regions until the daemon refuses one, then fills every region it was given by
reading one small leased range many times (no source bytes needed). Every admitted
region's memory was reserved when it was made, so every write lands; the refusal is
a 507 naming the shared memory; the other tenant's pull lands byte-exact after it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.daemons import daemon_config

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.errors import InsufficientStorage
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PullRequest,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(180)

TMPFS_BYTES = 8 << 20
REGION = 1 << 20
PAGE = 4096
#: a generous, named safety net for the whole scenario in its namespace (s)
SCENARIO_TIMEOUT_S = 150


def _manifest(model: str, region: int, nbytes: int) -> ManifestIn:
    shard = ShardEntry((0,), (nbytes,), region, 0)
    return ManifestIn(model, 1, 0, 1, [TensorEntry("w", (nbytes,), "uint8", [shard])])


async def _published(c: RefitClient, model: str, nbytes: int, fill: int) -> tuple[int, str, bytes]:
    """A daemon-made source region of ``nbytes`` holding a pattern, published as
    ``model`` version 1 and leased: (region id, lease id, its bytes)."""
    info = await c.create_region(nbytes, label=f"{model}-src")
    data = (np.arange(nbytes, dtype=np.uint64).astype(np.uint8) ^ fill).tobytes()
    with SharedSegment.attach(info.handle, nbytes) as seg:
        seg.numpy()[:] = np.frombuffer(data, np.uint8)
    await c.publish(_manifest(model, info.region_id, nbytes))
    lease = await c.acquire_lease(model, 1, ttl_s=600)
    return info.region_id, lease.lease_id, data


async def scenario() -> None:
    """Run inside the namespace: asserts, exits non-zero on the first failure."""
    from support.daemons import serving_daemons

    d = Daemon(daemon_config(node_id="full", transport="shm", shutdown_grace_s=0.5))
    async with serving_daemons(d) as (c,):
        # Tenant b: a version and a destination, before a fills the memory.
        b_src, b_lease, b_data = await _published(c, "b", 64 << 10, 0x5A)
        b_dst = await c.create_region(64 << 10, label="b-dst")
        # Tenant a: one page it may read, then 1 MiB regions until refused.
        a_src, a_lease, a_data = await _published(c, "a", PAGE, 0x11)
        given: list[RegionInfo] = []
        refusal = None
        for _ in range(2 * TMPFS_BYTES // REGION):
            try:
                given.append(await c.create_region(REGION, label="a-fill"))
            except InsufficientStorage as exc:
                refusal = str(exc)
                break
        assert refusal is not None, f"{len(given)} MiB of regions admitted into an 8 MiB tmpfs"
        assert "cannot reserve" in refusal and "/dev/shm" in refusal, refusal
        assert len(given) * REGION <= TMPFS_BYTES, len(given)
        # Every admitted byte is backed: a fills each region from its one page.
        for r in given:
            rows = [[a_src, 0, r.region_id, k * PAGE, PAGE] for k in range(REGION // PAGE)]
            table = DescriptorTable(np.array(rows, dtype="<i8").tobytes())
            res = await c.pull(PullRequest("a", 1, a_lease, table))
            assert res.bytes_done == REGION
            with SharedSegment.attach(r.handle, REGION) as seg:
                assert seg.numpy().tobytes() == a_data * (REGION // PAGE)
        # The daemon lives, and b's pull lands byte-exact.
        assert (await c.health())["status"] == "ok"
        rows = [[b_src, 0, b_dst.region_id, 0, len(b_data)]]
        table = DescriptorTable(np.array(rows, dtype="<i8").tobytes())
        await c.pull(PullRequest("b", 1, b_lease, table))
        with SharedSegment.attach(b_dst.handle, b_dst.nbytes) as seg:
            assert seg.numpy().tobytes() == b_data
    print(f"admitted {len(given)} regions of {REGION} bytes; refused: {refusal}")


def _namespace_refusal() -> str | None:
    """Why a private /dev/shm cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a private /dev/shm needs root (unshare -m and mount)"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "none", "/dev/shm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"a private mount namespace is not allowed here: {probe.stderr.strip()}"
    return None


def test_a_full_shm_refuses_new_regions_with_507_and_every_admitted_byte_is_writable() -> None:
    why = _namespace_refusal()
    if why is not None:
        print(f"skipped: {why}")
        pytest.skip(why)
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    script = (
        f"mount -t tmpfs -o size={TMPFS_BYTES},mode=1777 tmpfs /dev/shm && "
        f'exec "{sys.executable}" "{Path(__file__).resolve()}"'
    )
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=SCENARIO_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused:" in done.stdout, done.stdout


if __name__ == "__main__":
    asyncio.run(scenario())
