"""The ``reference`` transport: one ctypes memmove per read, on the event loop.

Deliberately the simplest correct implementation: the oracle the other transports'
contract tests compare against. It blocks the event loop for the whole batch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

from .inproc import InProcessTransport

__all__ = ["ReferenceTransport"]


class ReferenceTransport(InProcessTransport):
    scheme = "reference"

    async def copy(
        self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> None:
        for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
            ctypes.memmove(d, s, n)
