"""The daemon's handle on region memory: shared-memory segments from ``transports.segments``.

The transports layer owns naming, permissions (0600, same user) and crash cleanup;
the daemon only creates, attaches and views. CUDA IPC regions are part of the
schema; :func:`refuse_cuda_ipc` says why this host cannot serve them.
"""

from __future__ import annotations

import os

from refitd.errors import PlanError
from transports.segments import SHM_DIR, SharedSegment

__all__ = [
    "SharedSegment",
    "byte_view",
    "check_shm_capacity",
    "free_shm_bytes",
    "refuse_cuda_ipc",
]


def free_shm_bytes() -> int:
    """Bytes the shared-memory filesystem has free now (what a new region may reserve)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_shm_capacity(nbytes: int, what: str) -> None:
    """Refuse (:class:`PlanError`) ``nbytes`` of shared memory that the shared-memory
    filesystem could never hold, before any file exists. (What it holds *now* is the
    reservation's answer: :meth:`SharedSegment.create` backs every byte, so a full
    filesystem is refused there.) ``what`` names the request in the refusal."""
    st = os.statvfs(SHM_DIR)
    capacity = st.f_blocks * st.f_frsize
    if nbytes > capacity:
        raise PlanError(
            f"{what} refused: {nbytes} bytes exceed the {capacity}-byte shared-memory "
            f"filesystem {SHM_DIR}"
        )


def byte_view(seg: SharedSegment) -> memoryview:
    """A writable ``memoryview`` of the segment's exact ``size`` bytes."""
    return seg.numpy().data


def refuse_cuda_ipc() -> None:
    """Always raises: CUDA IPC regions need a GPU and a CUDA build of this daemon."""
    try:
        import torch

        has_gpu = bool(torch.cuda.is_available())
    except ImportError:
        has_gpu = False
    if not has_gpu:
        raise PlanError(
            "cuda_ipc region refused: this daemon's host has no CUDA device; use kind='shm'"
        )
    raise PlanError("cuda_ipc region refused: this daemon build does not map CUDA IPC handles yet")
