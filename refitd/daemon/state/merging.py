"""What a version's published parts make, as pure functions of its manifests: the
merged manifest readers fetch (each distinct block of a tensor listed once, however
many parts hold a replica of it) and the byte ranges a lease on it may read. The
registry (:mod:`refitd.daemon.state.registry`) caches both per version."""

from __future__ import annotations

from collections.abc import Mapping

from refitd.daemon.access.trust import Extents, merge_extents
from refitd.daemon.state.manifestcheck import DTYPE_SIZES, element_count
from refitd.wire import ManifestIn, MergedManifest, ShardEntry, TensorEntry, gc_paused

__all__ = ["merge_parts", "scope_of"]


def merge_parts(
    parts: Mapping[int, ManifestIn], model: str, version: int, node_id: str, incarnation: int
) -> MergedManifest:
    """The merged manifest of ``model`` ``version`` published as ``parts`` (part ->
    its manifest) on daemon ``node_id`` (its ``incarnation``)."""
    # Parts are visited lowest first and the first copy of a block wins, so the
    # merge is deterministic; a tensor one part publishes with distinct blocks is
    # reused as is (no new objects for the common case).
    first: dict[str, TensorEntry] = {}
    extra: dict[str, list[ShardEntry]] = {}
    with gc_paused():
        for part in sorted(parts):
            for t in parts[part].tensors:
                seen = first.get(t.name)
                if seen is None:
                    first[t.name] = t
                else:
                    extra.setdefault(t.name, []).extend(t.shards)
        tensors: list[TensorEntry] = []
        for name, t in first.items():
            more = extra.get(name)
            if more is None and len(t.shards) <= 1:
                tensors.append(t)
                continue
            blocks: dict[tuple[tuple[int, ...], tuple[int, ...]], ShardEntry] = {}
            for s in t.shards:
                blocks.setdefault((s.offset, s.shape), s)
            for s in more or ():
                # A replica is the same block at the same global offset.
                blocks.setdefault((s.offset, s.shape), s)
            if more is None and len(blocks) == len(t.shards):
                tensors.append(t)
            else:
                tensors.append(TensorEntry(name, t.shape, t.dtype, list(blocks.values())))
    return MergedManifest(model, version, node_id, incarnation, tensors)


def scope_of(parts: Mapping[int, ManifestIn]) -> dict[int, Extents]:
    """Region id -> the byte ranges the shards of ``parts`` occupy, merged."""
    ranges: list[tuple[int, int, int]] = []
    for m in parts.values():
        for t in m.tensors:
            size = DTYPE_SIZES.get(t.dtype, 1)
            for s in t.shards:
                ranges.append(
                    (s.region, s.byte_offset, s.byte_offset + element_count(s.shape) * size)
                )
    return merge_extents(ranges)
