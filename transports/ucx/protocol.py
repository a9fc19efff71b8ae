"""Messages between a `UcxTransport` (the owner) and its data-plane process.

Frames are a 4-byte little-endian length and a msgpack body. The owner sends
`Envelope`s; the data-plane process answers each with a `Reply` carrying the same
``seq``, in order. Batches travel as raw ``READ_DTYPE`` bytes (40 bytes per read).
"""

from __future__ import annotations

import struct

import msgspec

from ..core import RegionInfo

MAX_FRAME = 1 << 30


class Register(msgspec.Struct, tag="register", frozen=True):
    """Attach shared segment ``name`` (exactly ``size`` bytes) and map it with UCX."""

    region_id: int
    name: str
    size: int


class Deregister(msgspec.Struct, tag="deregister", frozen=True):
    region_id: int


class Connect(msgspec.Struct, tag="connect", frozen=True):
    """Make endpoint ``peer`` from a worker address and unpack its (authenticated) keys."""

    peer: int
    address: bytes
    regions: tuple[RegionInfo, ...]


class Disconnect(msgspec.Struct, tag="disconnect", frozen=True):
    peer: int


class Get(msgspec.Struct, tag="get", frozen=True):
    peer: int
    batch: bytes


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


Request = Register | Deregister | Connect | Disconnect | Get | Stop


class Envelope(msgspec.Struct, frozen=True):
    seq: int
    body: Request


class Reply(msgspec.Struct, frozen=True):
    """``error`` is empty on success; ``kind`` is "refused" (validation) or "transport"."""

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
