"""Shared helpers for the reshard planner tests: publish real shards, reconstruct.

Everything here uses real memory: a published shard is a contiguous clone of a box
of a full tensor and its address is that clone's ``data_ptr()``; reconstruction runs
through the reference transport's real memory moves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from refitd.reshard.reads import InMemoryReadExecutor
from refitd.reshard.replay import replay_ops
from refitd.reshard.slice_plan import Shard
from refitd.reshard.transfer_plan import SourceInfo, TransferPlan, execute_transfer
from refitd.reshard.types import RecordedCopy

Box = tuple[tuple[int, ...], tuple[int, ...]]


def distinct(
    shape: Sequence[int], dtype: torch.dtype = torch.float32, base: int = 1
) -> torch.Tensor:
    """A tensor whose elements are all different (and non-zero), row-major."""
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.int64) + base).to(dtype).reshape(tuple(shape))


@dataclass
class Published:
    """Sources published from real buffers; keeps the buffers alive."""

    sources: dict[str, SourceInfo] = field(default_factory=dict)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def add(
        self,
        name: str,
        full: torch.Tensor,
        boxes: Sequence[Box],
        sessions: Sequence[str] | None = None,
        packed: bool = False,
    ) -> SourceInfo:
        """Publish ``full`` as ``boxes``; ``packed`` puts every shard of one session
        back to back in one buffer (as a trainer's flat parameter buffer does)."""
        el = full.element_size()
        names = (
            list(sessions) if sessions is not None else [f"{name}@{i}" for i in range(len(boxes))]
        )
        pieces = []
        for off, shape in boxes:
            index = tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))
            pieces.append(full[index].contiguous().reshape(-1))
        shards = []
        if packed:
            flat = torch.cat(pieces) if pieces else full.new_zeros(0)
            self.buffers.append(flat)
            pos = 0
            for (off, shape), piece, session in zip(boxes, pieces, names, strict=True):
                shards.append(
                    Shard(tuple(off), tuple(shape), session, flat.data_ptr() + pos * el, el)
                )
                pos += piece.numel()
        else:
            for (off, shape), piece, session in zip(boxes, pieces, names, strict=True):
                buf = piece.clone()
                self.buffers.append(buf)
                shards.append(Shard(tuple(off), tuple(shape), session, buf.data_ptr(), el))
        info = SourceInfo(tuple(full.shape), full.dtype, el, shards)
        self.sources[name] = info
        return info


@pytest.fixture
def published() -> Published:
    return Published()


def dim_blocks(shape: Sequence[int], dim: int, parts: int) -> list[Box]:
    """Even-as-possible blocks of ``shape`` along ``dim``."""
    n = shape[dim]
    cuts = [n * i // parts for i in range(parts + 1)]
    boxes = []
    for a, b in itertools.pairwise(cuts):
        off = [0] * len(shape)
        sh = list(shape)
        off[dim] = a
        sh[dim] = b - a
        boxes.append((tuple(off), tuple(sh)))
    return boxes


def copy_record(
    src: str, chain: Any, param: str, dest: torch.Tensor, dtype: torch.dtype = torch.float32
) -> RecordedCopy:
    """A RecordedCopy as capture would record ``dest.copy_(replay(src, chain))``."""
    return RecordedCopy(
        src,
        tuple(chain),
        param,
        dest.storage_offset(),
        tuple(dest.shape),
        tuple(dest.stride()),
        dtype,
    )


def reconstruct(
    plan: TransferPlan, params: dict[str, torch.Tensor], transport: Any = None
) -> dict[str, Any]:
    """Execute ``plan`` into ``params`` through the reference transport."""
    return execute_transfer(
        plan,
        resolve_param_ptr=lambda name: params[name].data_ptr(),
        transport=transport if transport is not None else InMemoryReadExecutor(),
    )


def eager(full: torch.Tensor, copy: RecordedCopy, param: torch.Tensor) -> None:
    """What the engine's loader does: replay the chain and copy into the view."""
    view = param.as_strided(copy.dest_shape, copy.dest_stride, copy.dest_offset)
    view.copy_(replay_ops(full, copy.op_chain))


class Kit:
    """The helpers above, handed to tests as the ``kit`` fixture."""

    distinct = staticmethod(distinct)
    dim_blocks = staticmethod(dim_blocks)
    copy_record = staticmethod(copy_record)
    reconstruct = staticmethod(reconstruct)
    eager = staticmethod(eager)
    Published = Published


@pytest.fixture
def kit() -> type[Kit]:
    return Kit
