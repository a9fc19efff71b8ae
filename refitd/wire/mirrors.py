"""Host mirrors and relay, daemon to daemon (see :mod:`refitd.daemon.mirrors`)."""

from __future__ import annotations

import msgspec

__all__ = ["HolderAssign", "HolderJoin", "MirrorState"]


class HolderJoin(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A mirror joining the holder book of the source of ``model`` ``version``:
    it serves at ``url``; ``exclude`` are holders it failed to read from."""

    model: str
    version: int
    url: str
    node_id: str
    exclude: list[str] = []


class HolderAssign(msgspec.Struct, frozen=True):
    """The holder a joining mirror reads from (``""``: the source itself) and every
    holder the source knows of the version, in pipeline order."""

    upstream: str
    holders: list[str]


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
