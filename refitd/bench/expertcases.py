"""The cases both expert benches run (``refitd bench experts`` and its ``--prefetch``
mode, :mod:`refitd.bench.prefetch`): the presets' expert sizes and routing models, the
pool sizes per preset, and the in-process timing of ``ExpertCache.ensure``."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refitd.experts.traces import RoutingModel

__all__ = ["EXPERT_BANKS", "pool_sizes", "preset_models", "time_ensure", "timer_overhead"]

# bf16 bytes of one expert's banks (gate, up, down) = 2 * hidden * ffn each.
EXPERT_BANKS: dict[str, tuple[int, int, int]] = {
    "mixtral-8x7b": (2 * 4096 * 14336,) * 3,
    "qwen3-30b-a3b": (2 * 2048 * 768,) * 3,
    "deepseek-v3": (2 * 7168 * 2048,) * 3,
}


def pool_sizes(active: int, experts: int) -> list[tuple[str, int]]:
    return [(f"{m}x", max(m * active, experts)) for m in (1, 2, 4)]


def preset_models(
    args: argparse.Namespace, *, requests: int | None = None, tokens: int | None = None
) -> Iterator[tuple[str, RoutingModel]]:
    """Each preset named by ``--presets``, in order, with its routing model: the trace
    ``generate_trace(cfg)`` gives plus what it was drawn from. ``requests`` and
    ``tokens`` (decode tokens per request) default to ``--requests`` and ``--tokens``.
    Lazy, so each preset is generated only when the caller reaches it."""
    from refitd.experts.traces import preset_config, routing_model

    for name in args.presets:
        cfg = preset_config(
            name,
            requests=args.requests if requests is None else requests,
            decode_tokens=args.tokens if tokens is None else tokens,
            prefill_tokens=args.prefill,
            seed=args.seed,
        )
        yield name, routing_model(cfg)


def time_ensure(calls: int) -> tuple[float, float, float, float, int]:
    """(warm µs, two-miss µs) for ours, then for LRU, and a warm step's bytes."""
    from refitd.experts import (
        ExpertCache,
        ExpertSlots,
        HitDensityPolicy,
        HostExpertRows,
        HostSlotMemory,
        LruPolicy,
        SlotGeometry,
    )

    layers, experts, k = 48, 128, 8
    out: list[float] = []
    warm_bytes = -1
    for make in (HitDensityPolicy, LruPolicy):
        rng = random.Random(1)
        cache = ExpertCache(layers, experts, 2 * layers * k, policy=make())
        current = [rng.sample(range(experts), k) for _ in range(layers)]
        for layer in range(layers):
            cache.ensure(layer, current[layer])
        # Warm: every routed expert resident; layers in decode order.
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(calls):
                layer = i % layers
                cache.ensure(layer, current[layer])
            best.append((time.perf_counter() - t0) / calls)
        warm_us = min(best) * 1e6
        # Two misses: keep six routed experts, add two that are not resident.
        overhead = min(timer_overhead() for _ in range(3))
        samples: list[int] = []
        for i in range(calls):
            layer = i % layers
            # Six resident experts (the most recently routed first) and two that are
            # not: exactly two misses whatever the policy evicted meanwhile.
            resident = [e for e in range(experts) if cache.slot_of(layer, e) is not None]
            keep = [e for e in current[layer] if e in resident][:6]
            keep += [e for e in resident if e not in keep][: 6 - len(keep)]
            absent = [e for e in range(experts) if e not in resident]
            if len(keep) < 6 or len(absent) < 2:
                continue
            routed = keep + rng.sample(absent, 2)
            t0 = time.perf_counter_ns()
            plan = cache.ensure(layer, routed)
            samples.append(time.perf_counter_ns() - t0)
            if plan.missing != 2:
                raise RuntimeError(f"timing step had {plan.missing} misses, not 2")
            current[layer] = routed
        if not samples:
            raise RuntimeError("no layer kept six resident experts to time a two-miss step")
        # The median: on a shared machine a preempted call says nothing about ensure.
        miss_us = max(0.0, statistics.median(samples) - overhead) / 1e3
        out += [warm_us, miss_us]
        if warm_bytes < 0:
            widths = (64, 64, 32)
            slots = ExpertSlots(SlotGeometry(layers, cache.cache_size, widths))
            rows = HostExpertRows(layers, experts, widths)
            device = HostSlotMemory(slots.geometry)
            cold = cache.ensure(0, current[0])
            slots.apply_copy_plan(0, cold.copy, rows, device)
            warm_bytes = slots.apply_copy_plan(
                0, cache.ensure(0, current[0]).copy, rows, device
            ).bytes
    return out[0], out[1], out[2], out[3], warm_bytes


def timer_overhead() -> float:
    n = 20000
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples)
