"""The kinds of memory a region is made of, spelled once from the wire to the transports.

A region is one whole allocation of one kind of memory. The kind says what its identity
is, how its owner is proven and which copies it supports (`transports.memory`); it is
the ``kind`` of a region on the wire (`refitd.wire.regions`), the label of the region
metrics, and the ``kind`` a transport compares when it routes a copy. One value each,
everywhere: a kind read off the wire is the kind a transport compares.

``shm`` is not a kind of memory: it is a transport (the same-host data path, which maps
a peer's ``host`` segments). The wire spelled the kinds ``shm`` and ``cuda_ipc`` before
they were one; those spellings are refused on decode like any other unknown kind.

Imports nothing: the two bottom floors (the wire contract and the transports) both
import it, and neither imports the other.
"""

from __future__ import annotations

import enum

__all__ = ["MemoryKind"]


class MemoryKind(enum.StrEnum):
    """What a region's memory is. A ``StrEnum``: each member equals its value, so a
    memory kind compares and hashes as the string a transport or a record carries."""

    #: a shared-memory segment (a file under /dev/shm) mapped in this process
    HOST = "host"
    #: a GPU allocation, opened from its owner's CUDA IPC handle
    CUDA = "cuda"
