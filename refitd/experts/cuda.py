"""Expert slots in GPU memory: the CUDA ``SlotDevice``.

The slots are one ``uint8`` tensor per bank on the GPU, ``[slots, row_bytes]``; a
caller reads slot ``s`` of bank ``b`` as ``bank(b)[s]`` viewed in the model's dtype.
Every copy runs on a dedicated copy stream, so it overlaps compute on the caller's
stream:

- ``write_slot`` issues one ``cudaMemcpyAsync`` (``Tensor.copy_(non_blocking=True)``)
  per row. Host rows should be page-locked (``pin_memory`` or ``cudaHostRegister``):
  a pageable row would make that copy silently synchronous (the driver stages it and
  the host waits), so one is first copied into page-locked memory of PyTorch's
  caching host allocator, and counted (:attr:`CudaSlotMemory.pageable_rows`);
- ``flush`` records an event after a synchronous plan's copies and waits for it, so
  the executor marks slots occupied only once their bytes have landed;
- ``write_slots_async`` (a prefetch) records an event per plan and returns it as the
  plan's ``CopyFence``: ``done`` is the event query, ``wait`` the event synchronise.
  ``ExpertSlots`` waits on that fence before a step may read any of the plan's slots.

Two orderings make slot reuse safe. Before a plan's copies are issued, the copy
stream waits for the work queued so far on every stream that reads slots: the
calling thread's current stream, and each stream declared with
:meth:`CudaSlotMemory.read_on` (a model reading slots on a side stream must declare
it), so a copy never overwrites a slot an earlier kernel still reads. After them, nothing reads the new
bytes before their fence: the executor only hands out a slot once ``flush`` returned
or the fence completed.

A copy CUDA refuses or reports failed (at issue, or when its event is synchronised)
raises ``SlotDeviceError``; the executor then forgets exactly the plan's slots.

Requires a CUDA build of torch and a visible GPU; importing this module does not.
NOTE: written without a GPU; its tests (``tests/gpu/test_offload_gpu.py``) have not
run on one yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refitd.errors import ConfigError
from refitd.experts.device import Bytes, SlotDevice, SlotGeometry
from refitd.experts.faults import SlotDeviceError
from refitd.experts.inflight import CopyFence
from refitd.experts.residency import CopyRoute

__all__ = ["CudaFence", "CudaSlotMemory", "cuda_available"]


def cuda_available() -> bool:
    """Whether this torch build sees a CUDA device."""
    return torch.cuda.is_available()


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _fired(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


def _host_tensor(src: Bytes) -> torch.Tensor:
    """A ``uint8`` tensor over ``src``'s memory, no copy (the copy engine reads the
    host row itself, so a page-locked row stays page-locked)."""
    view = src if isinstance(src, memoryview) else memoryview(src)
    if view.readonly:
        # torch.frombuffer needs a writable buffer; a read-only row is copied once.
        return torch.tensor(bytearray(view), dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


class CudaFence(CopyFence):
    """One plan's copies on the copy stream, complete when ``event`` has fired.
    ``sources`` keeps the host rows' wrappers alive until then."""

    def __init__(
        self,
        event: torch.cuda.Event,
        sources: list[torch.Tensor],
        error: SlotDeviceError | None = None,
    ) -> None:
        self._event = event
        self._sources: list[torch.Tensor] | None = sources
        self._error = error

    def done(self) -> bool:
        try:
            finished = _fired(self._event)
        except RuntimeError:
            return True  # failed: ``wait`` raises it
        if finished:
            self._sources = None
        return finished

    def wait(self) -> None:
        try:
            self._event.synchronize()
        except RuntimeError as e:
            raise SlotDeviceError(f"an asynchronous slot copy failed on the GPU: {e}") from e
        finally:
            self._sources = None
        if self._error is not None:
            raise self._error


class CudaSlotMemory(SlotDevice):
    """A pool of expert slots in GPU memory, filled on a dedicated copy stream.

    ``device`` is the GPU (default: the current one). ``copy_seconds()`` is the GPU
    time the copy stream spent on slot copies, measured with timing events.
    """

    def __init__(self, geometry: SlotGeometry, device: torch.device | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("CudaSlotMemory needs a CUDA build of torch and a visible GPU")
        dev = torch.device(device if device is not None else "cuda")
        if dev.type != "cuda":
            raise ConfigError(f"CudaSlotMemory places slots on a GPU, not on {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.geometry = geometry
        self._row_bytes = geometry.row_bytes
        self._banks = [
            torch.empty((geometry.slots, w), dtype=torch.uint8, device=dev)
            for w in geometry.row_bytes
        ]
        self._stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
        #: streams other than the current one that read slots (see :meth:`read_on`)
        self._readers: list[torch.cuda.Stream] = []
        #: host rows that were pageable, copied into page-locked memory first
        self.pageable_rows = 0
        self._plan_sources: list[torch.Tensor] = []
        self._plan_start: torch.cuda.Event | None = None
        # (start, end, asynchronous) per plan, until read; then summed into _seconds.
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self._seconds = [0.0, 0.0]  # [synchronous plans, asynchronous plans]

    # -- what the model reads ---------------------------------------------------

    def bank(self, bank: int) -> torch.Tensor:
        """Bank ``bank``'s slots, ``[slots, row_bytes]`` ``uint8`` on the GPU."""
        return self._banks[bank]

    def read_on(self, stream: torch.cuda.Stream) -> None:
        """Declare that kernels on ``stream`` (not the calling thread's current one)
        read slots: every later plan's copies wait for the work queued on it, as they
        wait for the current stream's."""
        if all(stream != s for s in self._readers):
            self._readers.append(stream)

    def copy_seconds(self) -> float:
        """GPU seconds the copy stream spent on slot copies (completed plans)."""
        self._collect()
        return self._seconds[0] + self._seconds[1]

    def prefetch_copy_seconds(self) -> float:
        """Of which asynchronous (prefetch) plans."""
        self._collect()
        return self._seconds[1]

    def _collect(self) -> None:
        keep: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        for start, end, asynchronous in self._timings:
            if _fired(end):
                self._seconds[asynchronous] += start.elapsed_time(end) / 1000.0
            else:
                keep.append((start, end, asynchronous))
        self._timings = keep

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""
        try:
            self._stream.synchronize()
        except RuntimeError as e:
            raise SlotDeviceError(f"the slot copy stream failed: {e}") from e

    # -- SlotDevice ----------------------------------------------------------------

    def begin_plan(self, route: CopyRoute) -> None:
        # Nothing is captured into a graph, so every route, pageable whole layers
        # included, is a plain (if slower) copy. What matters is order: the copies
        # must not overwrite a slot that kernels queued before them still read.
        self._order_after_compute()

    def write_slot(self, bank: int, dst_slot: int, src: Bytes) -> None:
        host = _host_tensor(src)
        if host.numel() != self._row_bytes[bank]:
            raise SlotDeviceError(
                f"bank {bank} row is {host.numel()} bytes, not {self._row_bytes[bank]}"
            )
        try:
            if not host.is_pinned():
                # A pageable source makes the "non-blocking" copy synchronous; the
                # caching host allocator's page-locked block is kept until the copy
                # stream's event says the copy ran.
                host = host.pin_memory()
                self.pageable_rows += 1
            with torch.cuda.stream(self._stream):
                self._banks[bank][dst_slot].copy_(host, non_blocking=True)
        except RuntimeError as e:
            raise SlotDeviceError(f"the GPU refused a copy into slot {dst_slot}: {e}") from e
        self._plan_sources.append(host)

    def copy_slot(self, bank: int, dst_slot: int, src_slot: int) -> None:
        b = self._banks[bank]
        try:
            with torch.cuda.stream(self._stream):
                b[dst_slot].copy_(b[src_slot], non_blocking=True)
        except RuntimeError as e:
            raise SlotDeviceError(f"the GPU refused a slot-to-slot copy: {e}") from e

    def flush(self) -> None:
        """Wait for the plan's copies: the executor names the slots occupied next."""
        end = self._record_end(asynchronous=False)
        try:
            end.synchronize()
        except RuntimeError as e:
            raise SlotDeviceError(f"a slot copy failed on the GPU: {e}") from e
        finally:
            self._plan_sources = []

    def write_slots_async(self, writes: Sequence[tuple[int, int, Bytes]]) -> CopyFence:
        """Issue a prefetch plan on the copy stream; its fence is an event after it.
        A copy refused after others were issued fails the fence (those others may
        still land, so the whole plan is unknown), as the interface asks."""
        error: SlotDeviceError | None = None
        for i, (bank, slot, src) in enumerate(writes):
            try:
                self.write_slot(bank, slot, src)
            except SlotDeviceError as e:
                if i == 0:
                    self._plan_sources = []
                    raise
                error = e
                break
        sources, self._plan_sources = self._plan_sources, []
        return CudaFence(self._record_end(asynchronous=True), sources, error)

    # -- ordering ----------------------------------------------------------------

    def _order_after_compute(self) -> None:
        try:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            for reader in self._readers:
                self._stream.wait_stream(reader)
            start = _event()
            start.record(self._stream)
        except RuntimeError as e:
            raise SlotDeviceError(f"could not order slot copies after compute: {e}") from e
        self._plan_start = start

    def _record_end(self, *, asynchronous: bool) -> torch.cuda.Event:
        end = _event()
        try:
            end.record(self._stream)
        except RuntimeError as e:
            raise SlotDeviceError(f"could not record a slot copy fence: {e}") from e
        if self._plan_start is not None:
            self._timings.append((self._plan_start, end, asynchronous))
            self._plan_start = None
        return end
