"""The smallest traffic a test can give a real daemon: one 1-D tensor published from
one region, and a pull spelled as raw descriptor rows."""

from __future__ import annotations

import numpy as np

from refitd.client.http import RefitClient
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PullRequest,
    ShardEntry,
    TensorEntry,
    VersionInfo,
)

__all__ = ["publish_tensor", "pull_rows"]

Row = tuple[int, int, int, int, int]


async def publish_tensor(
    c: RefitClient, model: str, version: int, region: int, nbytes: int, dtype: str = "uint8"
) -> VersionInfo:
    """Publish ``version`` of ``model`` as one publisher part holding one tensor
    ``"w"``: the first ``nbytes`` bytes of ``region``, as a 1-D ``dtype`` array."""
    count = nbytes // np.dtype(dtype).itemsize
    shard = ShardEntry((0,), (count,), region, 0)
    return await c.publish(
        ManifestIn(model, version, 0, 1, [TensorEntry("w", (count,), dtype, [shard])])
    )


def pull_rows(model: str, version: int, lease_id: str, *rows: Row, source: str = "") -> PullRequest:
    """A pull of ``rows``, each ``(src_region, src_offset, dst_region, dst_offset,
    nbytes)`` as the descriptor table lays them out, from ``source`` (``""``: this
    daemon) under ``lease_id``."""
    table = DescriptorTable.pack(np.array(rows, dtype=np.int64))
    return PullRequest(model, version, lease_id, table, [], source)
