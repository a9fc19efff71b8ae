"""Trainer-side sources: each rank publishes its *local* shards with their global placement.

A source yields :class:`LocalShard` records: a checkpoint name, the rank's block of
that tensor, the block's offset in the full tensor and the full shape. Nothing is
gathered: an FSDP2 rank publishes its ``Shard(0)`` rows, a Megatron-style rank its
TP/EP block, and the engine's receiver plans which bytes of which block its own
loaders read (:mod:`refitd.reshard`).

- :class:`FSDPSource`: an FSDP2 (``fully_shard``) module; ``DTensor`` parameters on
  a 1-D mesh with ``Shard(0)`` (the last shard may be shorter or empty, as
  ``torch.chunk`` splits) or ``Replicate()``; plain tensors are published whole.
- :class:`MegatronSource`: explicit ``(name, local tensor, global offset, global
  shape)`` entries, for TP/EP layouts the caller knows.
- :class:`TensorSource`: a plain ``nn.Module``, a mapping or ``(name, tensor)``
  pairs (including a vLLM ``WeightSource``), for single-rank trainers.

Name conversion from trainer names to checkpoint (Hugging Face) names is pluggable:
``name_map`` is a mapping, or a callable returning the new name or ``None`` to
leave a tensor out.

:class:`ShardPublisher` publishes a source as one publisher part, reusing its
shared memory every round. Blocks are copied once per round into that memory
(a local copy of the rank's own bytes, no collective); with ``adopt=True`` the
tensors a source owns (plain parameters, Megatron entries) are moved into it once,
so later rounds publish with no copy at all, and contiguous GPU blocks are published
where they are (:meth:`~refitd.client.publisher.Publisher.place`; never run on a GPU
yet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from refitd.client.http import RefitClient
from refitd.client.publisher import ALIGN, Publisher
from refitd.errors import PlanError
from refitd.wire import VersionInfo

__all__ = [
    "FSDPSource",
    "LocalShard",
    "MegatronSource",
    "NameMap",
    "ShardPublisher",
    "ShardSource",
    "TensorSource",
    "as_shard_source",
    "reserve_bytes",
]

NameMap = Mapping[str, str] | Callable[[str], str | None] | None
"""Trainer name -> checkpoint name (``None`` from a callable: not published)."""


def _mapped(name_map: NameMap, name: str) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


@dataclass(frozen=True)
class LocalShard:
    """One rank's block of one checkpoint tensor.

    ``owner`` is the tensor whose storage the block is, when the source may move
    it (``ShardPublisher(adopt=True)``); ``adopt``, when set, moves it instead (an
    FSDP2 shard, whose storage FSDP also holds). Neither: the block is copied
    every round.
    """

    name: str
    tensor: torch.Tensor
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    owner: torch.Tensor | None = None
    adopt: Callable[[torch.Tensor], bool] | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class ShardSource(Protocol):
    """Anything that lists a rank's local shards (a fresh pass each call)."""

    def shards(self) -> Iterable[LocalShard]: ...


def reserve_bytes(shards: Iterable[LocalShard]) -> int:
    """Bytes a :class:`~refitd.client.publisher.Publisher` must reserve to place
    ``shards``: each block starts on a 64-byte boundary."""
    return sum(-(-s.nbytes // ALIGN) * ALIGN for s in shards) or ALIGN


class FSDPSource:
    """The local shards of an FSDP2 module, as the rank holds them.

    A ``DTensor`` with ``Shard(0)`` on a 1-D mesh is published as rows
    ``[r * ceil(n / w), ...)`` of the full tensor, where ``r`` is the rank in the
    mesh and ``w`` its size (``torch.chunk``'s split, FSDP2's): the last rank's
    block may be shorter, or empty and skipped. ``Replicate()`` and plain tensors
    are published whole by every rank (replicas; a receiver reads one). Any other
    placement is refused with :class:`~refitd.errors.PlanError` naming it.

    With ``ShardPublisher(adopt=True)`` an evenly sharded parameter's storage
    moves into the published memory once (FSDP2's all-gather input and the
    ``DTensor``'s local tensor both point there, so training writes the published
    bytes); a shard FSDP pads (the short last one) is copied every round instead.
    """

    def __init__(self, module: torch.nn.Module, name_map: NameMap = None) -> None:
        self.module = module
        self.name_map = name_map

    def _fsdp_params(self) -> dict[int, Any]:
        """FSDP2's record (``FSDPParam``) of each sharded parameter, by id."""
        out: dict[int, Any] = {}
        for m in self.module.modules():
            get = getattr(m, "_get_fsdp_state", None)
            state = get() if callable(get) else None
            for group in getattr(state, "_fsdp_param_groups", None) or []:
                for fp in group.fsdp_params:
                    out[id(fp.sharded_param)] = fp
        return out

    def shards(self) -> Iterator[LocalShard]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        records = self._fsdp_params()
        for trainer_name, p in self.module.named_parameters():
            name = _mapped(self.name_map, trainer_name)
            if name is None:
                continue
            shape = tuple(int(n) for n in p.shape)
            zero = (0,) * len(shape)
            if not isinstance(p, DTensor):
                yield LocalShard(name, p.detach(), zero, shape, p)
                continue
            local = p.to_local().detach()
            placements = tuple(p.placements)
            if p.device_mesh.ndim != 1 or len(placements) != 1:
                raise PlanError(
                    f"{trainer_name!r}: DTensor on a {p.device_mesh.ndim}-D mesh with "
                    f"{placements}; FSDPSource publishes 1-D Shard(0) or Replicate()"
                )
            (placement,) = placements
            if isinstance(placement, Replicate):
                yield LocalShard(name, local, zero, shape)
                continue
            if not isinstance(placement, Shard) or placement.dim != 0:
                raise PlanError(
                    f"{trainer_name!r}: placement {placement} is not Shard(0) or Replicate()"
                )
            world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
            chunk = -(-shape[0] // world)
            start = min(rank * chunk, shape[0])
            rows = max(0, min(chunk, shape[0] - start))
            if tuple(local.shape) != (rows, *shape[1:]):
                raise PlanError(
                    f"{trainer_name!r}: rank {rank} of {world} holds {tuple(local.shape)}, "
                    f"expected rows {start}..{start + rows} of {shape}"
                )
            if rows:
                adopt = _fsdp_adopter(records[id(p)], p) if id(p) in records else None
                yield LocalShard(name, local, (start, *zero[1:]), shape, None, adopt)


def _fsdp_adopter(record: Any, param: Any) -> Callable[[torch.Tensor], bool]:
    """Point FSDP2's storage of ``param`` at ``view`` (same bytes already copied in):
    its all-gather input and the ``DTensor``'s local tensor. Only for a shard FSDP
    does not pad, whose padded size is its own size; returns whether it moved."""

    def adopt(view: torch.Tensor) -> bool:
        if tuple(record.padded_sharded_param_size) != tuple(view.shape) or getattr(
            record, "offload_to_cpu", False
        ):
            return False
        record._sharded_param_data = view.view(-1)
        param._local_tensor = view
        return True

    return adopt


class MegatronSource:
    """Explicit blocks: ``(name, local tensor, global offset, global shape)`` per
    entry, e.g. a TP rank's column block or an EP rank's experts. ``entries`` may
    be a callable returning them (called each round)."""

    def __init__(
        self,
        entries: Iterable[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]
        | Callable[[], Iterable[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]],
        name_map: NameMap = None,
    ) -> None:
        self.entries = entries
        self.name_map = name_map

    def shards(self) -> Iterator[LocalShard]:
        entries = self.entries() if callable(self.entries) else self.entries
        for trainer_name, local, offset, global_shape in entries:
            name = _mapped(self.name_map, trainer_name)
            if name is None:
                continue
            offset, global_shape = tuple(offset), tuple(global_shape)
            if (
                len(offset) != local.dim()
                or len(global_shape) != local.dim()
                or any(o < 0 or o + n > g for o, n, g in zip(offset, local.shape, global_shape))
            ):
                raise PlanError(
                    f"{trainer_name!r}: block {tuple(local.shape)} at {offset} does not fit "
                    f"in {global_shape}"
                )
            yield LocalShard(name, local.detach(), offset, global_shape, local)


class TensorSource:
    """Whole tensors of a single-rank trainer: a module's parameters, a mapping,
    ``(name, tensor)`` pairs, or anything iterable as such (a vLLM ``WeightSource``)."""

    def __init__(self, tensors: Any, name_map: NameMap = None) -> None:
        self.tensors = tensors
        self.name_map = name_map

    def shards(self) -> Iterator[LocalShard]:
        t = self.tensors
        pairs = (
            t.named_parameters()
            if isinstance(t, torch.nn.Module)
            else t.items()
            if isinstance(t, Mapping)
            else iter(t)
        )
        for trainer_name, value in pairs:
            name = _mapped(self.name_map, trainer_name)
            if name is None:
                continue
            shape = tuple(int(n) for n in value.shape)
            yield LocalShard(name, value.detach(), (0,) * len(shape), shape, value)


def as_shard_source(source: Any, name_map: NameMap = None) -> ShardSource:
    """``source`` if it already lists shards, else a :class:`TensorSource` of it
    (an FSDP2 module becomes an :class:`FSDPSource`)."""
    if hasattr(source, "shards"):
        return source  # type: ignore[no-any-return]
    if isinstance(source, torch.nn.Module):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in source.parameters()):
            return FSDPSource(source, name_map)
    return TensorSource(source, name_map)


class ShardPublisher:
    """Publishes a source's shards as part ``part`` of ``expected_parts`` of ``model``.

    The first round reserves exactly the memory the shards need; later rounds
    with the same layout (names, shapes, offsets) rewrite that memory in place,
    after :meth:`~refitd.client.publisher.Publisher.wait_drain` of the previous
    version, so the manifest's placement is unchanged and a receiver replays its
    compiled plan. A new layout publishes from fresh memory (the receiver replans).

    ``buffers=2`` double-buffers: rounds alternate between two sets of regions, and a
    round drains only the version its buffer held two rounds before, so the version
    just before stays intact for a daemon with delta refit on to compare the next
    one with (docs/delta.md). Not with ``adopt`` (training writes one memory).
    """

    def __init__(
        self,
        client: RefitClient,
        model: str,
        part: int = 0,
        expected_parts: int = 1,
        *,
        adopt: bool = False,
        drain_timeout_s: float = 60.0,
        buffers: int = 1,
    ) -> None:
        if buffers not in (1, 2) or (adopt and buffers != 1):
            raise ValueError(f"buffers must be 1 or 2 (1 with adopt), not {buffers}")
        self.client = client
        self.model = model
        self.part = part
        self.expected_parts = expected_parts
        self.adopt = adopt
        self.drain_timeout_s = drain_timeout_s
        self.publisher: Publisher | None = None
        self.version: int | None = None
        self._layout: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]] = []
        self.copied_bytes = 0  # bytes copied into shared memory by the last round
        #: with ``buffers=2``: the other buffer's (publisher, version, layout)
        self._other: tuple[Publisher | None, int | None, list[Any]] = (None, None, [])
        self.buffers = buffers

    async def publish(self, source: ShardSource, version: int) -> VersionInfo:
        shards = list(source.shards())
        layout = [(s.name, s.offset, tuple(s.tensor.shape), s.tensor.dtype) for s in shards]
        if self.buffers == 2:  # this round writes the other buffer; the last stays as is
            last = (self.publisher, self.version, self._layout)
            self.publisher, self.version, self._layout = self._other
            self._other = last
        if self.publisher is not None and self.version is not None:
            # The engine may still read the previous version from this memory.
            await self.publisher.wait_drain(self.version, self.drain_timeout_s)
        # With adopt, a contiguous GPU block is published where it is (its allocation
        # registered once, no copy): the trainer already promises to retire() a
        # version before writing its tensors. Without adopt it is copied, as before.
        in_place = {
            id(s)
            for s in shards
            if self.adopt and s.tensor.is_cuda and s.tensor.is_contiguous() and s.tensor.numel()
        }
        if self.publisher is None or layout != self._layout:
            if self.publisher is not None:
                await self.publisher.close()
            self.publisher = Publisher(self.client, self.model, self.part, self.expected_parts)
            host = [s for s in shards if id(s) not in in_place]
            if host or not shards:
                await self.publisher.reserve(reserve_bytes(host), label=f"{self.model}.{self.part}")
            self._layout = layout
        pub = self.publisher
        copied = 0
        for s in shards:
            if id(s) in in_place:
                await pub.place(s.name, s.tensor, s.global_shape, s.offset)
                continue
            view = pub.tensor(
                s.name, s.global_shape, s.tensor.dtype, s.offset, tuple(s.tensor.shape)
            )
            if s.tensor.numel() and view.data_ptr() != s.tensor.data_ptr():
                view.copy_(s.tensor)
                copied += s.nbytes
                if self.adopt and s.adopt is not None:
                    s.adopt(view)
                elif self.adopt and s.owner is not None and s.owner.is_contiguous():
                    s.owner.data = view  # later rounds publish this storage as is
        self.copied_bytes = copied
        info = await pub.publish(version)
        self.version = version
        return info

    async def retire(self) -> None:
        """Retire the last published version and wait until no reader holds it:
        after this the memory may be written (adopted tensors: by training)."""
        if self.publisher is not None and self.version is not None:
            await self.publisher.wait_drain(self.version, self.drain_timeout_s)

    async def close(self) -> None:
        if self._other[0] is not None:
            await self._other[0].close()
            self._other = (None, None, [])
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None
