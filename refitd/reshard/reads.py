"""The data-plane surface the planner executes against, and its reference oracle.

A plan is executed as two kinds of reads:

- :class:`ReadDescriptor`: ``nbytes`` contiguous bytes from a source session's
  address to a destination address (one RDMA GET on the wire);
- :class:`PackedRead`: a *pack spec* — a strided region of a source session that
  the source side packs contiguous so the receiver fetches it with one read. On the
  wire it is one descriptor of ``nbytes``; the receiver then lands the packed bytes
  contiguous, or scatters them with ``dst_strides`` when the destination is strided.

:class:`InMemoryReadExecutor` performs both with real memory moves on CPU
addresses of this process, so a plan that reconstructs correctly through it moves
the right bytes on any transport.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "InMemoryReadExecutor",
    "PackedRead",
    "PackingReadExecutor",
    "ReadDescriptor",
    "ReadExecutor",
]


@dataclass(frozen=True)
class ReadDescriptor:
    """Read ``nbytes`` bytes at ``src_addr`` of ``session`` into ``dst_addr``."""

    session: str
    src_addr: int
    dst_addr: int
    nbytes: int


@dataclass(frozen=True)
class PackedRead:
    """One packed read of a strided source region.

    ``shape`` is in elements; ``src_strides`` and ``dst_strides`` are in bytes, one
    per dim; ``elsize`` is bytes per element. ``dst_strides=None`` means the packed
    bytes land contiguous at ``dst_addr``. Strides must be non-negative.
    """

    session: str
    src_addr: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    elsize: int
    dst_addr: int
    dst_strides: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the packed payload."""
        return math.prod(self.shape) * self.elsize


@runtime_checkable
class ReadExecutor(Protocol):
    """Anything that can perform a batch of contiguous reads."""

    def read(self, descriptors: list[ReadDescriptor]) -> None: ...


@runtime_checkable
class PackingReadExecutor(ReadExecutor, Protocol):
    """A read executor whose source side can also pack strided regions."""

    def read_packed(self, reads: list[PackedRead]) -> None: ...


def _strided_bytes(
    addr: int, shape: tuple[int, ...], strides: tuple[int, ...], elsize: int
) -> npt.NDArray[np.uint8]:
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + elsize
    raw = np.ctypeslib.as_array((ctypes.c_ubyte * span).from_address(addr))
    view: npt.NDArray[np.uint8] = np.lib.stride_tricks.as_strided(
        raw, (*shape, elsize), (*strides, 1), writeable=True
    )
    return view


class InMemoryReadExecutor:
    """Reference executor over this process's memory: ``ctypes.memmove`` per read.

    Sessions are labels only; addresses are absolute. Deliberately simple: this is
    the correctness oracle, not a fast path.
    """

    def read(self, descriptors: list[ReadDescriptor]) -> None:
        for d in descriptors:
            if d.nbytes:
                ctypes.memmove(d.dst_addr, d.src_addr, d.nbytes)

    def read_packed(self, reads: list[PackedRead]) -> None:
        for r in reads:
            if r.nbytes == 0:
                continue
            # What the source side would put on the wire: the region, packed.
            packed = np.ascontiguousarray(
                _strided_bytes(r.src_addr, r.shape, r.src_strides, r.elsize)
            )
            if r.dst_strides is None:
                ctypes.memmove(r.dst_addr, packed.ctypes.data, r.nbytes)
            else:
                _strided_bytes(r.dst_addr, r.shape, r.dst_strides, r.elsize)[...] = packed
