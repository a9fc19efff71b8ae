"""What every device's copy engine does around its driver's copies: pins, bounces, fences.

A device kind's engine (`transports.cuda`'s, and the CPU one the tests use) is a
:class:`DeviceEngine`: it says how to make a stream, a daemon-owned page-locked
buffer, and how to issue and await copies on that stream. This module does the rest,
the same for every device, so the rules are written once:

- **Pins, per batch.** Each host memory a batch touches is held registered
  (`transports.pins.PINS`) for that batch only; its mapping's close drops the
  registration (never a registration outliving its mapping).
- **Never unregistered memory to the driver.** Host memory the driver did not
  register (over the cap, refused, a range registered by something else) is copied
  through a *bounce buffer*: the CPU side of the copy is the transports' guarded
  memcpy, into or out of a page-locked buffer the daemon owns, and only that buffer
  meets the driver. A client's segment shrunk under its mapping is then a
  :class:`~transports.local.CopyFault` that fails one pull, where a pageable copy in
  the driver would raise SIGBUS inside it and kill the daemon.
- **Lanes: batches overlap.** A batch takes one of a few lanes (a stream and its
  bounce buffer, made once and kept), so batches of different pulls, of different
  event loops or threads, run side by side and each is fenced on its own stream.
  No asyncio lock: the engine is shared by every loop of the process.
- **A fence before return, always.** Whether the batch succeeded or not, its stream
  is synchronised before the batch returns (or raises): the caller may free or reuse
  the memory the moment it does, and a copy still running would write into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from abc import abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .local import CopyFault, copy_batch_guarded
from .memory import CopyEngine, DeviceFault
from .pins import PINS, Registrar, page_span

if TYPE_CHECKING:
    from .interface import MappedMemory

__all__ = ["BOUNCE_BYTES", "LANES", "DeviceEngine", "Lane", "bounce_chunks", "in_ranges"]

LANES = 4
"""Batches one engine runs at once (each on a stream of its own)."""
BOUNCE_BYTES = 8 << 20
"""Bytes of one lane's bounce buffer (page-locked, the daemon's, made once)."""


@dataclass
class Lane:
    """One stream of an engine, and its bounce buffer (0 until first needed)."""

    stream: Any
    bounce: int = 0


class DeviceEngine(CopyEngine):
    """A device's copy engine: :meth:`copy` holds pins, bounces what the driver may
    not touch and fences each batch (module docstring). Subclasses give the driver's
    part: the hooks below, each called in the batch's own thread."""

    lanes: int = LANES
    bounce_bytes: int = BOUNCE_BYTES

    def __init__(self, registrar: Registrar) -> None:
        self.registrar = registrar
        self._lanes_cond = threading.Condition()
        self._free: list[Lane] = []
        self._made = 0
        #: bytes that went through a bounce buffer since the engine was made
        self.bounced_bytes = 0

    # -- the driver's part

    @abstractmethod
    def _current(self) -> AbstractContextManager[None]:
        """This device current in the calling thread for the block, restored after."""

    @abstractmethod
    def _new_stream(self) -> Any:
        """A stream of this device's own (not ordered after anyone else's work)."""

    @abstractmethod
    def _new_bounce(self, nbytes: int) -> int:
        """``nbytes`` of page-locked host memory the daemon owns, for the engine's life."""

    @abstractmethod
    def _issue(
        self,
        stream: Any,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> None:
        """Queue the copies on ``stream`` (host sides are registered memory only).
        Raises :class:`DeviceFault` whose index is the read of these arrays."""

    @abstractmethod
    def _sync(self, stream: Any) -> None:
        """Return once everything queued on ``stream`` ran; :class:`DeviceFault` if
        any of it failed."""

    # -- batches

    async def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[MappedMemory],
    ) -> None:
        work = asyncio.ensure_future(
            asyncio.to_thread(self.copy_batch, dst.copy(), src.copy(), nbytes.copy(), host)
        )
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            # A copy on the device cannot be recalled: the caller may free the memory
            # the moment it returns, so wait for the batch, then cancel.
            while not work.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(work)
            raise

    def copy_batch(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[MappedMemory],
    ) -> None:
        """One batch, in this thread: returns (or raises) only once nothing of it
        runs on the device any more."""
        with self._current():
            lane = self._take_lane()
            held: list[int] = []
            try:
                unpinned: list[tuple[int, int]] = []
                for m in host:
                    if PINS.acquire(self.registrar, m.address, page_span(m.size), m):
                        held.append(m.address)
                        self._pinned(m.address)
                    else:
                        unpinned.append((m.address, m.size))
                inbound = in_ranges(src, unpinned)
                outbound = in_ranges(dst, unpinned)
                bounce = inbound | outbound
                direct = np.flatnonzero(~bounce)
                if len(direct):
                    self._issue_at(lane.stream, dst, src, nbytes, direct)
                if bounce.any():
                    self._bounce(lane, dst, src, nbytes, np.flatnonzero(bounce), inbound, outbound)
            except BaseException:
                with contextlib.suppress(DeviceFault):
                    self._sync(lane.stream)  # nothing of the batch still runs when it raises
                raise
            else:
                self._sync(lane.stream)
            finally:
                for address in held:
                    PINS.release(address)
                self._give_lane(lane)

    def _pinned(self, address: int) -> None:
        """A batch holds the registration of host memory at ``address`` (a hook)."""

    def _issue_at(
        self,
        stream: Any,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        k: npt.NDArray[np.intp],
    ) -> None:
        try:
            self._issue(stream, dst[k], src[k], nbytes[k])
        except DeviceFault as exc:
            at = int(k[exc.index]) if 0 <= exc.index < len(k) else -1
            raise DeviceFault(str(exc), at) from exc

    def _bounce(
        self,
        lane: Lane,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        k: npt.NDArray[np.intp],
        inbound: npt.NDArray[np.bool_],
        outbound: npt.NDArray[np.bool_],
    ) -> None:
        """Reads ``k`` through the lane's bounce buffer: host memory the driver did
        not register is read and written only by the guarded memcpy."""
        both = k[inbound[k] & outbound[k]]  # host to host: no device in it at all
        if len(both):
            self._guarded(dst[both], src[both], nbytes[both], dst[both], src[both])
        k = k[~(inbound[k] & outbound[k])]
        if not len(k):
            return
        if not lane.bounce:
            lane.bounce = self._new_bounce(self.bounce_bytes)
        for chunk in bounce_chunks(nbytes[k], self.bounce_bytes):
            j = k[chunk[:, 0]]
            off, n, at = chunk[:, 1], chunk[:, 2], lane.bounce + chunk[:, 3]
            d, s = dst[j] + off, src[j] + off
            into, out_of = inbound[j], outbound[j]
            if into.any():
                self._guarded(at[into], s[into], n[into], d[into], s[into])
            dev_dst = np.where(out_of, at, d)
            dev_src = np.where(into, at, s)
            try:
                self._issue(lane.stream, dev_dst, dev_src, n)
            except DeviceFault as exc:
                i = int(j[exc.index]) if 0 <= exc.index < len(j) else -1
                raise DeviceFault(str(exc), i) from exc
            self._sync(lane.stream)
            if out_of.any():
                self._guarded(d[out_of], at[out_of], n[out_of], d[out_of], s[out_of])
            self.bounced_bytes += int(n.sum())

    @staticmethod
    def _guarded(
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        read_dst: npt.NDArray[np.int64],
        read_src: npt.NDArray[np.int64],
    ) -> None:
        """The guarded memcpy; a fault names the read's own addresses (never the
        bounce buffer's), so the transport finds its destination."""
        try:
            copy_batch_guarded(dst, src, nbytes)
        except CopyFault as exc:
            i = int(np.flatnonzero((dst == exc.dst) & (src == exc.src))[0])
            shift = exc.address - (exc.dst if exc.side == "destination" else exc.src)
            side = int(read_dst[i]) if exc.side == "destination" else int(read_src[i])
            raise CopyFault(
                int(read_dst[i]), int(read_src[i]), int(nbytes[i]), side + shift
            ) from exc

    # -- lanes

    def _take_lane(self) -> Lane:
        with self._lanes_cond:
            while not self._free and self._made >= self.lanes:
                self._lanes_cond.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        try:
            return Lane(self._new_stream())
        except BaseException:
            with self._lanes_cond:
                self._made -= 1
                self._lanes_cond.notify()
            raise

    def _give_lane(self, lane: Lane) -> None:
        with self._lanes_cond:
            self._free.append(lane)
            self._lanes_cond.notify()


def in_ranges(
    addresses: npt.NDArray[np.int64], ranges: list[tuple[int, int]]
) -> npt.NDArray[np.bool_]:
    """Which ``addresses`` lie in one of ``ranges`` (``(base, bytes)`` each)."""
    hit = np.zeros(len(addresses), dtype=bool)
    for base, n in ranges:
        hit |= (base <= addresses) & (addresses < base + n)
    return hit


def bounce_chunks(nbytes: npt.NDArray[np.int64], capacity: int) -> list[npt.NDArray[np.int64]]:
    """Reads of ``nbytes`` bytes cut into buffer loads of at most ``capacity`` bytes:
    per load, rows ``(read, offset in the read, bytes, offset in the buffer)``. A read
    longer than the buffer spans several loads; every byte is in exactly one row."""
    chunks: list[npt.NDArray[np.int64]] = []
    rows: list[tuple[int, int, int, int]] = []
    used = 0
    for i, n in enumerate(nbytes.tolist()):
        off = 0
        while off < n:
            take = min(n - off, capacity - used)
            rows.append((i, off, take, used))
            used += take
            off += take
            if used == capacity:
                chunks.append(np.array(rows, dtype=np.int64))
                rows, used = [], 0
    if rows:
        chunks.append(np.array(rows, dtype=np.int64))
    return chunks
