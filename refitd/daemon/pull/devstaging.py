"""Device destinations over a data plane that moves host memory only: staged through host memory.

The ``tcp`` and UCX data planes read a peer's bytes into regions of this daemon
that are host memory; they never register a GPU region (`Transport.registers`). A
pull over them whose destinations include device memory reads through a
:class:`StagedPeer`: each batch's device-bound reads land first in a host staging
region of this daemon (a few buffers, each at most :data:`BUFFER_BYTES`), and the
same-host data plane then copies them on through the device's engine (host to GPU,
page-locked). The staging regions are kept between pulls (:class:`StagingRegions`):
making one backs every byte, and the engine's first copy registers it with the
driver, both in proportion to its size; a pull takes one already made and
registered, and gives it back when it ends. With the pull's
batches in flight two at a time, one batch's copy to the device overlaps the next
one's network read, so the link, not the staging, sets the pace.

Only the reading side is staged: a source daemon's GPU regions are refused before
any byte moves (`refitd.daemon.pull.core.refuse_peer_devices`; docs/gpu.md says what
the source side needs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from transports.batch import ReadBatch, as_read_batch
from transports.interface import Peer, PeerInfo

__all__ = ["BUFFERS", "BUFFER_BYTES", "KEEP", "StagedPeer", "StagingRegions"]

BUFFER_BYTES = 64 << 20
"""Bytes of one staging buffer: a batch's device-bound reads go through it in parts of
at most this much (a read is at most the path's piece, 32 MiB, so it always fits)."""
BUFFERS = 2
"""Staging buffers: one per batch a pull has in flight (`refitd.daemon.pull.pulls.IN_FLIGHT`)."""
KEEP = 1
"""Staging regions kept idle between pulls (each ``BUFFERS * BUFFER_BYTES`` bytes); pulls
running at once beyond it make their own, dropped when they end."""


class StagingRegions:
    """The daemon's host staging regions for device-bound reads, kept between pulls.

    ``make`` creates one (a daemon-owned region; its id), ``exists`` says whether a
    region id is still one of the daemon's, ``drop`` deletes one. :meth:`take` hands
    out an idle region (made, backed and registered by an earlier pull) or a new
    one; :meth:`give` keeps up to ``keep`` idle and drops the rest."""

    def __init__(
        self,
        make: Callable[[], Awaitable[int]],
        exists: Callable[[int], bool],
        drop: Callable[[int], Awaitable[None]],
        keep: int = KEEP,
    ) -> None:
        self._make = make
        self._exists = exists
        self._drop = drop
        self._keep = keep
        self._idle: list[int] = []
        #: staging regions made since the daemon started (a reused one is not counted)
        self.made = 0

    async def take(self) -> int:
        while self._idle:
            rid = self._idle.pop()
            if self._exists(rid):  # it may have been deleted meanwhile
                return rid
        rid = await self._make()
        self.made += 1
        return rid

    async def give(self, region_id: int) -> None:
        if not self._exists(region_id):
            return
        if len(self._idle) < self._keep:
            self._idle.append(region_id)
            return
        await self._drop(region_id)

    @property
    def idle(self) -> list[int]:
        return list(self._idle)


class StagedPeer(Peer):
    """``inner`` (a connection of a host-memory data plane) with the reads into
    ``devices`` (region ids of device memory here) staged through host region
    ``staging`` (``BUFFERS * BUFFER_BYTES`` bytes, registered with ``inner``'s data plane
    and the same-host one) and copied on by ``loopback`` (the same-host data plane's
    connection to this daemon's own regions)."""

    def __init__(self, inner: Peer, loopback: Peer, staging: int, devices: Iterable[int]) -> None:
        self.inner = inner
        self.info: PeerInfo = inner.info
        self.loopback = loopback
        self.staging = staging
        self.devices = np.array(sorted(set(devices)), dtype=np.int64)
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for buffer in range(BUFFERS):
            self._free.put_nowait(buffer)
        #: bytes that went through staging (the path's report)
        self.staged_bytes = 0

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        reads = as_read_batch(batch)
        to_device = np.isin(reads["local_region"], self.devices)
        if not to_device.any():
            await self.inner.get(reads)
            return
        direct = reads[~to_device]
        device = reads[to_device]
        buffer = await self._free.get()
        try:
            base = buffer * BUFFER_BYTES
            for part in _parts(device["nbytes"], BUFFER_BYTES):
                chunk = device[part]
                at = base + np.concatenate([[0], np.cumsum(chunk["nbytes"])[:-1]]).astype(np.int64)
                into = chunk.copy()
                into["local_region"], into["local_offset"] = self.staging, at
                # The host-bound reads ride with the first part: one round trip.
                first = direct if part.start == 0 else direct[:0]
                await self.inner.get(np.concatenate([first, into]))
                back = chunk.copy()
                back["remote_region"], back["remote_offset"] = self.staging, at
                await self.loopback.get(back)
                self.staged_bytes += int(chunk["nbytes"].sum())
        finally:
            self._free.put_nowait(buffer)

    async def update(self, info: PeerInfo) -> None:
        await self.inner.update(info)
        self.info = info

    async def close(self) -> None:
        """Closes the loopback; ``inner`` is the data plane's (shared) connection."""
        await self.loopback.close()


def _parts(nbytes: npt.NDArray[np.int64], limit: int) -> list[slice]:
    """Consecutive slices of reads whose bytes add up to at most ``limit`` each (a
    single read is never longer: the path cuts reads into pieces first)."""
    out: list[slice] = []
    lo, total = 0, 0
    for i, n in enumerate(nbytes.tolist()):
        if total + n > limit and i > lo:
            out.append(slice(lo, i))
            lo, total = i, 0
        total += n
    out.append(slice(lo, len(nbytes)))
    return out
