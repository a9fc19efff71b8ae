"""GPU memory as a client registers it with its node's daemon: once per allocation.

A daemon reads and writes a GPU allocation of this process through its CUDA IPC
handle, opened once (``transports.cuda``; the daemon keeps the mapping until the
region is deleted or this process exits). Two ways to get one:

- :func:`attach_tensor`: the allocation that already holds a tensor (a segment of
  PyTorch's caching allocator, holding many tensors: the tensor is an offset in it);
- :func:`device_buffer`: a fresh allocation refitd makes, exactly ``nbytes`` (what
  the engine side moves its parameters into, see
  :class:`~refitd.client.engine.EngineMemory`; what it lands there goes through the
  one install of host and GPU memory, :func:`refitd.client.install.install`).

The daemon takes a GPU region only over its Unix socket, from this process (its
``process``), or from the unauthenticated loopback of a single-user daemon; never from
a token's tenant (docs/trust.md, "GPU memory"). Nothing here runs on a machine
without a GPU, and this module is imported only where a tensor is on one.

NOTE: never run on a GPU yet (tests/gpu/run-on-device.sh is its first run).
"""

from __future__ import annotations

import torch

from refitd.client.http import RefitClient
from refitd.wire import MemoryKind, RegionInfo

__all__ = ["attach_tensor", "device_buffer", "held_allocations"]

#: storages of the tensors whose allocations are registered, by allocation base: a
#: caching-allocator segment is given back to the driver (``empty_cache``) only once
#: no block of it is live, so holding one keeps the daemon's mapping of it valid
_HELD: dict[int, torch.UntypedStorage] = {}


def held_allocations() -> int:
    """GPU allocations this process registered and keeps allocated for the daemon."""
    return len(_HELD)


async def attach_tensor(
    client: RefitClient, tensor: torch.Tensor, *, label: str = "", owner: str = ""
) -> tuple[RegionInfo, int]:
    """Register the whole GPU allocation holding ``tensor`` with the daemon of
    ``client``; return its region and the tensor's byte offset in it. Call it once
    per allocation: a second registration of the same memory is refused (409).
    The tensor's storage is held for the life of this process, so PyTorch's caching
    allocator never frees the allocation under the daemon (``empty_cache`` releases
    a segment only when no block of it is live), as PyTorch's own CUDA IPC does.
    Memory without an IPC handle (expandable segments, vLLM's sleep-mode pool) is
    refused, named."""
    from transports.cuda import export_allocation

    # The tensor's own device: the driver is asked in its context, pushed and popped.
    exported = export_allocation(tensor.data_ptr(), tensor.device.index)
    info = await client.attach_region(
        exported.handle, exported.size, kind=MemoryKind.CUDA, label=label, owner=owner
    )
    _HELD[exported.base] = tensor.untyped_storage()
    return info, tensor.data_ptr() - exported.base


async def device_buffer(
    client: RefitClient, nbytes: int, device: torch.device, *, label: str = ""
) -> tuple[torch.Tensor, RegionInfo]:
    """``nbytes`` of new GPU memory on ``device`` (a flat ``uint8`` tensor, one whole
    allocation, freed when its last view goes) registered with the daemon of
    ``client`` as one region whose byte 0 is the tensor's."""
    from transports.cuda import DeviceAllocation

    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    allocation = DeviceAllocation(ordinal, max(nbytes, 1))
    flat = torch.as_tensor(allocation, device=torch.device("cuda", ordinal))
    exported = allocation.export()
    info = await client.attach_region(
        exported.handle, exported.size, kind=MemoryKind.CUDA, label=label
    )
    return flat, info
