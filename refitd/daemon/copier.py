"""Moving bytes between mapped regions of one host.

A daemon's same-host reads (from itself, or from a peer daemon proven to share this
host's memory) are the ``shm`` transport's (:mod:`transports.shm`), which ends
each validated batch in a :class:`Copier`: by default the transport's parallel C
memcpy (:func:`transports.local.copy_addresses`, GIL released, so the event loop
stays responsive). :func:`pack_strided` gathers a pack spec's strided block.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from refitd.errors import PlanError, TransportError
from transports.local import Copier, CopyFault
from transports.native import copy_lib

__all__ = ["MAX_PACK_DIMS", "Copier", "CopyFault", "pack_strided"]

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
    :func:`refitd.daemon.regions.validate_plan`. The gather is the native one, under
    the bus-error guard: a source segment its owner shrank under the mapping raises
    :class:`~transports.local.CopyFault` (``dst`` undefined), never a fatal signal.
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


def copy_view(dst: memoryview, src: bytes | bytearray | memoryview) -> None:
    """``dst[:] = src`` (same length, bytes) through the guarded native copy: a shared
    segment shrunk under either side raises :class:`~transports.local.CopyFault`
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


_ZEROS = bytes(1 << 20)


def zero_view(dst: memoryview) -> None:
    """Zero ``dst`` through the guarded copy (from a zero buffer, 1 MiB a copy): a
    shared segment shrunk under it raises :class:`~transports.local.CopyFault`."""
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
