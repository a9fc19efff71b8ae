"""The ``local`` transport: both regions mapped in this process; a parallel memcpy.

A batch is cut into per-thread shares of roughly equal bytes (a single large read
is split too) and copied by the C helper in a thread pool; ctypes releases the GIL
for each call, so the shares run on separate cores while the event loop stays free.
Small batches (under ``inline_bytes``) are copied on the loop: handing them to a
thread would cost more than the copy. A :class:`Copier` given at construction
replaces that engine (a daemon's tests hold a copy mid-flight with one).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_threads
from typing import Protocol

import numpy as np
import numpy.typing as npt

from refitd.errors import TransportError

from .batch import split_shares
from .inproc import InProcessTransport
from .native import copy_lib

__all__ = ["Copier", "CopyFault", "LocalTransport", "copy_addresses"]


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
        self.threads = threads or min(4, os.cpu_count() or 1)
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
