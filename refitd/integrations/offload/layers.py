"""The model side of offloaded MoE layers: finding a model's MoE blocks, the experts
module that stands in for each (``OffloadedExperts``), and the residency that drives
them all (``ExpertOffload``, built by ``offload_experts``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from refitd.errors import ConfigError
from refitd.experts import (
    DeviceFault,
    DeviceFlushFault,
    EvictionPolicy,
    ExpertCache,
    ExpertSlots,
    SlotGeometry,
)
from refitd.experts.cuda import CudaSlotMemory
from refitd.integrations.offload.memory import DOWN, GATE_UP, HostExpertStore, TorchSlotMemory

__all__ = [
    "ExpertOffload",
    "OffloadStats",
    "OffloadedExperts",
    "Predictor",
    "SlotMemoryFactory",
    "moe_blocks",
    "offload_experts",
]

#: ``predict(layer, hidden_states)``: the experts the MoE layer ``layer`` is expected
#: to route for these hidden states (of the layer before it), most confident first.
Predictor = Callable[[int, torch.Tensor], Sequence[int]]

#: Builds the slot pool for a geometry: ``TorchSlotMemory`` or ``CudaSlotMemory`` (or
#: a subclass of either, for a backend of your own).
SlotMemoryFactory = Callable[[SlotGeometry], "TorchSlotMemory | CudaSlotMemory"]


# -- counters -------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadStats:
    """What the offloaded layers did. Routes are distinct experts per layer step;
    ``copied_bytes`` crossed the host link (prefetches included); seconds are wall
    time on the forward's thread (``demand_s`` copying misses, ``wait_s`` waiting for
    prefetches) except ``copy_s`` and ``prefetch_copy_s``, the device's own copy time
    (all copies, and the asynchronous ones among them)."""

    routes: int
    hits: int
    fetched: int
    cpu: int
    copied_bytes: int
    prefetched_bytes: int
    prefetch_used: int
    prefetch_wasted: int
    demand_s: float
    wait_s: float
    copy_s: float
    prefetch_copy_s: float
    failed_copies: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.routes if self.routes else 0.0

    @property
    def hidden_s(self) -> float:
        """Copy time hidden behind compute: prefetch copying the forward did not wait
        for (demand copies are waited for whole)."""
        return max(0.0, self.prefetch_copy_s - self.wait_s)

    @property
    def hidden_fraction(self) -> float:
        """The share of all copy time hidden behind compute; 0.0 before any copy."""
        return min(1.0, self.hidden_s / self.copy_s) if self.copy_s > 0 else 0.0


# -- the model side --------------------------------------------------------------------


def _experts(block: nn.Module) -> Any:
    """A block's experts module (typed loosely: transformers' classes are not ours)."""
    return getattr(block, "experts", None)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks of ``model`` in layer order: modules with a ``gate`` router and
    an ``experts`` module holding stacked ``gate_up_proj`` and ``down_proj``."""
    found = []
    for module in model.modules():
        experts = _experts(module)
        if isinstance(experts, OffloadedExperts):
            found.append(module)
        elif isinstance(getattr(module, "gate", None), nn.Module) and isinstance(
            getattr(experts, "gate_up_proj", None), torch.Tensor
        ):
            if getattr(experts, "has_bias", False) or experts.gate_up_proj.dim() != 3:
                raise ConfigError(
                    f"{type(experts).__name__}: only unbiased stacked experts "
                    "(gate_up_proj [E, 2I, H], down_proj [E, H, I]) can be offloaded"
                )
            found.append(module)
    return found


class OffloadedExperts(nn.Module):
    """Stands in for one MoE block's experts module: same call, weights from slots."""

    def __init__(self, offload: ExpertOffload, layer: int, act_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.layer = layer
        self.act_fn = act_fn
        # Not a submodule: the offload owns the layers, not the other way round.
        self.__dict__["_offload"] = offload

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        offload: ExpertOffload = self.__dict__["_offload"]
        return offload.experts_forward(
            self.layer, self.act_fn, hidden_states, top_k_index, top_k_weights
        )


def _router_predictor(routers: Sequence[nn.Module], num_experts: int) -> Predictor:
    """Layer ``l``'s router applied to the hidden states of layer ``l - 1``: experts by
    summed routing weight over the tokens, highest first."""

    def predict(layer: int, hidden: torch.Tensor) -> Sequence[int]:
        _, weights, index = routers[layer](hidden)
        scores = torch.zeros(num_experts, dtype=torch.float32, device=hidden.device)
        scores.index_add_(0, index.reshape(-1), weights.reshape(-1).float())
        order = torch.argsort(scores, descending=True, stable=True)
        picked: list[int] = order[: int((scores > 0).sum())].tolist()
        return picked

    return predict


def _default_slot_memory(device: torch.device) -> SlotMemoryFactory:
    if device.type == "cuda":
        return lambda geometry: CudaSlotMemory(geometry, device)
    if device.type != "cpu":
        raise ConfigError(f"no slot memory for {device}: slots go on the CPU or a CUDA GPU")
    return TorchSlotMemory


class ExpertOffload:
    """The expert residency of one model's MoE layers; built by ``offload_experts``.

    ``cache`` and ``slots`` are the planner and executor, ``store`` the host rows,
    ``slot_device`` the slot pool. ``prefetch`` and ``keep`` (``False``: on-demand
    loading with no cache) may be changed between forwards; ``resize`` changes the pool.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        *,
        slots: int,
        device: torch.device,
        policy: EvictionPolicy | None,
        prefetch: bool,
        max_fetch: int | None,
        cache: bool,
        predictor: Predictor | None,
        slot_memory: SlotMemoryFactory | None = None,
        host_buffer: memoryview | bytearray | None = None,
    ) -> None:
        first = _experts(blocks[0])
        num_experts, two_i, hidden = first.gate_up_proj.shape
        shapes = ((two_i, hidden), tuple(first.down_proj.shape[1:]))
        dtype = first.gate_up_proj.dtype
        for layer, block in enumerate(blocks):
            if tuple(_experts(block).gate_up_proj.shape) != (num_experts, *shapes[0]):
                raise ConfigError(f"MoE layer {layer}'s experts differ in shape from layer 0's")
        self.num_layers, self.num_experts = len(blocks), int(num_experts)
        self.device = device
        # Everything that can refuse (pool size, device) before any weight moves, so a
        # refusal leaves the model as it was.
        self.cache = ExpertCache(
            self.num_layers, self.num_experts, slots, policy=policy, max_fetch=max_fetch
        )
        size = torch.tensor([], dtype=dtype).element_size()
        row_bytes = tuple(a * b * size for a, b in shapes)
        self.geometry = SlotGeometry(self.num_layers, slots, row_bytes)
        self.slots = ExpertSlots(self.geometry)
        if slot_memory is None:
            slot_memory = _default_slot_memory(device)
        self._slot_memory = slot_memory
        self.slot_device: TorchSlotMemory | CudaSlotMemory = slot_memory(self.geometry)
        self.store = HostExpertStore(
            self.num_layers,
            self.num_experts,
            shapes,
            dtype,
            pin=device.type == "cuda",
            buffer=host_buffer,
        )
        for layer, block in enumerate(blocks):
            experts = _experts(block)
            for e in range(self.num_experts):
                self.store.write(layer, e, experts.gate_up_proj[e], experts.down_proj[e])
            block.experts = OffloadedExperts(self, layer, experts.act_fn)
        self._bind()
        self._host_weights = (self.store.typed(GATE_UP), self.store.typed(DOWN))
        self._off_device = device.type != "cpu"
        self.prefetch = prefetch and cache
        self.keep = cache
        routers: list[nn.Module] = [block.get_submodule("gate") for block in blocks]
        self.predict = predictor or _router_predictor(routers, self.num_experts)
        self._demand_s = self._wait_s = 0.0
        self._failed = 0

    # -- the forward ----------------------------------------------------------------

    def experts_forward(
        self,
        layer: int,
        act_fn: Callable[..., Any],
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """transformers' eager experts loop, each expert's weights from its slot (or
        its host rows when hybrid mode or a failed copy left it off the device)."""
        n = self.num_experts
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        hit: list[int] = [e for e in expert_hit.reshape(-1).tolist() if e != n]
        where = self._place(layer, hit)
        if self.prefetch and layer + 1 < self.num_layers:
            self._prefetch(layer + 1, hidden_states)
        slot_gate_up, slot_down = self._slot_weights
        host_gate_up, host_down = self._host_weights
        off_device = self._off_device
        for e in hit:
            slot = where[e]
            on_host = slot is None and off_device
            if slot is None:
                gate_up_w, down_w = host_gate_up[layer, e], host_down[layer, e]
            else:
                gate_up_w, down_w = slot_gate_up[slot], slot_down[slot]
            top_k_pos, token_idx = torch.where(expert_mask[e])
            current_state = hidden_states[token_idx]
            if on_host:
                current_state = current_state.cpu()
            gate, up = F.linear(current_state, gate_up_w).chunk(2, dim=-1)
            current_hidden_states = act_fn(gate) * up
            current_hidden_states = F.linear(current_hidden_states, down_w)
            if on_host:
                current_hidden_states = current_hidden_states.to(hidden_states.device)
            current_hidden_states = (
                current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            )
            final_hidden_states.index_add_(
                0, token_idx, current_hidden_states.to(final_hidden_states.dtype)
            )
        if not self.keep:  # on-demand loading with no cache: nothing outlives its step
            self._forget([s for s in where.values() if s is not None])
        return final_hidden_states

    def _bind(self) -> None:
        """Typed views of the slot banks: ``[slots, *shape]`` in the model's dtype."""
        store, dev = self.store, self.slot_device
        self._slot_weights = tuple(
            dev.bank(b).view(store.dtype).view(self.geometry.slots, *store.shapes[b])
            for b in (GATE_UP, DOWN)
        )

    def _place(self, layer: int, routed: list[int]) -> dict[int, int | None]:
        """Make ``routed`` resident (copies, waits); return each expert's slot, or
        ``None`` for one computed from host rows."""
        plan = self.cache.ensure(layer, routed)
        where = dict(zip(routed, plan.slots))
        lost: set[int] = set()
        t0 = time.perf_counter()
        try:
            self.slots.apply_copy_plan(layer, plan.copy, self.store, self.slot_device)
        except DeviceFault as e:
            lost.update(e.suspect)
        except DeviceFlushFault as e:
            lost.update(e.slots)
        t1 = time.perf_counter()
        try:
            self.slots.wait_for(plan.slots)
        except DeviceFlushFault as e:
            lost.update(e.slots)
        self._wait_s += time.perf_counter() - t1
        self._demand_s += t1 - t0
        lost.update(self.slots.poll())
        if lost:
            self._failed += len(lost)
            self._forget(lost)
            where = {e: (None if s in lost else s) for e, s in where.items()}
        return where

    def _prefetch(self, layer: int, hidden_states: torch.Tensor) -> None:
        with torch.no_grad():
            predicted = self.predict(layer, hidden_states)
        pre = self.cache.prefetch(layer, predicted)
        if pre.copy.is_empty():
            return
        try:
            self.slots.prefetch_copy_plan(layer, pre.copy, self.store, self.slot_device)
        except DeviceFlushFault as e:
            self._failed += len(e.slots)
            self._forget(e.slots)

    def _forget(self, slots: Iterable[int]) -> None:
        for s in slots:
            self.cache.forget_slot(s)
            self.slots.invalidate_slot(s)

    def resize(self, slots: int) -> None:
        """Replace the pool with an empty one of ``slots`` slots (counters survive)."""
        self._settle()
        self.cache.rebuild(slots)
        self.slots.resize(slots)
        self.geometry = self.slots.geometry
        old, self.slot_device = self.slot_device, self._slot_memory(self.geometry)
        self._bind()
        close = getattr(old, "close", None)
        if close is not None:
            close()

    # -- refit -------------------------------------------------------------------------

    def write_experts(
        self,
        layer: int,
        experts: Sequence[int],
        gate_up: Sequence[torch.Tensor] | torch.Tensor,
        down: Sequence[torch.Tensor] | torch.Tensor,
    ) -> int:
        """Rewrite experts' host rows (a refit) and drop every slot holding, or about
        to hold, their old bytes. Returns the slots dropped."""
        self._settle()
        for i, e in enumerate(experts):
            self.store.write(layer, e, gate_up[i], down[i])
        return self.invalidate([(layer, e) for e in experts])

    def invalidate(self, experts: Sequence[tuple[int, int]]) -> int:
        """Drop the slots of ``(layer, expert)`` pairs whose host rows were rewritten
        by someone else (e.g. a refitd pull into the rows); returns the slots dropped."""
        self._settle()
        stale = [s for layer, e in experts if (s := self.cache.slot_of(layer, e)) is not None]
        self._forget(stale)
        return len(stale)

    def _settle(self) -> None:
        """Let every copy in flight land, so none reads a row being rewritten."""
        try:
            self.slots.wait_for(self.slots.in_flight_slots())
        except DeviceFlushFault as e:
            self._forget(e.slots)
        self._forget(self.slots.poll())

    # -- reporting and lifecycle ------------------------------------------------------

    def stats(self) -> OffloadStats:
        c, s = self.cache.stats(), self.slots.stats()
        return OffloadStats(
            routes=c.routes,
            hits=c.hits,
            fetched=c.fetched,
            cpu=c.cpu,
            copied_bytes=s.host_bytes,
            prefetched_bytes=s.prefetch_bytes,
            prefetch_used=c.prefetch_used,
            prefetch_wasted=c.prefetch_wasted,
            demand_s=self._demand_s,
            wait_s=self._wait_s,
            copy_s=self.slot_device.copy_seconds(),
            prefetch_copy_s=self.slot_device.prefetch_copy_seconds(),
            failed_copies=self._failed,
        )

    def reset_stats(self) -> None:
        self._settle()
        self.cache.reset_stats()
        self.slots.reset_stats()
        self._demand_s = self._wait_s = 0.0
        self._failed = 0

    def close(self) -> None:
        """Wait for copies in flight and stop the copier thread (CPU slots)."""
        self._settle()
        close = getattr(self.slot_device, "close", None)
        if close is not None:
            close()
        self.store.close()


def offload_experts(
    model: nn.Module,
    *,
    slots: int,
    device: torch.device | str | None = None,
    policy: EvictionPolicy | None = None,
    prefetch: bool = True,
    max_fetch: int | None = None,
    cache: bool = True,
    predictor: Predictor | None = None,
    slot_memory: SlotMemoryFactory | None = None,
    host_buffer: memoryview | bytearray | None = None,
) -> ExpertOffload:
    """Move ``model``'s MoE experts to host memory behind a pool of ``slots`` slots on
    ``device`` (default: where the experts are now) shared by all MoE layers.

    ``slots`` must be at least one layer's expert count. ``policy`` is the cache's
    eviction policy (default ours, ``HitDensityPolicy``); ``prefetch`` predicts the
    next MoE layer with its router (or ``predictor``); ``max_fetch`` is hybrid mode
    (at most that many copies per layer step, the rest computed on the CPU);
    ``cache=False`` is on-demand loading with no cache (every step copies all its
    experts). ``slot_memory`` builds the slot pool instead of the default for
    ``device``. ``host_buffer`` holds the host rows instead of memory of the store's
    own (see ``HostExpertStore``): a refit that writes rows there is followed by
    ``invalidate``. Move the rest of the model to ``device`` yourself; the offloaded
    layers hold no parameters.
    """
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError(f"{type(model).__name__} has no MoE block with stacked experts")
    if any(isinstance(_experts(b), OffloadedExperts) for b in blocks):
        raise ConfigError("this model's experts are offloaded already")
    first = _experts(blocks[0])
    dev = torch.device(device) if device is not None else first.gate_up_proj.device
    with torch.no_grad():
        return ExpertOffload(
            blocks,
            slots=slots,
            device=dev,
            policy=policy,
            prefetch=prefetch,
            max_fetch=max_fetch,
            cache=cache,
            predictor=predictor,
            slot_memory=slot_memory,
            host_buffer=host_buffer,
        )
