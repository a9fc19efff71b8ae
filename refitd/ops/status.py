"""``refitd status``: is the daemon up, ready, and what does it hold."""

from __future__ import annotations

import argparse
from typing import Any

from refitd.ops.console import add_client_arguments, human_bytes, print_json, run_command
from refitd.wire import MemoryKind

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd status                          # the daemon in the default config",
        "refitd status --url http://10.0.0.7:7450 --token-file ~/.refitd-token",
        "refitd status --json | jq .ready",
    )


async def gather(client: Any) -> dict[str, Any]:
    """One dict of everything ``status`` shows (also its ``--json`` output)."""
    from refitd.errors import RefitError
    from refitd.wire import PullProgress, RegionInfo, VersionInfo

    node = await client.node()
    try:
        await client.ready()
        ready, why = True, ""
    except RefitError as exc:
        ready, why = False, str(exc)
    regions: list[RegionInfo] = await client.regions()
    versions: list[VersionInfo] = await client.all_versions()
    pulls: list[PullProgress] = await client.pulls()
    by_state: dict[str, int] = {}
    for v in versions:
        by_state[str(v.state)] = by_state.get(str(v.state), 0) + 1
    pull_states: dict[str, int] = {}
    for p in pulls:
        pull_states[str(p.state)] = pull_states.get(str(p.state), 0) + 1
    try:
        pools = [p.name for p in await client.pools()]
    except RefitError:  # a daemon from before expert pools: it hosts none
        pools = []
    return {
        "url": client.base_url,
        "node_id": node.node_id,
        "incarnation": node.incarnation,
        "transport": node.transport,
        "shm_huge_pages": node.shm_huge_pages,
        "ucx_transports": node.ucx_transports,
        "paths": node.paths,
        "ready": ready,
        "not_ready_reason": why,
        "regions": len(regions),
        "region_bytes": sum(r.nbytes for r in regions),
        # GPU allocations the daemon opened (docs/gpu.md): copied by its CUDA engine
        "gpu_regions": sum(r.kind is MemoryKind.CUDA for r in regions),
        "gpu_region_bytes": sum(r.nbytes for r in regions if r.kind is MemoryKind.CUDA),
        "versions": by_state,
        "leases": sum(v.leases for v in versions),
        "pulls": pull_states,
        "expert_pools": pools,
    }


def describe_ucx(pairs: list[str]) -> str:
    """``tcp (eth0, lo), cma, ...; RDMA: ...`` from ``transport/device`` pairs."""
    if not pairs:
        return "none (no UCX data plane, or ucx_info not found)"
    from transports.ucx.info import RDMA_TRANSPORTS

    devices: dict[str, list[str]] = {}
    for pair in pairs:
        tl, _, dev = pair.partition("/")
        devices.setdefault(tl, []).append(dev)
    parts = [
        tl if devs == ["memory"] else f"{tl} ({', '.join(devs)})" for tl, devs in devices.items()
    ]
    rdma = [tl for tl in devices if tl in RDMA_TRANSPORTS]
    tail = (
        f"; RDMA: {', '.join(rdma)}"
        if rdma
        else "; no RDMA (this UCX has no verbs/rdmacm: between hosts it is tcp)"
    )
    return ", ".join(parts) + tail


def run(args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        info = await gather(client)
        if args.json:
            print_json(info)
            return 0 if info["ready"] else 1
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"refitd at {info['url']}", title_justify="left", show_header=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        ready = (
            "[green]ready[/]" if info["ready"] else f"[red]not ready[/]: {info['not_ready_reason']}"
        )
        table.add_row("node", f"{info['node_id']} (incarnation {info['incarnation']})")
        table.add_row("state", ready)
        table.add_row("transport", info["transport"])
        huge = info["shm_huge_pages"] or "unknown"
        if huge in ("never", "deny"):
            huge += " (same-host UCX pulls slower: see systemd/refitd-shm-huge.service)"
        table.add_row("shm huge pages", huge)
        table.add_row("UCX transports", describe_ucx(info["ucx_transports"]))
        for peer, path in sorted(info["paths"].items()):
            table.add_row(f"path from {peer}", path)
        table.add_row("regions", f"{info['regions']} ({human_bytes(info['region_bytes'])})")
        if info["gpu_regions"]:
            table.add_row(
                "GPU regions",
                f"{info['gpu_regions']} ({human_bytes(info['gpu_region_bytes'])}): copied by "
                "this daemon's CUDA engine (pull path shm+cuda); other daemons read them "
                "through its host staging",
            )
        versions = ", ".join(f"{n} {s}" for s, n in sorted(info["versions"].items())) or "none"
        table.add_row("versions", versions)
        table.add_row("leases", str(info["leases"]))
        pulls = ", ".join(f"{n} {s}" for s, n in sorted(info["pulls"].items())) or "none"
        table.add_row("pulls", pulls)
        table.add_row("expert pools", ", ".join(info["expert_pools"]) or "none")
        Console().print(table)
        return 0 if info["ready"] else 1

    return run_command(args, body)
