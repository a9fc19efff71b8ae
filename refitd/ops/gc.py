"""``refitd gc``: show what the daemon can free, and free it.

Frees regions whose client process exited (and that no READY, pending or leased
version and no running pull still needs) and shared-memory segments of the daemon's
user whose creator process is gone. ``--dry-run`` only lists them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from refitd.ops.console import add_client_arguments, human_bytes, print_table, show_command

if TYPE_CHECKING:
    from refitd.wire import GcReport

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be freed, free nothing"
    )
    add_client_arguments(
        parser,
        "refitd gc --dry-run   # what would be freed",
        "refitd gc             # free it; prints what was freed",
    )


def _show(report: GcReport) -> None:
    verb = "would free" if report.dry_run else "freed"
    print_table(
        f"regions {verb} ({len(report.regions)}, "
        f"{human_bytes(sum(r.nbytes for r in report.regions))})",
        [
            ("id", lambda r: r.region_id),
            ("size", lambda r: human_bytes(r.nbytes)),
            ("owner", lambda r: r.owner or "-"),
            ("label", lambda r: r.label or "-"),
            ("exited client", lambda r: r.process or "-"),
            ("handle", lambda r: r.handle),
        ],
        report.regions,
    )
    print_table(
        f"stale segments {verb} ({len(report.segments)})",
        [("segment", lambda s: s)],
        report.segments,
    )


def run(args: argparse.Namespace) -> int:
    return show_command(args, lambda client: client.gc(dry_run=args.dry_run), _show)
