"""Leases: a reader holds one on a version while it reads it (a leased version is
not retired under it)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from refitd.wire.fields import Label, Name, NonNeg
from refitd.wire.records import PeerRegions
from refitd.wire.versions import MergedManifest

__all__ = ["MAX_LEASE_TTL_S", "LeaseInfo", "LeaseRequest"]

#: the longest lease (acquired or renewed) a daemon grants, in seconds
MAX_LEASE_TTL_S = 3600.0


class LeaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: Name
    version: NonNeg
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_TTL_S)] = 30.0
    #: free text naming the reader: kept with the lease, never checked
    label: Label = ""
    #: for a version the daemon holds as a host mirror: a live lease on it at its
    #: source, which is what entitles the caller to it (the source's readers rule)
    source_lease: Label = ""
    #: answer the version's merged manifest with the grant (one round trip, not two)
    manifest: bool = False


class LeaseInfo(msgspec.Struct, frozen=True):
    """A lease on one version; ``expires_in_s`` is relative to when the daemon answered.

    As ``POST /v1/leases`` answers it, ``records`` are the daemon's signed records of
    everything the lease may read there, with the credential it grants the lease on
    each data plane (:class:`~refitd.wire.records.PeerRegions`): what a reading daemon
    reads with, presented as given (``PullRequest.grant``); and ``manifest`` the
    version's merged manifest when the request asked for it. A renewal or a check
    answers neither."""

    lease_id: str
    model: str
    version: int
    expires_in_s: float
    records: PeerRegions | None = None
    manifest: MergedManifest | None = None
