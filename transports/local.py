"""The ``local`` transport: both regions mapped in this process; a parallel memcpy.

A batch is cut into per-thread shares of roughly equal bytes (a single large read
is split too) and copied by the C helper in a thread pool; ctypes releases the GIL
for each call, so the shares run on separate cores while the event loop stays free.
Small batches (under ``inline_bytes``) are copied on the loop: handing them to a
thread would cost more than the copy.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from .core import split_shares
from .inproc import InProcessTransport
from .native import copy_lib

__all__ = ["LocalTransport"]


class LocalTransport(InProcessTransport):
    scheme = "local"

    def __init__(
        self,
        *,
        secret: bytes,
        peer_id: str = "",
        threads: int | None = None,
        inline_bytes: int = 1 << 20,
    ) -> None:
        super().__init__(secret=secret, peer_id=peer_id)
        self.threads = threads or min(4, os.cpu_count() or 1)
        self.inline_bytes = inline_bytes
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

    def _copy_share(
        self, d: npt.NDArray[np.int64], s: npt.NDArray[np.int64], n: npt.NDArray[np.int64]
    ) -> None:
        d, s, n = (np.ascontiguousarray(x, dtype=np.int64) for x in (d, s, n))
        self._lib.rfx_copy_batch(len(n), d.ctypes.data, s.ctypes.data, n.ctypes.data)

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        if int(nbytes.sum()) < self.inline_bytes or self._pool is None:
            self._copy_share(dst, src, nbytes)
            return
        loop = asyncio.get_running_loop()
        pool = self._pool
        await asyncio.gather(
            *(
                loop.run_in_executor(pool, self._copy_share, d, s, n)
                for d, s, n, _ in split_shares(dst, src, nbytes, self.threads)
            )
        )
