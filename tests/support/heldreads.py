"""A ``tcp`` data server holding reads of a mirror still filling, and a puller that
reads from it: what the held-read tests (``transports.tcp.held``,
:mod:`refitd.daemon.mirror.hold`) set up.

Real ``tcp`` transports on loopback. The source serves a region that a real
:class:`~refitd.daemon.mirror.chunks.Mirror` is "filling", cut in chunks of 1 MiB: the test
writes a chunk's bytes, then marks it complete (:meth:`HeldReads.complete`), as a fill
does after its read returned; the daemon's own
:class:`~refitd.daemon.mirror.hold.FillingMirrors` tells the data server which bytes
are complete.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np

from refitd.daemon.mirror.chunks import Mirror, cut_chunks
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.wire import MemoryKind, RegionInfo
from transports.interface import PeerInfo
from transports.segments import SharedSegment
from transports.tcp import TcpPeer, TcpTransport
from transports.tcp.frames import scope_key
from transports.tcp.held import HOLD_S

__all__ = ["LEASE", "MIB", "SERVED", "HeldReads", "chunk_read", "held_reads"]

SECRET = b"held-reads-secret-0123456789abcdef"
MIB = 1 << 20
"""A mirror chunk's size, in bytes."""
SOURCE_REGION, SERVED, LOCAL = 7, 1, 2
"""The region id at the mirror's source, the id the data server serves it as, and the
puller's destination region id."""
LEASE = "lease-held"
"""The lease the grants name; live at the source until a test ends it."""


@dataclass
class HeldReads:
    """The data server (``server``), the puller, the mirror filling and its
    :class:`FillingMirrors`, the served segment ``src`` and the puller's ``dst`` (both
    ``size`` bytes), and ``live``: the leases the server finds live."""

    server: TcpTransport
    puller: TcpTransport
    mirror: Mirror
    filling: FillingMirrors
    src: SharedSegment
    dst: SharedSegment
    live: set[str]
    size: int
    safety_s: float

    def complete(self, chunk: int, fill: int) -> None:
        """Write chunk ``chunk``'s bytes, then mark it complete (as a fill does)."""
        self.src.numpy()[chunk * MIB : (chunk + 1) * MIB] = fill
        self.mirror.mark(np.array([chunk]))
        self.filling.changed()

    async def held(self, n: int = 1) -> None:
        """Return once ``n`` reads are held (a count the server's threads keep, so
        polled: no event to await); fail after ``safety_s``."""
        async with asyncio.timeout(self.safety_s):
            while self.server.server.holds.held < n:  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    def grant(self, extents: list[tuple[int, int]]) -> PeerInfo:
        """The server's record, scoped to ``LEASE`` and ``extents`` (``(offset,
        nbytes)`` of the served region) and signed, as the source daemon grants it."""
        info = self.server.advertise()
        key = scope_key(LEASE, extents)
        regions = tuple(msgspec.structs.replace(r, key=key) for r in info.regions)
        return msgspec.structs.replace(info, regions=regions, mac=b"").signed(SECRET)

    async def connect(self) -> TcpPeer:
        """A new connection from the puller under a grant of the whole region."""
        return await self.puller.connect(self.grant([(0, self.size)]))


def chunk_read(chunk: int) -> list[tuple[int, int, int, int, int]]:
    """The read row of chunk ``chunk``, into the same bytes of ``dst``."""
    return [(LOCAL, chunk * MIB, SERVED, chunk * MIB, MIB)]


@contextlib.asynccontextmanager
async def held_reads(
    size: int, *, lanes: int | None = None, hold_s: float = HOLD_S, safety_s: float = 30.0
) -> AsyncIterator[HeldReads]:
    """Serve ``size`` bytes (whole MiB chunks, none complete yet) of a mirror filling,
    the server requiring a live lease and holding a read of an incomplete chunk for
    ``hold_s`` at most; the puller opens ``lanes`` lanes a connection (else the
    transport's default). ``safety_s`` bounds :meth:`HeldReads.held`."""
    live = {LEASE}
    m = Mirror("http://source", "m", 1)
    m.regions = {SOURCE_REGION: RegionInfo(SERVED, MemoryKind.HOST, "", size, 0)}
    m.chunks = cut_chunks({SOURCE_REGION: [(0, size)]}, MIB)
    m.done = np.zeros(len(m.chunks), dtype=bool)
    f = FillingMirrors()
    f.add(m)
    puller = (
        TcpTransport(secret=SECRET) if lanes is None else TcpTransport(secret=SECRET, lanes=lanes)
    )
    with SharedSegment.create(size, "src") as src, SharedSegment.create(size, "dst") as dst:
        async with (
            TcpTransport(
                secret=SECRET, authorize=live.__contains__, require_lease=True, hold_s=hold_s
            ) as server,
            puller,
        ):
            server.hold_reads(f)
            await server.register(SERVED, src)
            await puller.register(LOCAL, dst)
            yield HeldReads(server, puller, m, f, src, dst, live, size, safety_s)
