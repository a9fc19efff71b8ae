"""Host mirrors and relay, daemon to daemon (see :mod:`refitd.daemon.mirror.mirrors`)."""

from __future__ import annotations

import secrets
import time
from typing import Annotated, ClassVar

import msgspec

from refitd.errors import AccessDenied, ProtocolError
from refitd.signing import Signed
from refitd.wire.fields import Label, Name, NonNeg
from refitd.wire.leases import MAX_LEASE_TTL_S
from refitd.wire.records import PeerRegions

__all__ = [
    "FROM_SOURCE",
    "MAX_DEAL_CHUNKS",
    "MAX_EXCLUDE",
    "MAX_JOIN_BYTES",
    "MIRROR_LEASE_FRESH_S",
    "HolderAssign",
    "HolderJoin",
    "MirrorFeed",
    "MirrorLease",
    "MirrorState",
]

MAX_EXCLUDE = 64
"""Failed holders one join may name at most."""
MAX_JOIN_BYTES = 64 << 10
"""Bytes of a join's body at most (refused from its headers past it)."""
MAX_DEAL_CHUNKS = 1 << 16
"""Chunks of a version the holder book deals at most (a chunk is at most 16 MiB:
1 TiB); the chunks past them are read from the source."""
FROM_SOURCE = 255
"""A chunk's entry in a deal that says: read it from the source."""

PeerUrl = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class HolderJoin(Signed, frozen=True, forbid_unknown_fields=True):
    """A mirror joining the holder book of the source of ``model`` ``version``:
    it serves at ``url``; ``exclude`` are holders it failed to read from. Signed with
    the deployment secret by the joining daemon: only a peer daemon joins."""

    refused: ClassVar[type[ProtocolError]] = AccessDenied  # type: ignore[assignment]

    model: Name
    version: NonNeg
    url: PeerUrl
    node_id: Label
    exclude: Annotated[list[PeerUrl], msgspec.Meta(max_length=MAX_EXCLUDE)] = msgspec.field(
        default_factory=list
    )
    #: bytes/s the joiner fills at now (0: not reading yet); a join again reports it
    rate: Annotated[float, msgspec.Meta(ge=0, le=1e15)] = 0.0
    #: ``rate`` is the joiner's whole fill's: its mirror is complete (its last report)
    done: bool = False
    #: the chunks the joiner holds complete, one bit each (``numpy.packbits`` order)
    have: Annotated[bytes, msgspec.Meta(max_length=MAX_DEAL_CHUNKS // 8)] = b""
    #: of ``exclude``, the holders it found slow or sending wrong bytes (not only
    #: failed or late): the book deals them nothing of the next version
    shun: Annotated[list[PeerUrl], msgspec.Meta(max_length=MAX_EXCLUDE)] = msgspec.field(
        default_factory=list
    )
    mac: bytes = b""

    def _what(self) -> str:
        return (
            f"join of {self.url!r} to the holder book of {self.model!r} version "
            f"{self.version} (only a daemon holding the deployment secret joins)"
        )


MIRROR_LEASE_FRESH_S = 60.0
"""Seconds, either way, a mirror lease request may be from when it was issued (the
daemons' clocks may differ by this much at most)."""


class MirrorLease(Signed, frozen=True, forbid_unknown_fields=True):
    """A peer daemon (a downstream relay, ``node_id``) leasing a host mirror's copy of
    ``model`` ``version`` under ``source_lease``, its live lease on it at the source.
    Signed with the deployment secret: a host's own tenants never lease a mirrored
    version there; they lease it at its source and pull through their daemon."""

    refused: ClassVar[type[ProtocolError]] = AccessDenied  # type: ignore[assignment]

    model: Name
    version: NonNeg
    source_lease: Label
    node_id: Label
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_TTL_S)] = 30.0
    #: Made by :meth:`fresh`, under the MAC: a request is granted once (a nonce seen
    #: before is refused) and only within :data:`MIRROR_LEASE_FRESH_S` of when it was
    #: issued (Unix seconds), so a request seen on the way cannot be replayed.
    nonce: Label = ""
    issued_at: float = 0.0
    mac: bytes = b""

    @classmethod
    def fresh(
        cls, model: str, version: int, source_lease: str, node_id: str, ttl_s: float
    ) -> MirrorLease:
        """A request with a new nonce, issued now (sign it with :meth:`signed`)."""
        return cls(model, version, source_lease, node_id, ttl_s, secrets.token_hex(16), time.time())

    def _what(self) -> str:
        return (
            f"lease on the mirror of {self.model!r} version {self.version} for "
            f"{self.node_id!r} (only a daemon holding the deployment secret leases a mirror)"
        )


class MirrorFeed(msgspec.Struct, frozen=True):
    """One frame of a mirror's feed (``GET /v1/mirrors/{model}/{version}/feed``): sent
    when chunks complete there (and every few seconds when none did). ``records`` are
    the mirror host's signed records, scoped to the reader's lease: their scope holds
    exactly the complete chunks, what the data server serves that lease now."""

    chunks_total: int
    chunks_done: int
    complete: bool
    error: str = ""
    #: the mirror's source, and each source region id's mirror region id there
    source: str = ""
    regions: dict[int, int] = {}
    records: PeerRegions | None = None


class HolderAssign(msgspec.Struct, frozen=True):
    """The source's holder book's answer to a join: the version's deal and holders.

    ``deal`` has one byte per chunk: the index in ``seeders`` of the holder that
    brings the chunk onto the hosts (reads it from the source; every other holder
    reads it from there), or :data:`FROM_SOURCE` (read from the source). Empty while
    the version is not dealt yet. ``holders`` are every holder the source knows of the
    version, in the order they joined, and ``rates`` what each last reported filling
    at (bytes/s). A seeder that left the book is ``""`` in ``seeders``."""

    seeders: list[str]
    deal: bytes
    holders: list[str]
    rates: dict[str, float] = {}


class MirrorState(msgspec.Struct, frozen=True):
    """One mirror's progress: ``regions`` maps each source region id to the mirror's
    own region id; ``error`` is set once it failed for good."""

    model: str
    version: int
    source: str
    upstream: str
    regions: dict[int, int]
    chunks_total: int
    chunks_done: int
    complete: bool
    error: str = ""
    tried: list[str] = []
    #: wall-clock seconds (``time.time()``) when the mirror began and completed (0: not yet)
    began_at: float = 0.0
    completed_at: float = 0.0
    #: bytes this mirror holds; bytes every mirror of the daemon holds; what they may
    #: hold together (``[mirrors] max_bytes``)
    nbytes: int = 0
    held_bytes: int = 0
    budget_bytes: int = 0
    #: chunks this mirror read from each holder (its URL; the source's included)
    reads: dict[str, int] = {}
    #: chunks asked of another holder after the one they were asked of failed, stopped
    #: answering or was slow
    reasked: int = 0
