"""Moving bytes between mapped regions of one host.

A daemon's same-host reads (from itself, or from a peer daemon proven to share this
host's memory) are the ``shm`` transport's (:mod:`transports.samehost`), which ends
each validated batch in a :class:`Copier`: by default the transport's parallel C
memcpy (:func:`transports.local.copy_addresses`, GIL released, so the event loop
stays responsive). :func:`pack_strided` gathers a pack spec's strided block.
"""

from __future__ import annotations

import numpy as np

from transports.local import Copier

__all__ = ["Copier", "pack_strided"]


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
    :func:`refitd.daemon.regions.validate_plan`.
    """
    # An integer dtype of the element's size lets numpy copy whole rows with memcpy;
    # an opaque void dtype would be copied element by element (~40x slower).
    if itemsize in (1, 2, 4, 8):
        dtype = np.dtype(f"<u{itemsize}")
        eshape, estrides = shape, tuple(st * itemsize for st in strides)
    else:
        dtype = np.dtype(np.uint8)
        eshape = (*shape, itemsize)
        estrides = (*(st * itemsize for st in strides), 1)
    view = np.ndarray(eshape, dtype=dtype, buffer=src, offset=src_offset, strides=estrides)
    n = view.nbytes
    out = np.ndarray(eshape, dtype=dtype, buffer=dst, offset=dst_offset)
    np.copyto(out, view)
    return n
