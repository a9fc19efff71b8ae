"""``refitd experts``: the MoE expert slot pools the daemon hosts (``GET /v1/experts``).

One row per pool: geometry, occupancy, hit rate, traffic into slots (prefetched
copies among it, and how many of those a step used), and slots dropped because a
refit rewrote their expert. ``--json`` prints the daemon's pool
records as they are (every field of :class:`~refitd.wire.PoolInfo`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from refitd.ops.console import add_client_arguments, human_bytes, print_table, show_command

if TYPE_CHECKING:
    from refitd.wire import PoolInfo

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd experts",
        "refitd experts --json | jq '.[] | {name, hits, misses}'",
        "refitd experts --unix /run/refitd/refitd.sock",
    )


def _hit_rate(p: Any) -> str:
    routes = p.hits + p.misses
    return f"{100 * p.hits / routes:.1f}%" if routes else "-"


def _prefetch_used(p: Any) -> str:
    done = p.prefetch_used + p.prefetch_wasted
    return f"{p.prefetch_used}/{done}" if done else "-"


def _show(pools: list[PoolInfo]) -> None:
    print_table(
        "expert pools",
        [
            ("pool", lambda p: p.name),
            ("layers x experts", lambda p: f"{p.layers} x {p.experts}"),
            ("slots used", lambda p: f"{p.occupied_slots}/{p.slots}"),
            ("expert size", lambda p: human_bytes(sum(p.row_bytes))),
            ("hit rate", _hit_rate),
            ("misses", lambda p: p.misses),
            ("evictions", lambda p: p.evictions),
            ("warm steps", lambda p: f"{p.warm_plans}/{p.plans}"),
            ("copied", lambda p: human_bytes(p.copied_bytes)),
            ("prefetched", lambda p: human_bytes(p.prefetched_bytes)),
            ("prefetch used", _prefetch_used),
            ("stale dropped", lambda p: p.stale_invalidations),
            ("regions host/slots", lambda p: f"{p.host_region}/{p.slot_region}"),
            ("owner", lambda p: p.owner or "-"),
        ],
        pools,
        empty="none (this daemon hosts no expert pools)",
    )


def run(args: argparse.Namespace) -> int:
    return show_command(args, lambda client: client.pools(), _show)
