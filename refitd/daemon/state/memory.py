"""The daemon's handle on region memory, by kind: the one place a request's kind becomes memory.

A region is one of two kinds of memory (`refitd.memory_kinds`, `transports.memory`):
a shared-memory segment (``host``, from ``transports.segments``: the transports
layer owns naming, permissions and crash cleanup) or a GPU allocation (``cuda``,
opened from its owner's CUDA IPC handle by ``transports.cuda``, imported only
here and only when such a region is attached: a daemon without one never loads a
CUDA library or makes a CUDA context). Everything after this module reads the
memory's kind, identity, owner proof and engine, never the request's.
"""

from __future__ import annotations

import asyncio
import os

from refitd.errors import InsufficientStorage, PlanError, ProtocolError
from refitd.memory_kinds import MemoryKind
from transports.interface import MappedMemory
from transports.segments import SHM_DIR, SharedSegment

__all__ = [
    "SharedSegment",
    "attach_memory",
    "byte_view",
    "check_shm_capacity",
    "free_shm_bytes",
    "map_whole",
    "proves_owner",
    "refuse_created_gpu_memory",
    "refuse_sparse",
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


def byte_view(memory: MappedMemory) -> memoryview:
    """A writable ``memoryview`` of the region's exact ``size`` bytes: host memory
    only (an expert pool's rows and slots, a staging region are host segments)."""
    if not isinstance(memory, SharedSegment):
        raise PlanError(
            f"region memory {memory.name} refused here: it is {memory.kind} memory, and "
            "this use needs host memory the daemon's CPU can address"
        )
    return memory.numpy().data


def cuda_missing() -> str | None:
    """Why this host cannot open GPU memory (None: it can). Loads the CUDA driver
    library, never makes a context."""
    from transports.cuda import missing

    return missing()


def refuse_created_gpu_memory() -> None:
    """Always raises: the daemon allocates no GPU memory of its own. A client
    registers its own allocation (``attach``), so every GPU byte is a client's."""
    why = cuda_missing()
    if why is not None:
        raise PlanError(
            f"cuda region refused: this daemon's host has no CUDA device ({why}); use kind='host'"
        )
    raise PlanError(
        "cuda region refused: the daemon allocates no GPU memory; register your own "
        "allocation with attach_region (refitd.client.gpu.attach_tensor does it)"
    )


def proves_owner(kind: MemoryKind) -> bool:
    """Whether memory of ``kind`` proves its owner itself (a segment's file has an
    owner uid); a GPU allocation's IPC handle is a bearer capability and proves none,
    so who may register it is decided before it is opened (docs/trust.md)."""
    return kind is MemoryKind.HOST


def attach_memory(kind: MemoryKind, handle: str, nbytes: int) -> MappedMemory:
    """Open the memory a client names: its segment (``host``) or its GPU allocation
    (``cuda``, exactly ``nbytes`` bytes, refused where this host has no CUDA)."""
    if kind is MemoryKind.HOST:
        return SharedSegment.attach(handle, nbytes)
    why = cuda_missing()
    if why is not None:
        raise PlanError(
            f"cuda region refused: this daemon's host has no CUDA device ({why}); use kind='host'"
        )
    from transports.cuda import CudaIpcMemory

    return CudaIpcMemory.open(handle, nbytes)


async def map_whole(memory: MappedMemory, what: str) -> None:
    """Map every page of a client's segment into the daemon now, off the event loop
    (:meth:`SharedSegment.populate`), once when it is attached: the first pull into
    it then takes no page fault, where it took one a page (the writes of the
    creator map its pages only in the creator). GPU memory has nothing to map.
    :class:`InsufficientStorage` (507) when the filesystem cannot back a page of a
    sparse segment: refused now, not a bus error in the middle of a pull."""
    if not isinstance(memory, SharedSegment):
        return
    # Mapping a hole for writing backs it: the daemon, not the client, would make
    # (and its memory cgroup pay for) every byte of a sparse segment, however far
    # past the client's caps. A client's segment is backed whole by its creator
    # (``SharedSegment.create`` does it), so a sparse one is refused before a page
    # is mapped, and one made sparse while it was mapped is refused after.
    refuse_sparse(memory, memory.backed_at_map, what)
    try:
        await asyncio.to_thread(memory.populate)
    except OSError as exc:
        raise InsufficientStorage(f"{what} refused: {exc.strerror or exc}") from None
    now = memory.backed_bytes()
    if now is not None and now > memory.backed_at_map:
        refuse_sparse(memory, memory.backed_at_map, what)


def refuse_sparse(memory: SharedSegment, backed: int, what: str) -> None:
    """Refuse (400) ``memory`` if only ``backed`` of its bytes were backed (a sparse
    file: the daemon would back the rest)."""
    if backed < memory.size:
        raise ProtocolError(
            f"{what} refused: segment {memory.name!r} is sparse ({backed} of its "
            f"{memory.size} bytes backed by memory), and the daemon does not back a "
            "client's memory for it; back every byte when making it (SharedSegment.create "
            "does)"
        )
