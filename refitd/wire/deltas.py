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

__all__ = [
    "CHUNK_BYTES",
    "DeltaChunk",
    "DeltaInfo",
    "DeltaPackRequest",
    "DeltaStaged",
    "DeltaState",
    "DeltaStreamHead",
    "DeltaStreamRequest",
]

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
    #: a plan this principal sent before, by the name the source answered it with
    #: (``DeltaStreamHead.plan``), sent instead of ``descriptors`` and ``pack_specs``
    plan: Digest = ""


class DeltaStaged(msgspec.Struct, frozen=True):
    """A staged delta: ``nbytes`` bytes at the start of ``region`` (held for the lease):
    ``pages`` page counts, ``changed`` offsets in page and as many differences
    (``diff_bits`` each: 8, or 4 when the request accepted ``nibbles``), then
    ``exceptions`` whole units of ``unit`` bytes (``refitd.delta.stream.layout``);
    ``stream_units`` the units of a full refit's stream; ``digest`` the version's
    content digest. The source's seconds for it: ``wait_s`` waiting for the
    version's comparison, ``encode_s`` selecting and encoding the changes (composing
    a chain's first), ``copy_s`` taking the staging region and copying them in."""

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
    wait_s: float = 0.0
    encode_s: float = 0.0
    copy_s: float = 0.0


CHUNK_BYTES = 16 << 20
"""Stream bytes per chunk of a streamed delta, by default (``DeltaStreamRequest``)."""


class DeltaStreamRequest(DeltaPackRequest, frozen=True, forbid_unknown_fields=True):
    """:class:`DeltaPackRequest`, answered as a stream (``POST /v1/deltas/stream``):
    the plan's stream is cut into chunks of ``chunk_bytes`` stream bytes (the last
    shorter; larger where there would be more than 1,024 chunks), and each chunk's changed units are encoded on their own and sent as
    soon as they are, while the next chunk is encoded. Nothing is staged."""

    chunk_bytes: Annotated[int, msgspec.Meta(ge=1 << 12, le=1 << 40)] = CHUNK_BYTES


class DeltaStreamHead(msgspec.Struct, frozen=True):
    """The first frame of a streamed delta: ``chunks`` chunks of ``chunk_units``
    units of ``unit`` bytes (the last one shorter) follow, of a stream of
    ``stream_units``; the delta leads from ``base_version`` to the version whose
    content digest is ``digest``. ``wait_s``: the source's wait for its comparison.

    Every frame is a 4-byte big-endian length and that much msgpack; a chunk's
    frame (:class:`DeltaChunk`) is followed by its ``nbytes`` payload bytes."""

    unit: int
    stream_units: int
    chunks: int
    chunk_units: int
    base_version: int
    digest: str
    wait_s: float = 0.0
    #: the name the source keeps the request's plan under: a later request may send
    #: it instead of the plan (``DeltaPackRequest.plan``)
    plan: str = ""


class DeltaChunk(msgspec.Struct, frozen=True):
    """Chunk ``index`` of a streamed delta: the changed units of stream units
    ``[index * chunk_units, ...)``, encoded as a staged delta of that part of the
    stream alone (:class:`DeltaStaged`'s layout: ``pages``, ``changed``,
    ``exceptions``, ``diff_bits``) in the ``nbytes`` bytes after the frame.
    ``error``: the source failed this chunk (then no payload follows, and no
    chunk after it). ``encode_s``: the source's seconds encoding it."""

    index: int
    nbytes: int = 0
    pages: int = 0
    changed: int = 0
    exceptions: int = 0
    diff_bits: int = 8
    encode_s: float = 0.0
    error: str = ""
