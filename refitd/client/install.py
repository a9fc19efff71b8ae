"""Landing a finished pull in the engine's parameters, after the copy the daemon made.

Pure of I/O: what :class:`~refitd.client.receiver.DaemonReceiver` does with the bytes
once its pull is DONE (the packed blocks that land strided, the full pulls replayed
through their op chains), which parameters a failed direct pull may have written, and
the one device an engine's parameters must share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from refitd.client.publisher import torch_dtype
from refitd.errors import ConflictError, RefitError
from refitd.wire import PackSpec, PullProgress

if TYPE_CHECKING:
    from refitd.reshard.transfer_plan import FullPull, SourceInfo
    from refitd.wire import MergedManifest

__all__ = [
    "SPAN",
    "CompiledPull",
    "RefitStats",
    "Scatter",
    "install_unpacked",
    "naming_suspects",
    "one_device",
    "overlapping_params",
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
    full_pulls: list[tuple[int, FullPull]]  # (scratch offset, the full pull)
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
    full_pulls: int
    manifest_s: float
    plan_s: float
    pull_s: float
    install_s: float
    total_s: float
    pull: PullProgress


def _to(p: PackSpec, region: int, other: int) -> PackSpec:
    return msgspec.structs.replace(p, dst_region=other) if p.dst_region == region else p


def install_unpacked(
    scatter: Sequence[Scatter],
    full_pulls: Sequence[tuple[int, FullPull]],
    params: Mapping[str, torch.Tensor],
    scratch: npt.NDArray[np.uint8],
) -> None:
    """Scatter the packed blocks that land strided, and replay the full pulls (each
    at its scratch offset), from ``scratch`` into ``params``."""
    from refitd.reshard.replay import replay_ops
    from refitd.reshard.transfer_plan import write_through_pointer

    for at, dt, shape, dst_strides, name, dst_byte in scatter:
        n = math.prod(shape)
        packed = torch.frombuffer(scratch[at : at + n * dt.itemsize].data, dtype=dt).view(shape)
        p = params[name]
        dst = p.data.as_strided(
            shape, dst_strides, p.data.storage_offset() + dst_byte // dt.itemsize
        )
        dst.copy_(packed)
    for at, fp in full_pulls:
        size = fp.staging_nbytes
        full = torch.frombuffer(scratch[at : at + size].data, dtype=torch.uint8)
        full = full.view(fp.dtype).reshape(fp.global_shape)
        for copy in fp.copies:
            write_through_pointer(
                params[copy.param_name].data_ptr(), copy, replay_ops(full, copy.op_chain)
            )


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
