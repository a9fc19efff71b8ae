"""``refitd sources``: published model versions, their state and leases."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from refitd.ops.console import add_client_arguments, print_table, show_command

if TYPE_CHECKING:
    from refitd.wire import VersionInfo

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd sources                 # every model",
        "refitd sources --model qwen3   # one model's versions",
        "refitd sources --json",
    )
    parser.add_argument("--model", help="only this model's versions")


def _show(versions: list[VersionInfo]) -> None:
    print_table(
        "sources",
        [
            ("model", lambda v: v.model),
            ("version", lambda v: v.version),
            ("state", lambda v: v.state),
            ("parts", lambda v: f"{len(v.published_parts)}/{v.expected_parts}"),
            ("leases", lambda v: v.leases),
        ],
        versions,
    )


def run(args: argparse.Namespace) -> int:
    return show_command(
        args,
        lambda client: client.versions(args.model) if args.model else client.all_versions(),
        _show,
    )
