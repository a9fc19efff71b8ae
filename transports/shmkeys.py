"""What a same-host (``shm``) record names, and a lease's grant of it checked.

A same-host record proves which memory a name maps: a segment's name and file
identity (``st_dev``, ``st_ino``) under one kernel boot (:func:`boot_id`), as a
:class:`SegmentKey`, which a lease's grant also keys to the lease and the byte ranges
it may read. `transports.shm` makes records and grants (at the source) and maps them
(at the reader); :func:`check_grant` is what a reader checks of a grant it is handed,
before it connects with it as given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import msgspec

from refitd.errors import ProtocolError, TransportError

from .interface import AdvertisedRegion, LeaseScope, PeerInfo
from .segments import SHM_DIR

__all__ = [
    "BOOT_ID",
    "SegmentKey",
    "boot_id",
    "check_grant",
    "file_id",
    "same_file",
    "segment_key",
]

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This kernel's boot id ("" where the kernel does not expose it)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def file_id(name: str) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of segment ``name``: under one kernel boot it names exactly
    one file, so a record of it proves which memory a name maps."""
    st = os.stat(SHM_DIR / name)
    return st.st_dev, st.st_ino


def same_file(name: str, want: tuple[int, ...]) -> None:
    """Refuse (:class:`TransportError`) unless segment ``name`` here is the file
    ``(st_dev, st_ino)`` = ``want``."""
    try:
        got = file_id(name)
    except FileNotFoundError:
        raise TransportError(f"segment {name!r} does not exist on this host") from None
    if got != want:
        raise TransportError(
            f"segment {name!r} here is another file than the peer's (a separate /dev/shm)"
        )


class SegmentKey(NamedTuple):
    """The key a same-host record gives a region: its segment's ``name`` and file
    (``dev``, ``ino``), which a reader maps by name and checks is that very file; in a
    lease's grant (:meth:`transports.shm.ShmTransport.grant`) also the ``lease`` and the
    ``[start, end)`` byte ranges of the region it may read (``extents``; None: the
    whole region, as an advertisement gives it)."""

    name: str
    dev: int
    ino: int
    lease: str = ""
    extents: list[tuple[int, int]] | None = None

    def encode(self) -> bytes:
        whole = self.extents is None and not self.lease
        return msgspec.msgpack.encode(tuple(self[:3]) if whole else tuple(self))

    @classmethod
    def decode(cls, raw: bytes) -> SegmentKey:
        return msgspec.msgpack.decode(raw, type=cls)

    @classmethod
    def of(cls, region: AdvertisedRegion, what: str) -> SegmentKey:
        """The key of ``region`` in a record, or :class:`ProtocolError` naming ``what``
        (whose record) and the region when it does not decode."""
        try:
            return cls.decode(region.key)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{what} refused: region {region.region_id}: {exc}") from None


def segment_key(name: str, dev: int, ino: int) -> bytes:
    """The encoded :class:`SegmentKey` of a region's segment."""
    return SegmentKey(name, dev, ino).encode()


def check_grant(grant: PeerInfo, scope: LeaseScope, secret: bytes, scheme: str = "shm") -> None:
    """Refuse ``grant`` unless it is a source's same-host grant for ``scope``'s
    lease naming every region of ``scope``: it is what a reader connects with,
    as given, for that lease's reads (this checks it; it makes and signs
    nothing). A record of another scheme, or whose MAC does not verify, is
    refused (:class:`ProtocolError`), as is a grant of another lease, or a record
    that names none (an advertisement); a region of ``scope`` it does not name (no
    segment there: not host memory, or its name is gone) is refused
    (:class:`TransportError`): there is no same-host path to it."""
    if grant.scheme != scheme:
        raise ProtocolError(
            f"{scheme} grant refused: the record of {grant.peer_id!r} is for scheme "
            f"{grant.scheme!r}"
        )
    grant.verify(secret)
    listed = {r.region_id: r for r in grant.regions}
    for r in grant.regions:
        key = SegmentKey.of(r, f"{scheme} grant of {grant.peer_id!r}")
        lease = key.lease
        if lease != scope.lease_id:
            raise ProtocolError(
                f"{scheme} grant of {grant.peer_id!r} refused: region {r.region_id} is "
                f"granted to lease {lease!r}, not {scope.lease_id!r}"
            )
        if key.extents is None:  # a lease's key without ranges would map the whole region
            raise ProtocolError(
                f"{scheme} grant of {grant.peer_id!r} refused: region {r.region_id} names "
                "no byte ranges (a grant states what its lease may read)"
            )
    missing = sorted(set(scope.ranges) - set(listed))
    if missing:
        raise TransportError(
            f"region(s) {missing} of {grant.peer_id!r} do not map here: its same-host "
            "grant names no segment for them"
        )
