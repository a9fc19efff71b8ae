"""Versions of a model: the manifest each publisher part publishes (tensors and their
shards in regions), a version's state, and the merged manifest a receiver plans from."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from refitd.wire.fields import (
    MAX_MANIFEST_TENSORS,
    MAX_TENSOR_SHARDS,
    DtypeName,
    Int64,
    Name,
    NonNeg,
    PartCount,
    Shape,
    TensorName,
)

__all__ = [
    "DTYPE_SIZES",
    "ManifestHead",
    "ManifestIn",
    "MergedManifest",
    "ShardEntry",
    "TensorEntry",
    "VersionInfo",
    "VersionState",
]

#: Byte size per element of every dtype a manifest may name (torch spelling): the
#: daemon sizes tensors by it without importing torch.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class ShardEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One block of a full tensor held in a region: ``offset``/``shape`` in elements of the
    global tensor, the block stored C-contiguous at ``byte_offset`` of ``region``."""

    offset: Shape
    shape: Shape
    region: Int64
    byte_offset: NonNeg


class TensorEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A full tensor by name: global shape, dtype (torch name, e.g. ``"bfloat16"``), shards."""

    name: TensorName
    shape: Shape
    dtype: DtypeName
    shards: Annotated[list[ShardEntry], msgspec.Meta(max_length=MAX_TENSOR_SHARDS)]


class ManifestIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one publisher part publishes for ``(model, version)``.

    A version becomes READY once every part in ``range(expected_parts)`` has published;
    every part of one version must agree on ``expected_parts`` and on each tensor's
    global shape and dtype.
    """

    model: Name
    version: NonNeg
    part: NonNeg
    expected_parts: PartCount
    tensors: Annotated[list[TensorEntry], msgspec.Meta(max_length=MAX_MANIFEST_TENSORS)]


class ManifestHead(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """:class:`ManifestIn` with each tensor still encoded: the daemon decodes the
    tensors one at a time off its event loop, counting shards as it goes."""

    model: Name
    version: NonNeg
    part: NonNeg
    expected_parts: PartCount
    tensors: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_MANIFEST_TENSORS)]


class VersionState(enum.StrEnum):
    PENDING = "pending"
    READY = "ready"
    RETIRED = "retired"


class VersionInfo(msgspec.Struct, frozen=True):
    model: str
    version: int
    state: VersionState
    published_parts: list[int]
    expected_parts: int
    leases: int


class MergedManifest(msgspec.Struct, frozen=True):
    """A READY version's tensors, replicas removed (one shard per distinct block).

    ``node_id``/``incarnation`` name the daemon holding every listed region, so a receiver's
    daemon knows whom to read from and can detect that daemon restarting.
    """

    model: str
    version: int
    node_id: str
    incarnation: int
    tensors: list[TensorEntry]
