"""Pulls: the reads a receiver asks its daemon to make (a packed
:class:`DescriptorTable` of ``(src_region, src_offset, dst_region, dst_offset,
nbytes)`` rows, and strided blocks the source packs first), and their progress.

Bulk descriptor payloads are not JSON lists of dicts: a :class:`DescriptorTable`
carries one little-endian int64 matrix of shape ``(n, 5)`` as raw bytes, sent inside
a msgpack body (``application/msgpack``).
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np

from refitd.errors import ProtocolError
from refitd.wire.fields import Int64, Name, NonNeg, Positive, Url
from refitd.wire.records import PeerRegions
from refitd.wire.regions import RegionInfo
from refitd.wire.status import ErrorBody

__all__ = [
    "DescriptorTable",
    "PackRequest",
    "PackSpec",
    "PullProgress",
    "PullRequest",
    "PullState",
    "StagedPack",
]


class DescriptorTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``n`` region-relative reads, packed.

    ``table`` is ``n * 5`` little-endian int64 values, row-major: ``(src_region,
    src_offset, dst_region, dst_offset, nbytes)``; region ids as the daemons recorded
    them, offsets and sizes in bytes.
    """

    table: bytes

    @staticmethod
    def pack(rows: np.ndarray) -> DescriptorTable:
        arr = np.ascontiguousarray(rows, dtype="<i8").reshape(-1, 5)
        return DescriptorTable(arr.tobytes())

    def rows(self) -> np.ndarray:
        """The ``(n, 5)`` int64 matrix; refuses a payload that is not whole rows."""
        if len(self.table) % 40:
            raise ProtocolError(
                f"descriptor table of {len(self.table)} bytes is not a whole number of "
                "40-byte rows (5 little-endian int64 each)"
            )
        return np.frombuffer(self.table, dtype="<i8").reshape(-1, 5)

    def __len__(self) -> int:
        return len(self.table) // 40


class PackSpec(msgspec.Struct, frozen=True, array_like=True):
    """A strided block the *source* daemon packs contiguous into staging, then the
    destination reads in one descriptor landing at ``dst_offset`` of ``dst_region``.

    ``src_offset`` is the byte offset of the first element; ``shape`` in elements,
    ``strides`` in **elements**; ``itemsize`` in bytes.
    """

    src_region: Int64
    src_offset: NonNeg
    shape: tuple[Int64, ...]
    strides: tuple[Int64, ...]
    itemsize: Positive
    dst_region: Int64
    dst_offset: NonNeg

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Move bytes into this daemon's regions from ``source`` (a peer daemon's base URL,
    or ``""`` for this daemon itself), reading version ``version`` of ``model`` under
    ``lease_id`` (held at the source). Nothing moves until every descriptor and pack
    spec has been checked against both daemons' region records.

    ``grant`` is what the source answered that lease with (``LeaseInfo.records``):
    its signed records and credentials, which the pulling daemon reads with as given
    (MAC-verified, of this very lease) instead of asking the source for them again."""

    model: Name
    version: NonNeg
    lease_id: Name
    descriptors: DescriptorTable
    pack_specs: list[PackSpec] = []
    source: Url = ""
    grant: PeerRegions | None = None


class PullState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PullProgress(msgspec.Struct, frozen=True):
    """Progress or result of a pull. ``suspect`` lists ``(dst_region, dst_offset, nbytes)``
    ranges that may hold partial bytes after a failure or cancel. ``path`` is how the
    bytes move: ``shm`` (copied through shared memory: the source is this daemon, or
    a daemon proven to be on this host) or the transport's scheme (``ucx``), followed
    by ``+cuda`` when GPU memory of this daemon is read or written (through its CUDA
    copy engine, docs/gpu.md)."""

    pull_id: str
    state: PullState
    bytes_total: int
    bytes_done: int
    descriptors_total: int
    descriptors_done: int
    seconds: float
    rate_gbps: float
    error: ErrorBody | None = None
    suspect: list[tuple[int, int, int]] = []
    path: str = ""


class StagedPack(msgspec.Struct, frozen=True):
    """Pack specs executed by a source daemon: the staging region and, per spec, the
    byte offset of its packed bytes inside it."""

    region: RegionInfo
    offsets: list[int]


class PackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: Name
    version: NonNeg
    lease_id: Name
    specs: list[PackSpec]
