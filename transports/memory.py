"""What a region is made of: a memory kind, with its identity, its owner proof and its copies.

A region is registered once, as a whole allocation, and every rule on it is keyed on
the memory behind it. The memory is one of a few *kinds*::

    MappedMemory                            what a transport registers
    ├── kind        a MemoryKind (`refitd.memory_kinds`, the wire's region kind too):
    │               MemoryKind.HOST (a /dev/shm segment mapped here) or a device kind
    │               (CUDA, "cuda": a GPU allocation opened from its owner's IPC handle)
    ├── identity    one memory, one value, however many names or handles reach it:
    │               ("host", st_dev, st_ino); ("cuda", device uuid, base address here)
    ├── owner_uid   the uid the memory itself proves it belongs to (a segment's file
    │               owner), or None where the memory proves nothing (an IPC handle is a
    │               bearer capability: the caller's kernel-named uid must stand in)
    ├── engine      None for host memory (the transport's own guarded memcpy); for a
    │               device kind the :class:`CopyEngine` that moves bytes to and from it
    └── name, size, address, close()

A transport's copy of a batch goes through :func:`copy_by_kind`: reads whose two
regions are host memory take the transport's memcpy (unchanged); any read touching
device memory is handed, batched per engine, to the engine of that memory, which
says which pairs of kinds it moves (:meth:`CopyEngine.moves`). A pair no engine
moves is refused before any byte of the batch moves. An engine's failure (a CUDA
error) is a :class:`DeviceFault`: it fails the batch that met it, never the process.

Device kinds live in their own modules, imported only where such memory is opened
(``transports.cuda``), so a host-only process never loads a device library.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from refitd.errors import TransportError
from refitd.memory_kinds import MemoryKind

from .pins import PINS

__all__ = [
    "CopyEngine",
    "DeviceFault",
    "DeviceMemory",
    "KindRefused",
    "MappedMemory",
    "add_engine",
    "copy_by_kind",
    "engines",
    "forget_host",
    "is_host",
]


class MappedMemory(Protocol):
    """Memory a transport can register: `transports.segments.SharedSegment` (host
    memory) fits, and so does a device allocation (`transports.cuda`).

    ``name`` lets a separate data-plane process map the same memory (host kind);
    ``address`` is the base address in *this* process; ``size`` is in bytes. ``kind``,
    ``identity``, ``owner_uid`` and ``engine`` say what the memory is, which one it
    is, whom it proves it belongs to, and what copies it (`transports.memory`).
    """

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def kind(self) -> MemoryKind: ...
    @property
    def identity(self) -> tuple[str | int, ...]: ...
    @property
    def owner_uid(self) -> int | None: ...
    @property
    def engine(self) -> CopyEngine | None: ...
    def close(self) -> None: ...


HostCopy = Callable[
    [npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], Awaitable[None]
]
"""A transport's host memcpy: ``(dst, src, nbytes)`` address arrays, validated."""


class DeviceFault(TransportError):
    """A device's copy engine failed a copy (a CUDA error, named). The batch's
    destination bytes are undefined; the process and every other pull live on.
    ``index`` is the read of the batch handed to the engine that failed (-1: not known)."""

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index


class KindRefused(TransportError):
    """A read between two kinds of memory that no engine of this process moves;
    nothing of the batch was read."""


class CopyEngine(ABC):
    """Moves bytes to and from one device's memory, in batches.

    ``kind`` is the device kind it serves. An engine is made when the first memory
    of its kind is opened in a process (that is when a device context is created)
    and lives as long as the process.
    """

    kind: ClassVar[MemoryKind]

    @abstractmethod
    def moves(self, dst_kind: MemoryKind, src_kind: MemoryKind) -> bool:
        """Whether this engine copies into ``dst_kind`` memory from ``src_kind``."""

    @abstractmethod
    async def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        host: list[MappedMemory],
    ) -> None:
        """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (validated;
        addresses in this process). ``host`` lists the host memories the reads touch,
        so the engine may register them once (page-locked copies). Raises
        :class:`DeviceFault` naming the failed read; returns once every byte landed."""

    def forget_host(self, address: int) -> None:  # noqa: B027 (a no-op by default)
        """The host memory mapped at ``address`` is being unmapped: drop any
        registration of it (an engine that registers host memory overrides this)."""


class DeviceMemory(ABC):
    """One allocation of a device kind, opened in this process: what a device kind's
    module hands a transport to register (it is a `MappedMemory`). ``read`` and
    ``write`` move bytes between it and this process's host memory through its
    engine, synchronously (checks and benchmarks; pulls use :meth:`CopyEngine.copy`)."""

    kind: ClassVar[MemoryKind]

    @property
    @abstractmethod
    def name(self) -> str:
        """A public name of the memory, never a secret that opens it."""

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    @abstractmethod
    def address(self) -> int:
        """Base address of the allocation in this process's (unified) address space."""

    @property
    @abstractmethod
    def identity(self) -> tuple[str | int, ...]: ...

    @property
    @abstractmethod
    def owner_uid(self) -> int | None: ...

    @property
    @abstractmethod
    def engine(self) -> CopyEngine: ...

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes: ...

    @abstractmethod
    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Let go of the allocation here. Idempotent."""


_ENGINES: list[CopyEngine] = []


def engines() -> list[CopyEngine]:
    """The copy engines made in this process (empty where no device memory was opened)."""
    return list(_ENGINES)


def add_engine(engine: CopyEngine) -> None:
    """A device kind's module announces the engine it made (once per device)."""
    _ENGINES.append(engine)


def forget_host(address: int) -> None:
    """The host memory mapped at ``address`` goes away (called before it is
    unmapped): its registration with a device driver is dropped
    (`transports.pins`), and every engine is told."""
    PINS.forget(address)
    for e in _ENGINES:
        with contextlib.suppress(TransportError):
            e.forget_host(address)


def is_host(memory: MappedMemory) -> bool:
    return memory.kind == MemoryKind.HOST


def _region_pairs(
    dst_ids: npt.NDArray[np.int64], src_ids: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.intp]]:
    """The distinct (destination, source) region pairs of a batch's reads, sorted, and
    each read's pair. Region ids are small counters: a pair is one int64 key, so this
    is one sort of integers (``np.unique(axis=0)`` sorts rows as bytes: 1.9 s for
    131,072 reads, on the event loop)."""
    if len(dst_ids) == 0:
        return np.zeros((0, 2), np.int64), np.zeros(0, np.intp)
    lo = int(min(dst_ids.min(), src_ids.min()))
    span = int(src_ids.max()) - lo + 1
    if lo < 0 or (int(dst_ids.max()) + 1) * span >= 1 << 62:
        pairs, inverse = np.unique(
            np.stack([dst_ids, src_ids], axis=1), axis=0, return_inverse=True
        )
        return pairs.astype(np.int64), inverse.reshape(-1)
    keys, inverse = np.unique(dst_ids * span + (src_ids - lo), return_inverse=True)
    pairs = np.stack([keys // span, keys % span + lo], axis=1).astype(np.int64)
    return pairs, inverse.reshape(-1)


async def copy_by_kind(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    src_ids: npt.NDArray[np.int64],
    dst_memory: Mapping[int, MappedMemory],
    src_memory: Mapping[int, MappedMemory],
    host_copy: HostCopy,
) -> None:
    """Copy validated reads (``dst[i]``/``src[i]`` addresses here, ``nbytes[i]`` bytes;
    ``dst_ids``/``src_ids`` their regions, whose memory the two mappings give), each
    through what its pair of kinds supports: host to host by ``host_copy``, the rest
    by the device memory's engine, one batch per engine. Every pair is checked
    before any byte moves (:class:`KindRefused` names the first a no engine moves).
    """
    # The host-only batch (every batch of a host-only daemon) costs two np.unique.
    if all(is_host(dst_memory[d]) for d in np.unique(dst_ids).tolist()) and all(
        is_host(src_memory[s]) for s in np.unique(src_ids).tolist()
    ):
        await host_copy(dst, src, nbytes)
        return
    pairs, inverse = _region_pairs(dst_ids, src_ids)
    route = np.empty(len(pairs), dtype=np.int64)  # per region pair: engine slot, -1 memcpy
    chosen: list[CopyEngine] = []
    for j, (d, s) in enumerate(pairs.tolist()):
        dm, sm = dst_memory[d], src_memory[s]
        if is_host(dm) and is_host(sm):
            route[j] = -1
            continue
        # The destination's engine where it has one (two devices: it reaches the other).
        engine = dm.engine if dm.engine is not None else sm.engine
        if engine is None or not engine.moves(dm.kind, sm.kind):
            raise KindRefused(
                f"read into region {d} ({dm.kind} memory) from region {s} ({sm.kind} "
                f"memory) refused: no copy engine of this process moves {sm.kind} to "
                f"{dm.kind}; nothing of the batch was read"
            )
        if engine not in chosen:
            chosen.append(engine)
        route[j] = chosen.index(engine)
    slot = route[inverse.reshape(-1)]
    if (slot == -1).any():
        k = slot == -1
        await host_copy(dst[k], src[k], nbytes[k])
    for i, engine in enumerate(chosen):
        k = np.flatnonzero(slot == i)
        # Only the host regions this engine's reads touch (each is registered once).
        touched = [dst_memory[int(r)] for r in np.unique(dst_ids[k]).tolist()]
        touched += [src_memory[int(r)] for r in np.unique(src_ids[k]).tolist()]
        hosts = list({id(m): m for m in touched if is_host(m)}.values())
        try:
            await engine.copy(dst[k], src[k], nbytes[k], hosts)
        except DeviceFault as exc:
            at = int(k[exc.index]) if 0 <= exc.index < len(k) else -1
            raise DeviceFault(str(exc), at) from exc
