"""Records one daemon signs for others: its registration and its versions in the
cluster registry, and the region records it sends a reader. Each is MAC'd with the
deployment secret (:mod:`refitd.signing`); a record that does not verify is refused."""

from __future__ import annotations

import msgspec

from refitd.signing import Signed
from refitd.wire.fields import Name, NonNeg, Positive
from refitd.wire.regions import RegionInfo
from refitd.wire.versions import VersionState

__all__ = [
    "ClusterVersion",
    "DaemonRecord",
    "PeerRegions",
    "SourceRecord",
]


class DaemonRecord(Signed, frozen=True):
    """One daemon as registered in the cluster registry (etcd), MAC'd with the
    deployment secret: only a record that verifies makes its ``url`` a trusted peer.
    ``incarnation`` changes with every start of the daemon."""

    node_id: Name
    url: str
    incarnation: int
    transport: str
    boot_id: str = ""
    mac: bytes = b""

    def _what(self) -> str:
        return f"registry record of {self.node_id!r}"


class SourceRecord(Signed, frozen=True):
    """The publisher parts of one version that one daemon holds, as published to the
    cluster registry (MAC'd like :class:`DaemonRecord`)."""

    node_id: Name
    url: str
    incarnation: int
    model: Name
    version: NonNeg
    state: VersionState
    parts: list[NonNeg]
    expected_parts: Positive
    mac: bytes = b""

    def _what(self) -> str:
        return f"registry record of {self.model!r} v{self.version} from {self.node_id!r}"


class ClusterVersion(msgspec.Struct, frozen=True):
    """Where a version lives across hosts: every daemon holding parts of it.
    ``complete`` when the holders' READY parts together cover ``range(expected_parts)``."""

    model: str
    version: int
    expected_parts: int
    complete: bool
    holders: list[SourceRecord]


class PeerRegions(Signed, frozen=True):
    """Region records one daemon sends another, MAC'd with the deployment secret.
    (A msgspec Struct: its ``{}`` defaults are copied per instance, never shared.)

    ``transport`` is the sender's data-plane mode. Records are given for reading only
    under a lease: ``adverts`` then holds, per data plane the sender serves, the
    credential it grants that lease (``tcp``: a grant keyed to the lease's byte
    ranges), which a reader connects with as given (``advert`` is the first of them;
    both empty without a lease), and the sender's ``shm`` grant of the regions that
    lease may read (boot id, each segment's name and file, keyed to the lease and its
    byte ranges: :meth:`transports.shm.ShmTransport.grant`): a reader uses the
    shared-memory path only when its own boot id matches and the file it maps by
    name is that very file."""

    node_id: str
    incarnation: int
    transport: str
    regions: list[RegionInfo]
    advert: bytes = b""
    #: the lease these records were given under ("" for none), and per listed region
    #: the byte ranges ``[start, end)`` that lease may read: a reader reads nothing else
    lease_id: str = ""
    scope: dict[int, list[tuple[int, int]]] = {}  # noqa: RUF012
    #: every data plane the sender serves, by scheme: the credential it grants the
    #: lease there (``advert`` is the first of them), so the reader picks the path
    adverts: dict[str, bytes] = {}  # noqa: RUF012
    mac: bytes = b""

    def _what(self) -> str:
        return f"region records from {self.node_id!r}"
