"""The engine's memory: its parameters moved once into regions the local daemon writes.

:class:`EngineMemory` owns what a receiver's pulls land in, host or GPU alike, each
an :class:`Area` (the daemon's region record and a flat ``uint8`` tensor over all of
it):

- the *engine* area: every parameter is a view of it (``p.data = view``). Host
  parameters move into a shared segment; GPU ones into one allocation on their device
  (they never leave it), which the daemon reads and writes through its CUDA IPC
  handle (:mod:`refitd.client.gpu`; never run on a GPU yet);
- the *scratch* area, on the same device: staging mode's *image* of the engine (its
  first bytes, laid out as the engine area), the packed blocks that land strided and
  the full reads' staged tensors;
- swap mode's *shadow* (host memory only): a second engine segment of the same
  layout, which the parameters are rebound to after a pull (:mod:`refitd.client.swap`).

:meth:`EngineMemory.install` lands a finished pull through the one install of host
and GPU memory (:func:`refitd.client.install.install`), the same code on either
device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from refitd.client.http import RefitClient
from refitd.client.install import CompiledPull, copy_ranges, install, one_device
from refitd.client.publisher import ALIGN
from refitd.client.swap import EngineViews
from refitd.errors import TransportError
from refitd.wire import RegionInfo
from transports.segments import SharedSegment

__all__ = ["Area", "EngineMemory", "align"]


def align(n: int) -> int:
    """``n`` bytes rounded up to the alignment of every placed block."""
    return -(-n // ALIGN) * ALIGN


@dataclass
class Area:
    """One region refits write: the daemon's record of it, a flat ``uint8`` tensor
    over all of it (host or GPU memory), and the shared segment under it (host
    memory only)."""

    region: RegionInfo
    flat: torch.Tensor
    seg: SharedSegment | None = None

    def bytes(self) -> npt.NDArray[np.uint8]:
        """Host memory: the area as a writable numpy array."""
        assert self.seg is not None, "a GPU area has no host bytes"
        return self.seg.numpy()

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        """``count`` elements of ``dtype`` at byte ``offset``, sharing the memory."""
        if self.seg is not None:
            return self.seg.torch(dtype, offset, count)
        return self.flat[offset : offset + count * dtype.itemsize].view(dtype)


async def _host_area(local: RefitClient, nbytes: int, label: str) -> Area:
    seg = SharedSegment.create(max(nbytes, 1), label)
    region = await local.attach_region(seg.name, seg.size, label=label)
    return Area(region, seg.torch(torch.uint8), seg)


async def _device_area(local: RefitClient, nbytes: int, device: torch.device, label: str) -> Area:
    from refitd.client.gpu import device_buffer

    flat, region = await device_buffer(local, nbytes, device, label=label)
    return Area(region, flat)


class EngineMemory:
    """The memory a receiver's pulls land in (module docstring): ``params`` (the
    engine's, by name) are moved into it by :meth:`place`, each at its byte offset
    of :attr:`offsets`."""

    def __init__(self, local: RefitClient, params: dict[str, torch.nn.Parameter]) -> None:
        self.local = local
        self.params = params
        self.offsets: dict[str, int] = {}
        self.device = torch.device("cpu")  # the parameters' one device, once placed
        self.engine: Area | None = None
        self.scratch: Area | None = None
        #: swap mode: the second copy of the engine area, and both copies' views
        self.shadow: Area | None = None
        self.views: EngineViews | None = None
        self.serving = 0  # which of the views' copies the parameters read

    @property
    def on_device(self) -> bool:
        """Whether the parameters are in device memory (placed, not in a shared
        segment): a GPU's, where no swap or delta goes."""
        return self.engine is not None and self.engine.seg is None

    async def place(self, swap: bool) -> bool:
        """Move every parameter into one region the local daemon writes, once (a
        shared segment for host parameters, one allocation on their device for GPU
        ones); ``swap`` (host memory only) adds the shadow. Returns whether the
        engine swaps: GPU parameters never do (a CUDA graph holds their addresses).
        Parameters on two devices are refused before anything is registered."""
        if self.engine is not None:
            return self.shadow is not None
        at = 0
        offsets: dict[str, int] = {}
        for name, p in self.params.items():
            offsets[name] = at
            at = align(at + p.numel() * p.element_size())
        self.offsets = offsets
        device = self.device = one_device(self.params)
        self.engine = await self.allocate(at, "engine")
        for name, p in self.params.items():
            n = p.numel()
            if n:
                view = self.engine.view(p.dtype, offsets[name], n).view(p.shape)
                view.copy_(p.data)
                p.data = view
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if self.on_device:
            return False
        if swap:
            self.shadow = await self.allocate(self.engine.flat.numel(), "shadow")
            self.shadow.bytes()[:] = self.engine.bytes()
            assert self.engine.seg is not None and self.shadow.seg is not None
            self.views = EngineViews(self.params, offsets, (self.engine.seg, self.shadow.seg))
        return swap

    def fits(self, nbytes: int) -> bool:
        """Whether the scratch area placed holds ``nbytes``."""
        return self.scratch is not None and self.scratch.region.nbytes >= nbytes

    async def new_scratch(self, nbytes: int) -> RegionInfo:
        """A scratch area of ``nbytes`` on the engine's device, replacing the one
        placed (its region deleted first)."""
        assert self.engine is not None
        old, self.scratch = self.scratch, None
        if old is not None:
            await self.local.delete_region(old.region.region_id)
            if old.seg is not None:
                old.flat = old.flat[:0].clone()  # no view left: the segment unmaps now
                old.seg.close()
        self.scratch = await self.allocate(nbytes, "scratch")
        return self.scratch.region

    async def allocate(self, nbytes: int, label: str) -> Area:
        """``nbytes`` of memory on the parameters' device, registered with the local
        daemon: a shared segment for host memory, one allocation on a GPU
        (:func:`refitd.client.gpu.device_buffer`)."""
        if self.device.type == "cpu":
            return await _host_area(self.local, nbytes, label)
        return await _device_area(self.local, nbytes, self.device, label)

    def swap(self) -> int:
        """Swap mode: the parameters read the other copy, now the engine area; the one
        they read until now is the next pull's shadow. Returns the engine region."""
        assert self.views is not None and self.engine is not None and self.shadow is not None
        self.serving = 1 - self.serving
        self.views.bind(self.serving)
        self.engine, self.shadow = self.shadow, self.engine
        return self.engine.region.region_id

    def install(self, comp: CompiledPull, *, swap: bool, hold: bool) -> None:
        """Land what the pull wrote into the parameters (:func:`install`). Swap mode:
        the bytes it did not pull carried over into the shadow, then the copies
        swapped (swapped back if landing the rest fails); with ``hold`` the rest
        lands in the inactive copy and nothing swaps (``stage()``)."""
        assert self.engine is not None
        scratch = self.scratch.flat if self.scratch is not None else None
        if not swap:
            install(comp, self.params, self.engine.flat, scratch)
            return
        assert self.shadow is not None and self.views is not None
        copy_ranges(self.shadow.flat, self.engine.flat, comp.keep)
        if hold:
            inactive = self.views.views[1 - self.serving]  # the shadow's views
            install(comp, inactive, self.shadow.flat, scratch)
            return
        comp.retarget(self.swap())
        try:
            install(comp, self.params, self.engine.flat, scratch)
        except BaseException:
            comp.retarget(self.swap())  # the previous version's copy, untouched: serve it
            raise

    async def close(self) -> None:
        """Delete the regions; the parameters keep their views of the memory (a
        segment's name is unlinked, its mapping left to them; a GPU allocation is
        freed with its last view)."""
        for area in (self.scratch, self.shadow, self.engine):
            if area is None:
                continue
            # A daemon already gone took its record with it.
            with contextlib.suppress(TransportError):
                await self.local.delete_region(area.region.region_id)
            if area.seg is not None:
                area.seg.unlink()
        self.scratch = self.shadow = self.engine = None
