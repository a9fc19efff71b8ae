"""A segment a client attaches is mapped whole into the daemon when it is attached.

The client's writes map its segment's pages only in the client. Before this, the
daemon's first pull into an attached segment (an engine's parameters, a swap
engine's second segment) took one page fault per 4 KiB page on its own mapping:
at 2 GiB, half a million faults inside the first refit (docs/benchmarks.md). Now
the daemon maps every page when the segment is attached, once per allocation, and
the pull writes into pages already mapped.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.daemons import served
from support.toy import publish_tensor, pull_rows

from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

CHILD_S = 90.0
"""Safety net for the child that attaches on a small shared-memory filesystem."""
NBYTES = 64 << 20
PAGES = NBYTES // 4096


def faults() -> int:
    """Minor page faults of this process so far (the daemon runs in it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def test_the_first_pull_into_an_attached_segment_takes_no_fault_a_page() -> None:
    """A 64 MiB pull from a daemon region into a client's attached segment: the
    pull faults in far fewer pages than it writes (without the mapping at attach it
    took one fault a page written), and lands every byte."""
    async with served(transport="shm") as s:
        c = s.client
        src = await c.create_region(NBYTES, label="src")  # the daemon's: mapped already
        data = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
        with SharedSegment.attach(src.handle, NBYTES) as seg:
            seg.numpy()[:] = data
        await publish_tensor(c, "m", 1, src.region_id, NBYTES)
        with SharedSegment.create(NBYTES, "engine") as engine:  # written here: mapped here
            dst = await c.attach_region(engine.name, NBYTES, label="engine")
            lease = await c.acquire_lease("m", 1, 60.0)
            before = faults()
            req = pull_rows("m", 1, lease.lease_id, (src.region_id, 0, dst.region_id, 0, NBYTES))
            await c.pull(req)
            taken = faults() - before
            assert np.array_equal(engine.numpy(), data)
            assert taken < PAGES // 4, f"{taken} page faults pulling {PAGES} pages"


SPARSE_CHILD = """
import asyncio
from support.daemons import served
from refitd.errors import ProtocolError
from transports.segments import SharedSegment

async def main() -> None:
    async with served(transport="shm") as s:
        with SharedSegment.create(8 << 20, "sparse", reserve=False) as seg:
            try:
                await s.client.attach_region(seg.name, 8 << 20, label="sparse")
            except ProtocolError as exc:
                assert seg.name in str(exc) and "sparse" in str(exc), exc
                held = [r for r in await s.client.regions() if r.label == "sparse"]
                print("refused" if held == [] else f"held {held}")
            else:
                print("attached")

asyncio.run(main())
"""


def test_a_sparse_segment_the_filesystem_cannot_back_is_refused_at_attach() -> None:
    """A client's sparse 8 MiB segment on a 2 MiB shared-memory filesystem (a private
    mount namespace): the attach is refused (400, naming the segment as sparse: the
    daemon backs no client's memory, issue 47) before a page is mapped, and the
    daemon holds no region of it, instead of a bus error later in the middle of a
    pull."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a mount namespace of its own")
    tests = Path(__file__).resolve().parents[2]
    script = 'mount -t tmpfs -o size=2m tmpfs /dev/shm && exec "$0" -c "$1"'
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            sys.executable,
            SPARSE_CHILD,
        ],
        capture_output=True,
        text=True,
        timeout=CHILD_S,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
        ),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused"], (done.stdout, done.stderr[-2000:])
