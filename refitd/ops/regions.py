"""``refitd regions``: the memory regions the daemon holds."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from refitd.ops.console import add_client_arguments, human_bytes, print_table, show_command

if TYPE_CHECKING:
    from refitd.wire import RegionInfo

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd regions",
        "refitd regions --json | jq '.[] | select(.owner == \"trainer-0\")'",
        "refitd regions --unix /run/refitd/refitd.sock",
    )


def _show(regions: list[RegionInfo]) -> None:
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


def run(args: argparse.Namespace) -> int:
    return show_command(args, lambda client: client.regions(), _show)
