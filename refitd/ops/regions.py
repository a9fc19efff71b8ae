"""``refitd regions``: the memory regions the daemon holds."""

from __future__ import annotations

import argparse
from typing import Any

from refitd.ops.console import (
    add_client_arguments,
    fetch,
    human_bytes,
    print_json,
    print_table,
    run_command,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd regions",
        "refitd regions --json | jq '.[] | select(.owner == \"trainer-0\")'",
        "refitd regions --unix /run/refitd/refitd.sock",
    )


def run(args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        from refitd.wire import RegionInfo

        regions: list[RegionInfo] = await fetch(client, "/regions", list[RegionInfo])
        if args.json:
            print_json(regions)
            return 0
        print_table(
            f"regions ({len(regions)}, {human_bytes(sum(r.nbytes for r in regions))})",
            [
                ("id", lambda r: r.region_id),
                ("kind", lambda r: r.kind),
                ("size", lambda r: human_bytes(r.nbytes)),
                ("bytes", lambda r: r.nbytes),
                ("owner", lambda r: r.owner or "-"),
                ("label", lambda r: r.label or "-"),
                ("daemon-owned", lambda r: "yes" if r.daemon_owned else "no"),
                ("handle", lambda r: r.handle),
            ],
            regions,
        )
        return 0

    return run_command(args, body)
