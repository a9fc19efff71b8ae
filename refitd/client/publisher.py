"""The trainer side: place tensors in daemon regions and publish versions.

A :class:`Publisher` is one publisher *part* of a model (typically one trainer
rank). It asks its daemon for shared-memory regions, maps them, and records which
block of which full tensor sits where. Tensors can be placed zero-copy (the trainer
writes into :meth:`Publisher.tensor` views directly) or copied in
(:meth:`Publisher.put`); a GPU tensor is published where it is
(:meth:`Publisher.place`: its allocation registered once, no copy; never run on a
GPU yet). :meth:`Publisher.publish` sends the manifest for a version;
before rewriting tensors for a new version on the same memory, call
:meth:`Publisher.wait_drain` so no reader is mid-pull.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import torch

from refitd.client.http import RefitClient
from refitd.errors import PlanError
from refitd.wire import ManifestIn, RegionInfo, ShardEntry, TensorEntry, VersionInfo
from transports.segments import SharedSegment

__all__ = ["Publisher", "dtype_name", "torch_dtype"]

ALIGN = 64
"""Byte alignment of every placed block (cache line; also satisfies every dtype)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the manifest spelling."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PlanError(f"manifest dtype {name!r} is not a torch dtype")
    return dt


@dataclass
class _Region:
    info: RegionInfo
    seg: SharedSegment
    used: int = 0


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: list[ShardEntry] = field(default_factory=list)


class Publisher:
    """Publisher part ``part`` of ``expected_parts`` for ``model`` on one daemon."""

    def __init__(
        self, client: RefitClient, model: str, part: int = 0, expected_parts: int = 1
    ) -> None:
        self.client = client
        self.model = model
        self.part = part
        self.expected_parts = expected_parts
        self._regions: list[_Region] = []
        self._tensors: dict[str, _Tensor] = {}
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        #: GPU allocations registered for :meth:`place`: base address -> (region, size)
        self._gpu: dict[int, tuple[RegionInfo, int]] = {}
        #: devices of the tensors placed, fenced before each publish
        self._gpu_devices: set[int] = set()
        #: the tensors placed, by (name, offset): kept allocated while published
        self._placed: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def reserve(self, nbytes: int, label: str = "") -> RegionInfo:
        """Ask the daemon for a region of ``nbytes`` bytes that later placements fill."""
        info = await self.client.create_region(
            nbytes,
            label=label or f"{self.model}.part{self.part}",
            # With a token the daemon records the token's name as owner and refuses
            # any other (a publisher under a token must still be able to reserve).
            owner="" if self.client.authenticated else f"{self.model}/{self.part}",
        )
        self._regions.append(_Region(info, SharedSegment.attach(info.handle, info.nbytes)))
        return info

    def tensor(
        self,
        name: str,
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        offset: tuple[int, ...] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A zero-copy view, inside a reserved region, for block ``offset``/``shape``
        (elements; the whole tensor by default) of tensor ``name``. Write into it."""
        offset = offset or (0,) * len(global_shape)
        shape = shape or global_shape
        key = (name, offset)
        view = self._views.get(key)
        if view is not None:
            return view
        t = self._tensors.setdefault(name, _Tensor(global_shape, dtype))
        if (t.shape, t.dtype) != (global_shape, dtype):
            raise PlanError(
                f"tensor {name!r} placed as {global_shape} {dtype}, earlier as {t.shape} {t.dtype}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        region = self._fit(nbytes, name)
        at = region.used
        region.used = -(-(at + nbytes) // ALIGN) * ALIGN
        t.shards.append(ShardEntry(offset, shape, region.info.region_id, at))
        count = math.prod(shape)
        view = (
            region.seg.torch(dtype, at, count).view(shape)
            if count
            else torch.empty(shape, dtype=dtype)
        )
        self._views[key] = view
        return view

    def put(
        self,
        name: str,
        value: torch.Tensor,
        global_shape: tuple[int, ...] | None = None,
        offset: tuple[int, ...] | None = None,
    ) -> None:
        """Copy ``value`` in as block ``offset`` of tensor ``name`` (whole tensor by default)."""
        view = self.tensor(
            name, global_shape or tuple(value.shape), value.dtype, offset, tuple(value.shape)
        )
        view.copy_(value)

    async def place(
        self,
        name: str,
        value: torch.Tensor,
        global_shape: tuple[int, ...] | None = None,
        offset: tuple[int, ...] | None = None,
    ) -> None:
        """Publish GPU tensor ``value`` in place as block ``offset`` of tensor ``name``
        (whole tensor by default): no copy. The GPU allocation holding it is
        registered with the daemon once (:func:`refitd.client.gpu.attach_tensor`)
        and every later tensor in it is an offset. Write new values into ``value``
        itself between versions (after :meth:`wait_drain`). Host tensors go through
        :meth:`put`; a non-contiguous tensor is refused (its bytes are not one block)."""
        if value.device.type != "cuda":
            raise PlanError(
                f"tensor {name!r}: place() publishes GPU tensors where they are; "
                f"a {value.device.type} tensor goes through put()"
            )
        if not value.is_contiguous():
            raise PlanError(f"tensor {name!r}: place() needs a contiguous tensor")
        global_shape = global_shape or tuple(value.shape)
        offset = offset or (0,) * len(global_shape)
        t = self._tensors.setdefault(name, _Tensor(global_shape, value.dtype))
        if (t.shape, t.dtype) != (global_shape, value.dtype):
            raise PlanError(
                f"tensor {name!r} placed as {global_shape} {value.dtype}, earlier as "
                f"{t.shape} {t.dtype}"
            )
        region, at = await self._gpu_region(value)
        # Held while published: freed, its block could be handed to another tensor
        # that the daemon's next pull of this name would then write into.
        self._placed[(name, tuple(offset))] = value
        self._gpu_devices.add(value.device.index if value.device.index is not None else 0)
        shard = ShardEntry(offset, tuple(value.shape), region.region_id, at)
        t.shards = [s for s in t.shards if tuple(s.offset) != tuple(offset)] + [shard]

    async def _gpu_region(self, value: torch.Tensor) -> tuple[RegionInfo, int]:
        """The region of the GPU allocation holding ``value`` (registered on first
        use) and ``value``'s byte offset in it."""
        ptr = value.data_ptr()
        for base, (region, size) in self._gpu.items():
            if base <= ptr < base + size:
                return region, ptr - base
        from refitd.client.gpu import attach_tensor

        region, at = await attach_tensor(
            self.client,
            value,
            label=f"{self.model}.part{self.part}.gpu{len(self._gpu)}",
            # as reserve(): under a token the daemon records the token's name
            owner="" if self.client.authenticated else f"{self.model}/{self.part}",
        )
        self._gpu[ptr - at] = (region, region.nbytes)
        return region, at

    def _fit(self, nbytes: int, name: str) -> _Region:
        for r in self._regions:
            if r.info.nbytes - r.used >= nbytes:
                return r
        raise PlanError(
            f"tensor {name!r}: no reserved region has {nbytes} free bytes; call reserve() with "
            "enough room first"
        )

    def manifest(self, version: int) -> ManifestIn:
        tensors = [
            TensorEntry(name, t.shape, dtype_name(t.dtype), list(t.shards))
            for name, t in self._tensors.items()
        ]
        return ManifestIn(self.model, version, self.part, self.expected_parts, tensors)

    async def publish(self, version: int) -> VersionInfo:
        """Publish this part's manifest for ``version``. Refused (ConflictError) while
        the version is leased. Tensors placed on a GPU are fenced first: every kernel
        queued on their devices so far (the optimizer's writes into them) has run
        before the daemon may read them, which it does on streams of its own, in
        another process, ordered after nothing of this one's."""
        if self._gpu_devices:
            await asyncio.to_thread(self._fence_devices)
        return await self.client.publish(self.manifest(version))

    def _fence_devices(self) -> None:
        for ordinal in sorted(self._gpu_devices):
            torch.cuda.synchronize(ordinal)

    async def wait_drain(self, version: int, timeout_s: float = 60.0) -> VersionInfo:
        """Retire ``version`` (no new leases) and wait until no reader holds one
        (released or expired): after this the memory behind it may be rewritten."""
        return await self.client.wait_drain(self.model, version, timeout_s, retire=True)

    async def close(self) -> None:
        """Unmap our views of the regions (the daemon keeps and later frees them)."""
        self._views.clear()
        self._gpu_devices.clear()
        self._placed.clear()
        self._gpu.clear()  # the GPU regions stay with the daemon, as the others do
        for r in self._regions:
            r.seg.close()
        self._regions.clear()
