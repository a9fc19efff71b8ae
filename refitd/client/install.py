"""Landing a finished pull in the engine's parameters, after the copy the daemon made.

Pure of I/O: what :class:`~refitd.client.receiver.DaemonReceiver` does with the bytes
once its pull is DONE (the packed blocks that land strided, the full reads replayed
through their op chains), which parameters a failed direct pull may have written, and
the one device an engine's parameters must share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from refitd.client.publisher import torch_dtype
from refitd.errors import ConflictError, RefitError
from refitd.wire import PackSpec, PullProgress

if TYPE_CHECKING:
    from refitd.reshard.transfer_plan import FullRead, SourceInfo
    from refitd.reshard.types import RecordedCopy
    from refitd.wire import MergedManifest

__all__ = [
    "SPAN",
    "CompiledPull",
    "Landed",
    "RefitStats",
    "Scatter",
    "copy_ranges",
    "install",
    "naming_suspects",
    "one_device",
    "overlapping_params",
    "replay_full_reads",
    "scatter_blocks",
    "sources_of",
]

Scatter = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], str, int]
"""A packed block in scratch that lands strided: (scratch offset, dtype, shape, the
destination's strides in elements, parameter name, byte offset in the parameter)."""


@dataclass
class CompiledPull:
    """A refit's pull, compiled once per manifest placement and replayed after."""

    signature: bytes
    rows: npt.NDArray[np.int64]  # (n, 5): src_region, src_off, dst_region, dst_off, nbytes
    packs: list[PackSpec]
    scatter: list[Scatter]
    full_reads: list[tuple[int, FullRead]]  # (scratch offset, the full read)
    install: list[tuple[int, int]] = field(default_factory=list)  # coalesced (offset, nbytes)
    bytes: int = 0
    engine_id: int = -1  # the engine region the rows and packs name (swap: the serving one)
    keep: list[tuple[int, int]] = field(default_factory=list)  # swap: engine bytes not pulled

    def landing_in(self, region: int) -> tuple[npt.NDArray[np.int64], list[PackSpec]]:
        """The rows and packs with what lands in the engine region landing in
        ``region`` instead (swap mode's shadow); this pull is left as it is."""
        rows = self.rows.copy()
        rows[rows[:, 2] == self.engine_id, 2] = region
        return rows, [_to(p, self.engine_id, region) for p in self.packs]

    def retarget(self, region: int) -> None:
        """What landed in the engine region lands in ``region`` from now on."""
        self.rows, self.packs = self.landing_in(region)
        self.engine_id = region


@dataclass(frozen=True)
class RefitStats:
    """One refit: ``replayed`` when the compiled plan was reused (no planning)."""

    version: int
    replayed: bool
    bytes: int
    descriptors: int
    pack_specs: int
    scattered: int  # pack specs whose bytes land strided, scattered at install
    full_reads: int
    manifest_s: float
    plan_s: float
    pull_s: float
    install_s: float
    total_s: float
    pull: PullProgress


def _to(p: PackSpec, region: int, other: int) -> PackSpec:
    return msgspec.structs.replace(p, dst_region=other) if p.dst_region == region else p


def install(
    comp: Landed,
    params: Mapping[str, torch.Tensor],
    engine: torch.Tensor,
    scratch: torch.Tensor | None,
) -> None:
    """Land a finished pull in ``params``, from host or GPU memory alike (``engine``
    and ``scratch``: flat ``uint8`` tensors over the engine region and the scratch
    one, on the parameters' device; ``scratch`` None: none is placed): the staged
    byte ranges copied into the engine region, the packed blocks that land strided
    scattered, the full reads replayed (:func:`replay_full_reads`). On a GPU the
    copies are done before it returns."""
    scratch = scratch if scratch is not None else engine[:0]
    copy_ranges(engine, scratch, comp.install)
    scatter_blocks(comp.scatter, params, scratch)
    replay_full_reads(comp.full_reads, params, scratch)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def copy_ranges(dst: torch.Tensor, src: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    """``dst[off : off + n] = src[off : off + n]`` for each ``(off, n)`` of ``ranges``
    (bytes: ``dst`` and ``src`` flat ``uint8`` tensors of one layout)."""
    for off, n in ranges:
        dst[off : off + n].copy_(src[off : off + n])


def scatter_blocks(
    scatter: Sequence[Scatter], params: Mapping[str, torch.Tensor], scratch: torch.Tensor
) -> None:
    """Scatter each packed block (contiguous at its scratch offset of ``scratch``, a
    flat ``uint8`` tensor) through its destination strides into its parameter."""
    for at, dt, shape, dst_strides, name, dst_byte in scatter:
        n = math.prod(shape)
        packed = scratch[at : at + n * dt.itemsize].view(dt).view(shape)
        p = params[name]
        dst = p.data.as_strided(
            shape, dst_strides, p.data.storage_offset() + dst_byte // dt.itemsize
        )
        dst.copy_(packed)


def replay_full_reads(
    full_reads: Sequence[tuple[int, FullRead]],
    params: Mapping[str, torch.Tensor],
    scratch: torch.Tensor,
) -> None:
    """Replay each full read (its source tensor staged whole at its scratch offset of
    ``scratch``, a flat ``uint8`` tensor) through each copy's op chain and casts, and
    write it through the copy's destination strides into its parameter: what the
    engine's loader would have written, bit for bit (a dtype conversion is the
    loader's own ``copy_``)."""
    from refitd.reshard.replay import replay_ops

    for at, fr in full_reads:
        full = scratch[at : at + fr.staging_nbytes].view(fr.dtype).reshape(fr.global_shape)
        for copy in fr.copies:
            value = replay_ops(full, copy.op_chain)
            for dtype in copy.casts:  # the loader's .to() casts, in its order
                value = value.to(dtype)
            value = torch.broadcast_to(value, copy.dest_shape)
            if value.numel() == 0:
                continue
            dst = _destination(params[copy.param_name].data, copy)
            if value.dtype != copy.dest_dtype:
                dst.copy_(value)  # the loader's copy_ converts into its parameter's dtype
                continue
            # The same dtype: its bits moved as integers of its size (no float
            # canonicalisation of NaN payloads on the way).
            as_int = _INT_OF_SIZE[copy.dest_dtype.itemsize]
            dst.view(as_int).copy_(value.contiguous().view(as_int))


def _destination(param: torch.Tensor, copy: RecordedCopy) -> torch.Tensor:
    """The strided destination of ``copy`` in ``param``'s memory: elements of
    ``copy.dest_dtype`` counted from the parameter's first byte."""
    size = copy.dest_dtype.itemsize
    start = param.storage_offset() * param.element_size()
    dst = torch.empty(0, dtype=copy.dest_dtype, device=param.device)
    return dst.set_(
        param.untyped_storage(), start // size + copy.dest_offset, copy.dest_shape, copy.dest_stride
    )


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Landed(Protocol):
    """What an install reads of a compiled pull: the coalesced staged byte ranges
    ``(offset, nbytes)``, the strided blocks to scatter and the full reads to replay
    (at their scratch offsets)."""

    @property
    def install(self) -> list[tuple[int, int]]: ...
    @property
    def scatter(self) -> list[Scatter]: ...
    @property
    def full_reads(self) -> list[tuple[int, FullRead]]: ...


def overlapping_params(
    ranges: Sequence[tuple[int, int]],
    params: dict[str, torch.nn.Parameter],
    offsets: dict[str, int],
) -> list[str]:
    """The parameters (at byte ``offsets`` of the engine region) that any of
    ``ranges`` (``(offset, nbytes)`` in that region) overlaps, in order."""
    return [
        name
        for name, off in offsets.items()
        if any(
            o < off + params[name].numel() * params[name].element_size() and off < o + n
            for o, n in ranges
        )
    ]


def one_device(params: dict[str, torch.nn.Parameter]) -> torch.device:
    """The one device every parameter is on (CPU for none); parameters spread over
    devices are refused: one engine region is one allocation on one device."""
    devices = {p.device for p in params.values()}
    if len(devices) > 1:
        raise ConflictError(
            f"engine refused: its parameters are on {len(devices)} devices "
            f"({', '.join(sorted(map(str, devices)))}); refitd refits an engine whose "
            "parameters share one device (one receiver per device)"
        )
    return next(iter(devices), torch.device("cpu"))


def naming_suspects(exc: RefitError, names: Sequence[str]) -> RefitError:
    """``exc`` (a failed direct pull) with the parameters it may have written named
    (``names``; ``exc`` itself when there are none), its progress kept."""
    if not names:
        return exc
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    err = type(exc)(
        f"{exc}; engine parameters now suspect (serve none of them until a refit succeeds): {shown}"
    )
    err.progress = getattr(exc, "progress", None)  # type: ignore[attr-defined]
    return err


SPAN = 1 << 40
"""Synthetic address space per source region: the planner sees region r's byte b as
``r * SPAN + b``, so every planned address splits back into (region, offset)."""


def sources_of(m: MergedManifest) -> dict[str, SourceInfo]:
    """The manifest as the planner's sources: one session per source region, and
    region ``r``'s byte ``b`` at synthetic address ``r * SPAN + b``."""
    from refitd.reshard.slice_plan import Shard
    from refitd.reshard.transfer_plan import SourceInfo

    sources: dict[str, SourceInfo] = {}
    for t in m.tensors:
        dt = torch_dtype(t.dtype)
        shards = [
            Shard(
                tuple(s.offset),
                tuple(s.shape),
                f"r{s.region}",
                s.region * SPAN + s.byte_offset,
                dt.itemsize,
            )
            for s in t.shards
        ]
        sources[t.name] = SourceInfo(tuple(t.shape), dt, dt.itemsize, shards)
    return sources
