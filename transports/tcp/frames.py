"""The ``tcp`` data plane's wire: frames, the handshake, grants and scope checks.

Everything both ends of a ``tcp`` data connection must agree on lives here, with no
sockets held: byte layouts, the challenge-response that authenticates a connection,
the scope a grant carries, and the vectorised check the data server runs on every
read before it sends a byte. `transports.tcp` holds the sockets and threads.

Handshake (no secret or token ever travels; only MACs over fresh nonces)::

    client -> server  HELLO      magic, client incarnation,
                                 expected server incarnation, client nonce
    server -> client  CHALLENGE  server incarnation, server nonce,
                                 MAC(secret, "server" | nonces | both incarnations)
    client -> server  PROOF      MAC(secret, "client" | nonces | both incarnations | grant MAC)
                      GRANT      the signed, lease-scoped record the proof is bound to
    server -> client  OK         one byte

A server that refuses a connection for room (too many handshakes pending from the
client's address or in all, every connection slot taken) answers the HELLO, in place
of the CHALLENGE, with a REFUSAL of the same size: incarnation 0 (never a server's),
then why (utf-8, NUL-padded), and closes it. It is not authenticated: it only lets a
puller's error say what happened. A host or a local user the server does not trust gets
no byte at all.

A server whose incarnation is not the one the client expects answers the challenge with
its own incarnation, so the client can tell a restarted source (a new life: fetch its new
record) from a wrong secret. Frames after the handshake (little-endian)::

    header  kind u8, 3 pad, a u32, b u32, id u64                       (20 bytes)
    GRANT   a = body bytes, b = grant number;      body: msgpack PeerInfo
    READ    a = reads,      b = grant number, id;  body: reads x (region, offset, nbytes) i64
    DATA    a = 0,          id;                    then exactly sum(nbytes) bytes, in order
    REFUSED a = text bytes, id;                    body: why (utf-8); the connection stays

A frame the server cannot parse (unknown kind, a count past the bounds below, a
grant whose MAC fails, an unknown grant number) closes that connection only.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import TransportError

from ..batch import spans_of, within_spans
from ..interface import PeerInfo, Scope

__all__ = [
    "CHALLENGE",
    "HEADER",
    "HELLO",
    "MAGIC",
    "MAX_GRANTS",
    "MAX_GRANT_BYTES",
    "MAX_READS",
    "Grant",
    "Kind",
    "ScopeKey",
    "check_scope",
    "client_proof",
    "refusal",
    "refusal_reason",
    "scope_key",
    "scoped_grant",
    "server_proof",
]

MAGIC = b"RFTCP\x01"
# magic, client incarnation, expected server incarnation, nonce
HELLO = struct.Struct("<6sQQ16s")
CHALLENGE = struct.Struct("<Q16s32s")  # server incarnation, server nonce, server MAC
PROOF = struct.Struct("<32s")
HEADER = struct.Struct("<B3xIIQ")
READ_ROW = np.dtype([("region", "<i8"), ("offset", "<i8"), ("nbytes", "<i8")])

MAX_READS = 4096
"""Reads in one READ frame at most (a request body is then ≤ 96 KiB)."""
MAX_GRANT_BYTES = 256 << 10
"""Bytes of one grant record at most."""
MAX_GRANTS = 8
"""Grants a connection keeps (the newest); together with the bounds above and the
4 MiB buffer small pieces are gathered in (`transports.tcp.serve.GATHER_BYTES`), what
one connection can make the data server hold: about 6.1 MiB."""


def refusal(why: str) -> bytes:
    """The REFUSAL frame saying ``why`` (cut to what fits)."""
    text = why.encode()[: CHALLENGE.size - 8]
    return bytes(8) + text.ljust(CHALLENGE.size - 8, b"\0")


def refusal_reason(answer: bytes) -> str | None:
    """Why the server refused, when ``answer`` (a CHALLENGE-sized first answer) is a
    REFUSAL; None for a challenge."""
    if len(answer) != CHALLENGE.size or answer[:8] != bytes(8):
        return None
    return answer[8:].rstrip(b"\0").decode(errors="replace")


class Kind:
    GRANT = 1
    READ = 2
    DATA = 3
    REFUSED = 4


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def server_proof(secret: bytes, cn: bytes, sn: bytes, ce: int, se: int) -> bytes:
    """The server's answer: it knows the secret, for these nonces and incarnations."""
    return _mac(secret, b"refitd-tcp server", cn, sn, struct.pack("<QQ", ce, se))


def client_proof(secret: bytes, cn: bytes, sn: bytes, ce: int, se: int, grant_mac: bytes) -> bytes:
    """The client's answer, bound to the incarnations and to the (lease-scoped) grant."""
    return _mac(secret, b"refitd-tcp client", cn, sn, struct.pack("<QQ", ce, se), grant_mac)


class ScopeKey(NamedTuple):
    """The key a grant gives a region: the lease (``lease_id``) and the
    ``[start, end)`` byte ranges of the region it may read (``extents``)."""

    lease_id: str
    extents: list[tuple[int, int]]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode((self.lease_id, self.extents))

    @classmethod
    def decode(cls, raw: bytes) -> ScopeKey:
        return cls(*msgspec.msgpack.decode(raw, type=tuple[str, list[tuple[int, int]]]))


def scope_key(lease_id: str, extents: Sequence[tuple[int, int]]) -> bytes:
    """The encoded :class:`ScopeKey` of a grant region."""
    return ScopeKey(lease_id, [(int(a), int(b)) for a, b in extents]).encode()


class Grant:
    """A verified record, as the data server checks reads against it: per region its
    generation, size and readable ranges (merged, sorted: their ``starts`` and
    ``ends``, bytes); the lease ("" for none)."""

    def __init__(self, info: PeerInfo) -> None:
        self.info = info
        self.lease = ""
        self.generations: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.starts: dict[int, npt.NDArray[np.int64]] = {}
        self.ends: dict[int, npt.NDArray[np.int64]] = {}
        leases: set[str] = set()
        for r in info.regions:
            self.generations[r.region_id] = r.generation
            self.sizes[r.region_id] = r.size
            if r.key:
                lease, extents = ScopeKey.decode(r.key)
                leases.add(lease)
            else:  # no scope: the whole region
                extents = [(0, r.size)]
            self.starts[r.region_id], self.ends[r.region_id] = spans_of(extents)
        if len(leases) > 1:
            raise ValueError(f"a grant names {len(leases)} leases; one record, one lease")
        self.lease = leases.pop() if leases else ""
        #: whether every region carries a scope (a lease's grant)
        self.scoped = all(r.key for r in info.regions) and bool(info.regions)


def check_scope(
    grant: Grant,
    region: npt.NDArray[np.int64],
    offset: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    generations: dict[int, int],
    sizes: dict[int, int],
) -> tuple[int, str] | None:
    """``(index, why)`` of the first read outside ``grant`` (or of a region whose
    registration, ``generations``/``sizes`` here, is not the one the grant names), or
    None when every read may be served. Zero-byte reads are checked like any. Whether
    a read lies in the grant's spans is :func:`transports.batch.within_spans`, over
    every read of a region at once."""
    if (nbytes < 0).any() or (offset < 0).any():
        i = int(np.flatnonzero((nbytes < 0) | (offset < 0))[0])
        return i, "a negative offset or length"
    for rid in np.unique(region).tolist():
        rows = np.flatnonzero(region == rid)
        if rid not in grant.generations:
            return int(rows[0]), f"region {rid} is not in the record the connection was granted"
        if generations.get(rid) != grant.generations[rid] or sizes.get(rid) != grant.sizes[rid]:
            return int(rows[0]), (
                f"region {rid} is not registered here as the record states (deregistered or "
                "registered again since)"
            )
        _, inside = within_spans(offset[rows], nbytes[rows], grant.starts[rid], grant.ends[rid])
        if not inside.all():
            i = int(rows[np.flatnonzero(~inside)[0]])
            return i, (
                f"region {rid} bytes [{int(offset[i])}, {int(offset[i]) + int(nbytes[i])}) are "
                "outside what the record's lease may read"
            )
    return None


def scoped_grant(
    advert: PeerInfo,
    lease_id: str,
    scope: Scope,
    secret: bytes,
) -> PeerInfo:
    """The credential a reader connects to a ``tcp`` source with: the regions of
    ``scope`` as the source's advertisement ``advert`` registers them (generations,
    sizes), each limited to its ``[start, end)`` byte ranges under ``lease_id`` (a
    :class:`~transports.tcp.frames.ScopeKey`), signed with the deployment ``secret``.
    The source's data server reads nothing outside it. A region the advertisement
    does not list is refused (:class:`TransportError`)."""
    listed = {r.region_id: r for r in advert.regions}
    regions = []
    for rid, extents in scope.items():
        reg = listed.get(rid)
        if reg is None:
            raise TransportError(
                f"region {rid} of {advert.peer_id!r} is not in its tcp advertisement"
            )
        regions.append(msgspec.structs.replace(reg, key=scope_key(lease_id, extents)))
    return PeerInfo("tcp", advert.peer_id, advert.address, tuple(regions)).signed(secret)
