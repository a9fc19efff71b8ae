"""Deltas: what a source daemon recorded of a version against the version before it,
and a receiver's request to stage the changed units of its planned pull.

Digests are the lane digest of ``refitd.delta.diff`` over the version's blocks,
hashed (BLAKE2b-128), as 32 hex characters; ``""`` where none is known.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from refitd.wire.fields import Int64, Name, NonNeg
from refitd.wire.pulls import DescriptorTable, PackSpec
from refitd.wire.regions import RegionInfo

__all__ = ["DeltaInfo", "DeltaPackRequest", "DeltaStaged", "DeltaState"]

Digest = Annotated[str, msgspec.Meta(max_length=64)]


class DeltaState(enum.StrEnum):
    COMPUTING = "computing"  # the comparison runs now
    READY = "ready"  # a delta against ``base_version`` is held
    NONE = "none"  # no delta (``reason`` says why): a full refit only


class DeltaInfo(msgspec.Struct, frozen=True):
    """The delta record of ``model`` ``version`` on its source daemon.

    ``base_version`` is the version it was compared with (-1: none); ``changed`` the
    units that differ (``unit`` bytes each) of ``compared_bytes``; ``delta_bytes``
    the memory the daemon holds for it (positions and values); ``digest`` this
    version's content digest, ``base_digest`` its base's."""

    model: str
    version: int
    state: DeltaState
    base_version: int = -1
    digest: str = ""
    base_digest: str = ""
    unit: int = 0
    changed: int = 0
    compared_bytes: int = 0
    delta_bytes: int = 0
    seconds: float = 0.0
    reason: str = ""


class DeltaPackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Stage, under ``lease_id`` on ``model`` ``version``, the units of the stream of the
    pull ``descriptors`` + ``pack_specs`` (the receiver's full plan) that changed since
    ``base_version``, whose digest the receiver states as ``base_digest``. Refused
    (409, nothing staged) when the daemon's delta is not against exactly that base."""

    model: Name
    version: NonNeg
    lease_id: Name
    base_version: Int64
    base_digest: Digest
    descriptors: DescriptorTable
    pack_specs: list[PackSpec] = []
    #: the receiver decodes 4-bit differences (the daemon uses them where they stage
    #: fewer bytes; ``DeltaStaged.diff_bits`` says which it staged)
    nibbles: bool = False


class DeltaStaged(msgspec.Struct, frozen=True):
    """A staged delta: ``nbytes`` bytes at the start of ``region`` (held for the lease):
    ``pages`` page counts, ``changed`` offsets in page and as many differences
    (``diff_bits`` each: 8, or 4 when the request accepted ``nibbles``), then
    ``exceptions`` whole units of ``unit`` bytes (``refitd.delta.stream.layout``);
    ``stream_units`` the units of the full pull's stream; ``digest`` the version's
    content digest."""

    region: RegionInfo
    nbytes: int
    pages: int
    changed: int
    exceptions: int
    unit: int
    stream_units: int
    base_version: int
    digest: str
    diff_bits: int = 8
