"""A daemon's identity (:class:`NodeInfo`) and its regions: creating or attaching
one, the daemon's record of it, and what garbage collection freed.

A region's ``kind`` is a :class:`~refitd.memory_kinds.MemoryKind` (``host``, ``cuda``),
the same values the transports compare: one spelling from the wire to the copy."""

from __future__ import annotations

from typing import Literal

import msgspec

from refitd.memory_kinds import MemoryKind
from refitd.wire.fields import Label, Name, NonNeg, ProcessTag

__all__ = [
    "GcReport",
    "Health",
    "NodeInfo",
    "RegionAttach",
    "RegionCreate",
    "RegionInfo",
]

Health = Literal["ok"]


class NodeInfo(msgspec.Struct, frozen=True):
    """Identity of one daemon. ``incarnation`` changes on every start, so a peer can tell a
    restarted daemon (whose regions and keys are gone) from the one it knew.
    ``shm_huge_pages`` is the ``huge=`` mode of the tmpfs holding its segments
    (``transports.segments.huge_page_mode``): under ``never`` they get 4 KiB pages and
    same-host UCX pulls from them move about half as much per thread."""

    node_id: str
    incarnation: int
    transport: str
    worker_info: dict[str, str] = {}
    #: the HTTP API version this daemon speaks (``/v1``)
    api_version: str = "1"
    shm_huge_pages: str = ""
    #: ``transport/device`` pairs the daemon's UCX can use here (``ucx_info -d``),
    #: e.g. ``tcp/eth0``, ``rc_mlx5/mlx5_0:1``; empty without a UCX data plane.
    ucx_transports: list[str] = []
    #: per known peer (trusted URL, or node a pull read from): the data path a pull
    #: from it takes or would take, and why (``refitd status``)
    paths: dict[str, str] = {}


class RegionCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ask the daemon to create (own) a region of ``nbytes`` for a client."""

    nbytes: NonNeg
    kind: MemoryKind = MemoryKind.HOST
    owner: Label = ""
    label: Label = ""
    #: the client process the region lives with, as ``<pid>.<start time>``
    #: (``transports.segments.owner_tag``; "" for none): when that process exits the
    #: daemon releases the region. The client library sends its own.
    process: ProcessTag = ""


class RegionAttach(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ask the daemon to attach a region a client created: for ``host`` memory
    ``handle`` is the segment's name; for ``cuda`` it is the hex CUDA IPC handle
    (refused without a GPU)."""

    handle: Name
    nbytes: NonNeg
    kind: MemoryKind = MemoryKind.HOST
    owner: Label = ""
    label: Label = ""
    #: the client process the region lives with, as ``<pid>.<start time>``
    #: (``transports.segments.owner_tag``; "" for none): when that process exits the
    #: daemon releases the region. The client library sends its own.
    process: ProcessTag = ""


class RegionInfo(msgspec.Struct, frozen=True):
    """The daemon's record of a region: what every descriptor is checked against.

    ``region_id`` is unique within one daemon incarnation and is also the id the region is
    registered under with the daemon's transport."""

    region_id: int
    kind: MemoryKind
    handle: str
    nbytes: int
    incarnation: int
    owner: str = ""
    label: str = ""
    daemon_owned: bool = False
    #: the client process whose exit releases this region (``<pid>.<start>``, "" none)
    process: str = ""


class GcReport(msgspec.Struct, frozen=True):
    """What ``POST /v1/gc`` freed (or, with ``dry_run``, would free): regions whose
    process exited and that no version, lease or running pull still needs,
    and shared-memory segments of this user whose creator process is gone."""

    dry_run: bool
    regions: list[RegionInfo]
    segments: list[str]
