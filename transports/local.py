"""The ``local`` transport: both regions mapped in this process; a parallel memcpy.

A batch is cut into per-thread shares of roughly equal bytes (a single large read
is split too) and copied by the C helper in a thread pool; ctypes releases the GIL
for each call, so the shares run on separate cores while the event loop stays free.
Small batches (under ``inline_bytes``) are copied on the loop: handing them to a
thread would cost more than the copy. A :class:`Copier` given at construction
replaces that engine (a daemon's tests hold a copy mid-flight with one).

Besides reads, the transport moves bytes between regions registered with it:
:meth:`LocalTransport.pack` gathers strided blocks contiguously (a source daemon
packing for a reader). :func:`pack_strided`, :func:`copy_view` and
:func:`zero_view` are the guarded primitives: every copy of memory a client can
resize goes through the bus-error guard, so a segment shrunk under a mapping is a
:class:`CopyFault`, never a fatal signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_threads
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from refitd.errors import PlanError, TransportError
from refitd.memory_kinds import MemoryKind

from .batch import split_shares
from .inproc import InProcessTransport
from .memory import copy_by_kind
from .native import copy_lib

__all__ = [
    "MAX_PACK_DIMS",
    "Copier",
    "CopyFault",
    "Gather",
    "LocalTransport",
    "copy_addresses",
    "copy_threads",
    "copy_view",
    "pack_strided",
    "strided_runs_of",
    "zero_view",
]


class CopyFault(TransportError):
    """A copy hit a bus error: a shared file mapped on one side was shrunk under the
    mapping, or its filesystem could not back a page. The process lives on; the bytes
    of that copy (and of the batch's copies not finished) are undefined.
    ``address`` is where the access faulted; ``dst``/``src``/``nbytes`` the copy."""

    def __init__(self, dst: int, src: int, nbytes: int, address: int) -> None:
        side = "destination" if dst <= address < dst + nbytes else "source"
        super().__init__(
            f"copy of {nbytes} bytes stopped by a bus error at {address:#x} ({side}): "
            "the shared file there is shorter than its mapping (shrunk under us) or its "
            "filesystem is full"
        )
        self.dst, self.src, self.nbytes, self.address = dst, src, nbytes, address
        self.side = side


class Copier(Protocol):
    """A memory-copy engine: what a same-process transport's reads end in."""

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (the reads
        were validated by the transport); return once every byte landed."""
        ...


def copy_batch_guarded(
    dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` in this thread (the
    C helper, GIL released) under the bus-error guard: a shared file shrunk under either
    side raises :class:`CopyFault` instead of killing the process. Every copy of
    memory a client can resize goes through here."""
    d, s, n = (np.ascontiguousarray(x, dtype=np.int64) for x in (dst, src, nbytes))
    at = ctypes.c_int64(0)
    i = copy_lib().rfx_copy_batch_guarded(
        len(n), d.ctypes.data, s.ctypes.data, n.ctypes.data, ctypes.byref(at)
    )
    if i == -2:
        raise TransportError(
            "copy refused: the bus-error guard could not be installed; nothing copied"
        )
    if i >= 0:
        raise CopyFault(int(d[i]), int(s[i]), int(n[i]), at.value)


async def copy_addresses(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    *,
    threads: int,
    pool: ThreadPoolExecutor | None,
    inline_bytes: int = 1 << 20,
) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (validated by the
    caller): the one memory-copy engine of this host. Under ``inline_bytes`` in all
    the copy runs here (a thread hop would cost more); else the bytes are cut into
    ``threads`` shares of about equal size (`split_shares`) copied by the C helper
    in ``pool`` with the GIL released."""
    share = copy_batch_guarded
    if int(nbytes.sum()) < inline_bytes or pool is None or threads <= 1:
        share(dst, src, nbytes)
        return
    running: list[Future[None]] = [
        pool.submit(share, d, s, n) for d, s, n, _ in split_shares(dst, src, nbytes, threads)
    ]
    try:
        # Every share runs to its end before this returns, even when one faults:
        # the caller may unmap the memory the moment it sees the error.
        done = await asyncio.gather(
            *(asyncio.wrap_future(f) for f in running), return_exceptions=True
        )
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
    except asyncio.CancelledError:
        # A thread cannot be stopped mid-copy; returning now would let the caller
        # unmap memory a thread still writes. Wait for them (one batch), then cancel.
        waiting = asyncio.ensure_future(asyncio.to_thread(wait_threads, running))
        while not waiting.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(waiting)
        raise


MAX_PACK_DIMS = 32
"""Dimensions of a packed block the native gather walks."""


def pack_strided(
    src: memoryview,
    src_offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    dst: memoryview,
    dst_offset: int,
) -> int:
    """Gather the strided block (``strides`` in elements) into ``dst`` contiguously.

    Returns the bytes written. Bounds must have been checked by
    the caller (a daemon: :func:`refitd.daemon.pull.plancheck.validate_plan`). The gather is the native one, under
    the bus-error guard: a source segment its owner shrank under the mapping raises
    :class:`CopyFault` (``dst`` undefined), never a fatal signal.
    """
    n = itemsize * math.prod(shape)
    if n == 0:
        return 0
    if not shape:  # a scalar: one element
        shape, strides = (1,), (1,)
    if len(shape) > MAX_PACK_DIMS:
        raise PlanError(
            f"pack refused: {len(shape)} dimensions; at most {MAX_PACK_DIMS} are packed"
        )
    src_at = np.frombuffer(src, np.uint8).ctypes.data + src_offset
    dst_at = np.frombuffer(dst, np.uint8).ctypes.data + dst_offset
    ext = np.array(shape, dtype=np.int64)
    step = np.array(strides, dtype=np.int64) * itemsize
    at = ctypes.c_int64(0)
    rc = copy_lib().rfx_gather_guarded(
        len(ext), ext.ctypes.data, step.ctypes.data, itemsize, src_at, dst_at, ctypes.byref(at)
    )
    if rc == -2:
        raise TransportError("pack refused: the bus-error guard could not be installed")
    if rc == 0:
        raise CopyFault(dst_at, src_at, n, at.value)
    return n


def strided_runs_of(block: Gather) -> tuple[npt.NDArray[np.int64], int]:
    """The contiguous runs of a strided block in the order a gather packs them
    (row-major): each run's first element (elements from the block's first) and the
    bytes of one run (every run is as long)."""
    dims = [(n, st) for n, st in zip(block.shape, block.strides, strict=True) if n != 1]
    run = 1  # elements in one run: the trailing dims that are dense
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = np.zeros(1, dtype=np.int64)
    for n, st in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    if math.prod(block.shape) == 0:
        return starts[:0], 0
    return starts, run * block.itemsize


def copy_view(dst: memoryview, src: bytes | bytearray | memoryview) -> None:
    """``dst[:] = src`` (same length, bytes) through the guarded native copy: a shared
    segment shrunk under either side raises :class:`CopyFault`
    instead of a fatal bus error."""
    n = len(dst)
    if len(src) != n:
        raise PlanError(f"copy refused: {len(src)} source bytes for a {n}-byte destination")
    if n == 0:
        return
    keep = np.frombuffer(src, np.uint8)  # held alive across the call
    d = np.array([np.frombuffer(dst, np.uint8).ctypes.data], dtype=np.int64)
    s = np.array([keep.ctypes.data], dtype=np.int64)
    ln = np.array([n], dtype=np.int64)
    at = ctypes.c_int64(0)
    i = copy_lib().rfx_copy_batch_guarded(
        1, d.ctypes.data, s.ctypes.data, ln.ctypes.data, ctypes.byref(at)
    )
    if i == -2:
        raise TransportError("copy refused: the bus-error guard could not be installed")
    if i >= 0:
        raise CopyFault(int(d[0]), int(s[0]), n, at.value)


OFF_LOOP_BLOCKS = 16_384
"""A device pack of more blocks than this lists its runs in a worker thread."""

_ZEROS = bytes(1 << 20)


def zero_view(dst: memoryview) -> None:
    """Zero ``dst`` through the guarded copy (from a zero buffer, 1 MiB a copy): a
    shared segment shrunk under it raises :class:`CopyFault`."""
    n = len(dst)
    if n == 0:
        return
    base = np.frombuffer(dst, np.uint8).ctypes.data
    zeros = np.frombuffer(_ZEROS, np.uint8).ctypes.data
    step = len(_ZEROS)
    d = np.arange(base, base + n, step, dtype=np.int64)
    ln = np.minimum(step, base + n - d).astype(np.int64)
    s = np.full(len(d), zeros, dtype=np.int64)
    at = ctypes.c_int64(0)
    i = copy_lib().rfx_copy_batch_guarded(
        len(d), d.ctypes.data, s.ctypes.data, ln.ctypes.data, ctypes.byref(at)
    )
    if i == -2:
        raise TransportError("zeroing refused: the bus-error guard could not be installed")
    if i >= 0:
        raise CopyFault(int(d[i]), int(s[i]), int(ln[i]), at.value)


@dataclass(frozen=True)
class Gather:
    """One strided block of a registered region: ``src_offset`` (bytes) of its first
    element, ``shape`` and ``strides`` in elements, ``itemsize`` in bytes."""

    src_region: int
    src_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int


def copy_threads() -> int:
    """Threads a transport copies a batch on unless told: one per core, at most four
    (past four, one process's copies are bound by memory bandwidth, not cores)."""
    return min(4, os.cpu_count() or 1)


class LocalTransport(InProcessTransport):
    scheme = "local"

    def __init__(
        self,
        *,
        secret: bytes,
        peer_id: str = "",
        threads: int | None = None,
        inline_bytes: int = 1 << 20,
        copier: Copier | None = None,
    ) -> None:
        super().__init__(secret=secret, peer_id=peer_id)
        self.threads = threads or copy_threads()
        self.inline_bytes = inline_bytes
        self.copier = copier
        self._pool: ThreadPoolExecutor | None = None
        self._lib = copy_lib()

    async def start(self) -> None:
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="refitd-local-copy")
        await super().start()

    async def close(self) -> None:
        await super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def pack(
        self, blocks: Sequence[Gather], dst_region: int, offsets: Sequence[int], clear_from: int
    ) -> None:
        """Gather each block contiguously into ``dst_region`` at ``offsets[i]`` (bytes),
        after zeroing ``dst_region`` from byte ``clear_from`` to its end (nothing of
        what it held survives there), in a worker thread. Every region must be
        registered here, every block's bounds checked by the caller. A segment
        shrunk under the copy raises :class:`CopyFault` (``side`` and ``address``
        say where); the destination's bytes are then undefined. A block of device
        memory is gathered by its engine instead (its contiguous runs copied into
        place, `transports.memory.copy_by_kind`): its bytes never pass the CPU."""
        on_device = {
            b.src_region
            for b in blocks
            if self._regions[b.src_region].segment.kind != MemoryKind.HOST
        }
        views = {
            r: self._view(r) for r in {dst_region, *(b.src_region for b in blocks)} - on_device
        }
        dst = views[dst_region]

        def work() -> None:
            zero_view(dst[clear_from:])
            for b, at in zip(blocks, offsets, strict=True):
                if b.src_region not in on_device:
                    src = views[b.src_region]
                    pack_strided(src, b.src_offset, b.shape, b.strides, b.itemsize, dst, at)

        await asyncio.to_thread(work)

        def picked() -> list[tuple[Gather, int]]:
            return [
                (b, at) for b, at in zip(blocks, offsets, strict=True) if b.src_region in on_device
            ]

        many = len(blocks) > OFF_LOOP_BLOCKS  # a Python step a block: off the loop
        device = await asyncio.to_thread(picked) if many else picked()
        if device:
            await self._pack_on_device(device, dst_region)

    async def _pack_on_device(self, blocks: list[tuple[Gather, int]], dst_region: int) -> None:
        """Device blocks into host region ``dst_region``: each contiguous run of each
        block copied by the device's engine to where the CPU gather would put it."""
        regions = self.regions
        address = {
            r: regions[r].segment.address for r in {dst_region, *(b.src_region for b, _ in blocks)}
        }

        def listed() -> tuple[np.ndarray, ...]:
            dst_ids, src_ids, dst_at, src_at, sizes = [], [], [], [], []
            for b, at in blocks:
                runs, run_bytes = strided_runs_of(b)
                n = len(runs)
                src_ids.append(np.full(n, b.src_region, dtype=np.int64))
                dst_ids.append(np.full(n, dst_region, dtype=np.int64))
                src_at.append(address[b.src_region] + b.src_offset + runs * b.itemsize)
                dst_at.append(address[dst_region] + at + np.arange(n) * run_bytes)
                sizes.append(np.full(n, run_bytes, dtype=np.int64))
            return (
                np.concatenate(dst_at).astype(np.int64),
                np.concatenate(src_at).astype(np.int64),
                np.concatenate(sizes),
                np.concatenate(dst_ids),
                np.concatenate(src_ids),
            )

        # A Python step a block: many are listed in a worker thread, off the loop.
        dst_at, src_at, sizes, dst_ids, src_ids = (
            await asyncio.to_thread(listed) if len(blocks) > OFF_LOOP_BLOCKS else listed()
        )
        await copy_by_kind(
            dst_at,
            src_at,
            sizes,
            dst_ids,
            src_ids,
            {k: r.segment for k, r in regions.items()},
            {k: r.segment for k, r in regions.items()},
            self.copy,
        )

    def _view(self, region_id: int) -> memoryview:
        region = self._regions.get(region_id)
        if region is None:
            raise TransportError(f"region {region_id} is not registered with this transport")
        seg = region.segment
        if seg.kind != MemoryKind.HOST:
            # A strided pack walks the bytes with the CPU: device memory is read
            # directly (one read per contiguous run), never packed here.
            raise TransportError(
                f"pack refused: region {region_id} is {seg.kind} memory, which this "
                "process's CPU cannot address; nothing was packed"
            )
        return memoryview((ctypes.c_uint8 * seg.size).from_address(seg.address)).cast("B")

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        if self.copier is not None:
            await self.copier.copy(dst, src, nbytes)
            return
        await copy_addresses(
            dst,
            src,
            nbytes,
            threads=self.threads,
            pool=self._pool,
            inline_bytes=self.inline_bytes,
        )
