"""Messages between a `UcxTransport` (the owner) and its data-plane process.

Frames are a 4-byte little-endian length and a msgpack body. The owner sends
`Envelope`s; the data-plane process answers each with a `Reply` carrying the same
``seq``, in order. Batches travel as raw ``READ_DTYPE`` bytes (40 bytes per read).
"""

from __future__ import annotations

import struct

import msgspec

from ..interface import AdvertisedRegion

MAX_FRAME = 1 << 30
EXIT_TIMED_OUT = 3
"""A data-plane process's exit status after a batch passed its deadline."""


class Register(msgspec.Struct, tag="register", frozen=True):
    """Attach shared segment ``name`` (exactly ``size`` bytes) and map it with UCX.

    ``pack``: also pack its remote key (the serving process, whose keys are
    advertised); a pulling process only writes into it."""

    region_id: int
    name: str
    size: int
    pack: bool = True


class Deregister(msgspec.Struct, tag="deregister", frozen=True):
    region_id: int


class Connect(msgspec.Struct, tag="connect", frozen=True):
    """Make endpoint ``peer`` from a worker address and unpack its (authenticated) keys."""

    peer: int
    address: bytes
    regions: tuple[AdvertisedRegion, ...]


class Disconnect(msgspec.Struct, tag="disconnect", frozen=True):
    peer: int


class Get(msgspec.Struct, tag="get", frozen=True):
    """Read ``batch`` from ``peer``, giving up at ``deadline_ns`` (``time.monotonic_ns``,
    the same clock in every process of the host). A process that gave up replies
    kind "timeout" and then exits: a GET still in flight must not land later."""

    peer: int
    batch: bytes
    deadline_ns: int


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


Request = Register | Deregister | Connect | Disconnect | Get | Stop


class Envelope(msgspec.Struct, frozen=True):
    seq: int
    body: Request


class Reply(msgspec.Struct, frozen=True):
    """``error`` is empty on success; ``kind`` is "refused" (validation), "transport" or
    "timeout" (the deadline passed; the process exits right after this reply)."""

    seq: int
    error: str = ""
    kind: str = ""
    address: int = 0
    rkey: bytes = b""
    worker_address: bytes = b""
    reads: int = 0


def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def frame_size(header: bytes) -> int:
    (n,) = struct.unpack("<I", header)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    return int(n)
