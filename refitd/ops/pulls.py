"""``refitd pulls``: pulls in flight and finished; ``--follow ID`` shows a progress bar."""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING, Any

from refitd.ops.console import (
    add_client_arguments,
    human_bytes,
    print_json,
    print_table,
    progress_bar,
    run_command,
    show_command,
)

if TYPE_CHECKING:
    from refitd.wire import PullProgress

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd pulls                     # every pull the daemon remembers",
        "refitd pulls --follow p-1a2b3c   # progress bar until it ends",
        "refitd pulls --json | jq '.[] | select(.state == \"failed\") | .error'",
    )
    parser.add_argument("--follow", metavar="PULL_ID", help="show a progress bar until it ends")


def _percent(p: Any) -> str:
    return f"{100 * p.bytes_done / p.bytes_total:.0f}%" if p.bytes_total else "-"


async def follow(client: Any, pull_id: str, as_json: bool) -> int:
    """Follow one pull to its end; exit 0 only if it completed."""
    from refitd.errors import RefitError
    from refitd.wire import PullState

    first: PullProgress = await client.pull_status(pull_id)
    progress, task = progress_bar(first.bytes_total, f"pull {pull_id}")
    last = first

    def show(p: PullProgress) -> None:
        nonlocal last
        last = p
        progress.update(task, completed=p.bytes_done)

    # The final snapshot below says how it ended, so a failed wait is not an error here.
    with contextlib.nullcontext() if as_json else progress, contextlib.suppress(RefitError):
        await client.wait_pull(pull_id, on_progress=None if as_json else show)
    last = await client.pull_status(pull_id)
    if as_json:
        print_json(last)
    elif last.error is not None:
        progress.console.print(
            f"pull {pull_id} {last.state}: {last.error.error}: {last.error.detail}"
        )
        for region, offset, nbytes in last.suspect:
            progress.console.print(
                f"  suspect: region {region} bytes [{offset}, {offset + nbytes}) may hold "
                "partial data"
            )
    return 0 if last.state == PullState.DONE else 1


def _show(pulls: list[PullProgress]) -> None:
    print_table(
        "pulls",
        [
            ("id", lambda p: p.pull_id),
            ("state", lambda p: p.state),
            ("done", _percent),
            ("bytes", lambda p: f"{human_bytes(p.bytes_done)} / {human_bytes(p.bytes_total)}"),
            ("descriptors", lambda p: f"{p.descriptors_done}/{p.descriptors_total}"),
            ("seconds", lambda p: f"{p.seconds:.3f}"),
            ("GB/s", lambda p: f"{p.rate_gbps:.2f}"),
            ("error", lambda p: f"{p.error.error}: {p.error.detail}" if p.error else "-"),
        ],
        pulls,
    )


def run(args: argparse.Namespace) -> int:
    if args.follow:
        return run_command(args, lambda client: follow(client, args.follow, args.json))
    return show_command(args, lambda client: client.pulls(), _show)
