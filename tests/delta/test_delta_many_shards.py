"""A publish of tens of thousands of tiny shards, with deltas on (issue 47, class 1).

The comparison of such a version with its base must not stop the daemon's event
loop: its block table, its jobs (grouped by bytes, not one per shard) and the
assembly of its changes are built off the loop. The loop's longest stall is
measured inside the daemon's own process, while the daemon publishes and compares,
as the most CPU time the loop's thread spends between two ticks of a ticker on it
(:class:`support.costs.LoopStall`): the daemon's own work on its loop, which other
processes' load on a busy host does not inflate. A concurrent request is answered
while the comparison runs. The delta it makes
is still exact: the changed units it counts are the ones the trainer changed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.costs import LoopStall
from support.daemons import daemon_config, served
from support.settled import settled_delta

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.wire import ManifestIn, ShardEntry, TensorEntry
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(300)

SHARDS = 40_000
"""Tensors of the model, one tiny shard each: a manifest of a few MB at most."""
ELEMS = 4
"""bfloat16 elements per shard (8 bytes)."""
CHANGED_EVERY = 7
"""One shard in this many has its first element changed in v2."""
STALL_BOUND_S = 0.5
"""The most loop-thread CPU time between two ticks, s: far under the seconds a job,
lane arrays and a task per shard took on the loop."""


def manifest_of(version: int, region: int, count: int = SHARDS) -> ManifestIn:
    """``count`` tensors of one tiny shard each, laid end to end in ``region``."""
    tensors = []
    for i in range(count):
        shard = ShardEntry((0,), (ELEMS,), region, 2 * ELEMS * i)
        tensors.append(TensorEntry(f"t{i}", (ELEMS,), "bfloat16", [shard]))
    return ManifestIn("tiny", version, 0, 1, tensors)


async def test_a_delta_comparison_of_forty_thousand_tiny_shards_never_stalls_the_loop() -> None:
    d = Daemon(daemon_config(node_id="many-shards", deltas=True))
    async with served(d) as s, RefitClient(s.url) as c:
        segs = []
        try:
            v1 = np.random.default_rng(1).integers(0, 1 << 16, SHARDS * ELEMS, dtype=np.uint16)
            v2 = v1.copy()
            v2[:: ELEMS * CHANGED_EVERY] += 1
            regions = []
            for words in (v1, v2):
                info = await c.create_region(words.nbytes, label="tiny")
                seg = SharedSegment.attach(info.handle, words.nbytes)
                seg.numpy(np.uint16)[:] = words
                segs.append(seg)
                regions.append(info.region_id)
            # The manifests are encoded here, before the meter runs: the client's cost.
            bodies = [manifest_of(v, r) for v, r in ((1, regions[0]), (2, regions[1]))]
            await c.publish(bodies[0])
            assert (await settled_delta(c, "tiny", 1)).state == "none"
            answered_while_comparing = 0
            meter = LoopStall()
            meter.start()  # on this loop, the daemon's
            try:
                await c.publish(bodies[1])
                while (await c.delta_info("tiny", 2)).state == "computing":
                    await c.version("tiny", 2)  # another request, answered meanwhile
                    answered_while_comparing += 1
                rec = await settled_delta(c, "tiny", 2)
            finally:
                meter.stop()
            assert rec.state == "ready", rec
            assert rec.changed == -(-SHARDS // CHANGED_EVERY), rec
            assert meter.longest < STALL_BOUND_S, (
                f"the loop stalled {meter.longest:.3f} s during the publish and comparison"
            )
            print(
                f"longest loop stall {meter.longest:.3f} s; {answered_while_comparing} requests "
                f"answered while comparing; comparison {rec.seconds:.3f} s"
            )
        finally:
            for seg in segs:
                seg.close()


async def test_a_base_shrunk_by_its_owner_fails_the_comparison_not_the_daemon() -> None:
    """The comparison reads both versions through the bus-error guard: a base whose
    segment its owner truncated under the daemon's mapping makes the version's delta
    ``none``, saying the comparison was refused, and the daemon answers on."""
    d = Daemon(daemon_config(node_id="shrunk-base", deltas=True))
    async with served(d) as s, RefitClient(s.url) as c:
        segs = []
        try:
            words = np.arange(SHARDS * ELEMS // 8, dtype=np.uint16)
            regions = []
            for _ in range(2):
                info = await c.create_region(words.nbytes, label="tiny")
                seg = SharedSegment.attach(info.handle, words.nbytes)
                seg.numpy(np.uint16)[:] = words
                segs.append(seg)
                regions.append((info.region_id, info.handle))
            count = SHARDS // 8
            await c.publish(manifest_of(1, regions[0][0], count))
            await settled_delta(c, "tiny", 1)
            os.truncate(SHM_DIR / regions[0][1], 0)  # v1, the base, loses its pages
            await c.publish(manifest_of(2, regions[1][0], count))
            rec = await settled_delta(c, "tiny", 2)
            assert rec.state == "none" and "comparison refused" in rec.reason, rec
            assert (await c.version("tiny", 2)).state == "ready"
        finally:
            for seg in segs:
                seg.close()
