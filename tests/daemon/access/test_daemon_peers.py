"""Daemon-to-daemon exchange: region records are accepted only when authenticated."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from support.daemons import daemon_config, serving_daemons

from refitd.daemon.app.node import Daemon
from refitd.errors import ProtocolError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    MemoryKind,
    PeerRegions,
    PullRequest,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(60)


def test_a_region_record_altered_after_signing_is_refused() -> None:
    region = RegionInfo(1, MemoryKind.HOST, "refitd.x", 4096, 7)
    rec = PeerRegions("a", 7, "shm", [region]).signed(b"k" * 32)
    rec.verify(b"k" * 32)
    grown = msgspec.structs.replace(region, nbytes=1 << 30)
    with pytest.raises(ProtocolError, match="MAC does not verify"):
        msgspec.structs.replace(rec, regions=[grown]).verify(b"k" * 32)
    with pytest.raises(ProtocolError, match="outside this deployment"):
        rec.verify(b"other-secret-of-32-bytes........")


async def test_a_pull_from_a_daemon_of_another_deployment_is_refused_before_any_byte_moves() -> (
    None
):
    a = Daemon(daemon_config(node_id="a"), secret=b"a" * 32)
    b = Daemon(daemon_config(node_id="b"), secret=b"b" * 32)
    async with serving_daemons(a, b) as (ca, cb):
        src = await ca.create_region(64)
        SharedSegment.attach(src.handle, 64).numpy()[:] = 9
        tensor = TensorEntry("w", (64,), "uint8", [ShardEntry((0,), (64,), src.region_id, 0)])
        await ca.publish(ManifestIn("m", 1, 0, 1, [tensor]))
        with SharedSegment.create(64, "dst") as dst:
            d = await cb.attach_region(dst.name, 64)
            lease = await ca.acquire_lease("m", 1)
            rows = np.array([[src.region_id, 0, d.region_id, 0, 64]], dtype=np.int64)
            req = PullRequest("m", 1, lease.lease_id, DescriptorTable.pack(rows), [], ca.base_url)
            with pytest.raises(ProtocolError, match="from 'a' refused: MAC"):
                await cb.submit_pull(req)
            assert not dst.numpy().any()
