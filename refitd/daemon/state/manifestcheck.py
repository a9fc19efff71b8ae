"""A published manifest checked against its tensors and the daemon's regions, before
the registry records it: pure, no state.

Every shard must lie inside its tensor's global shape and inside its region's bytes,
in a dtype the daemon knows the size of. :mod:`refitd.daemon.state.registry` re-exports
these names.
"""

from __future__ import annotations

from collections.abc import Mapping

from refitd.errors import NotFoundError, ProtocolError
from refitd.wire import DTYPE_SIZES, ManifestIn
from transports.batch import within

__all__ = [
    "DTYPE_SIZES",
    "MANIFEST_SHARD_BYTES",
    "MANIFEST_TENSOR_BYTES",
    "check_manifest_bounds",
    "element_count",
    "manifest_cost",
]


def element_count(xs: tuple[int, ...]) -> int:
    """The number of elements of a block of shape ``xs``."""
    n = 1
    for x in xs:
        n *= x
    return n


def check_manifest_bounds(m: ManifestIn, region_sizes: Mapping[int, int]) -> None:
    """Refuse a manifest whose shards fall outside their tensor or their region.

    ``region_sizes`` maps region id to its size in bytes. Raises
    :class:`ProtocolError` (a name listed twice, unknown dtype, a negative global
    size, shard outside the global shape) or
    :class:`NotFoundError` (unknown region) naming the tensor and shard.
    """
    seen: set[str] = set()
    for t in m.tensors:
        # One entry per name: a second would make the merge pick between two shapes.
        if t.name in seen:
            raise ProtocolError(f"tensor {t.name!r} is listed twice in one manifest")
        seen.add(t.name)
        size = DTYPE_SIZES.get(t.dtype)
        if size is None:
            raise ProtocolError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if any(g < 0 for g in t.shape):  # a tensor without shards is not checked below
            raise ProtocolError(f"tensor {t.name!r}: global shape {t.shape} has a negative size")
        for i, s in enumerate(t.shards):
            if len(s.offset) != len(t.shape) or len(s.shape) != len(t.shape):
                raise ProtocolError(
                    f"tensor {t.name!r} shard {i}: offset {s.offset} / shape {s.shape} do not "
                    f"match the tensor's rank {len(t.shape)}"
                )
            for d, (o, n, g) in enumerate(zip(s.offset, s.shape, t.shape, strict=True)):
                if not within(o, n, g):
                    raise ProtocolError(
                        f"tensor {t.name!r} shard {i}: dim {d} covers [{o}, {o + n}) outside "
                        f"the global extent {g}"
                    )
            rsize = region_sizes.get(s.region)
            if rsize is None:
                raise NotFoundError(f"tensor {t.name!r} shard {i}: unknown region {s.region}")
            nbytes = element_count(s.shape) * size
            if not within(s.byte_offset, nbytes, rsize):
                end = s.byte_offset + nbytes
                raise ProtocolError(
                    f"tensor {t.name!r} shard {i}: bytes [{s.byte_offset}, {end}) overrun region "
                    f"{s.region} of {rsize} bytes"
                )


MANIFEST_SHARD_BYTES = 256
"""Bytes of daemon memory a manifest is charged per shard it lists: its decoded
entry, its merged manifest's and its read scope's (measured about 215 to 235 bytes a
shard, ``tests/daemon/access/test_daemon_hostile_costs.py``)."""
MANIFEST_TENSOR_BYTES = 512
"""Bytes a manifest is charged per tensor it lists, with its name's length (measured
about 330 bytes a tensor besides its shards)."""


def manifest_cost(m: ManifestIn) -> int:
    """Bytes of daemon memory manifest ``m`` is charged while the daemon holds it
    (:data:`MANIFEST_SHARD_BYTES` a shard, :data:`MANIFEST_TENSOR_BYTES` and its name
    a tensor): what ``limits.max_manifest_bytes_per_principal`` counts."""
    shards = sum(len(t.shards) for t in m.tensors)
    names = sum(len(t.name) for t in m.tensors)
    return MANIFEST_SHARD_BYTES * shards + MANIFEST_TENSOR_BYTES * len(m.tensors) + names
