"""Shared plumbing of the operator commands: reaching the daemon, printing tables.

Which daemon a command talks to, highest precedence first:

1. ``--url URL`` or ``--unix PATH``;
2. ``$REFITD_URL``;
3. the listener in the configuration (``--config FILE``, else ``$REFITD_CONFIG``,
   else the defaults: ``http://127.0.0.1:7450``), via ``[server] unix_socket`` when
   set, since the Unix socket identifies the caller by uid.

A bearer token, when the daemon wants one, is read from ``--token-file`` or
``$REFITD_TOKEN_FILE`` (the first token in the file, same format as the daemon's
``server.token_file``).

Exit codes: 0 success, 1 the daemon refused or failed the request, 2 the daemon
could not be reached or the local configuration is invalid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from refitd.errors import ConfigError, RefitError, TransportError

__all__ = [
    "Column",
    "add_client_arguments",
    "connect",
    "epilog",
    "human_bytes",
    "print_json",
    "print_table",
    "progress_bar",
    "run_command",
    "show_command",
    "token_of",
]

URL_ENV = "REFITD_URL"
TOKEN_FILE_ENV = "REFITD_TOKEN_FILE"

Column = tuple[str, Callable[[Any], object]]


def epilog(*examples: str) -> str:
    """An argparse epilog listing ``examples`` (shown verbatim by RawDescriptionHelpFormatter)."""
    return "examples:\n" + "\n".join(f"  {e}" for e in examples)


def add_client_arguments(parser: argparse.ArgumentParser, *examples: str) -> None:
    """The options every command that talks to a daemon shares, plus examples."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = epilog(*examples)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"daemon base URL (default ${URL_ENV}, else from the config)")
    where.add_argument("--unix", metavar="PATH", help="talk over this Unix socket instead")
    parser.add_argument("--config", metavar="FILE", help="config file naming the daemon's listener")
    parser.add_argument(
        "--token-file", metavar="FILE", help=f"bearer token file (default ${TOKEN_FILE_ENV})"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def token_of(args: argparse.Namespace, env: dict[str, str] | None = None) -> str | None:
    """The bearer token ``--token-file`` (else ``$REFITD_TOKEN_FILE``) holds, if any."""
    from refitd.config import read_token

    env = dict(os.environ) if env is None else env
    token_file = args.token_file or env.get(TOKEN_FILE_ENV)
    return read_token(token_file) if token_file else None


def connect(args: argparse.Namespace, env: dict[str, str] | None = None) -> Any:
    """A :class:`refitd.client.http.RefitClient` for the daemon ``args`` name."""
    from refitd.client.http import RefitClient

    env = dict(os.environ) if env is None else env
    token = token_of(args, env)
    if args.unix:
        return RefitClient(unix_path=args.unix, token=token)
    if args.url or env.get(URL_ENV):
        return RefitClient(args.url or env[URL_ENV], token=token)
    from refitd.config import load_config

    server = load_config(args.config, env).server
    if server.unix_socket and Path(server.unix_socket).exists():
        return RefitClient(unix_path=server.unix_socket, token=token)
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
    host = f"[{host}]" if ":" in host else host
    return RefitClient(f"http://{host}:{server.port}", token=token)


def run_command(args: argparse.Namespace, body: Callable[[Any], Awaitable[int]]) -> int:
    """Run ``body(client)`` on a fresh event loop; map refusals to exit codes and
    one line on stderr naming what failed."""

    async def main() -> int:
        async with connect(args) as client:
            return await body(client)

    try:
        return asyncio.run(main())
    except ConfigError as exc:
        print(f"refitd {args.command}: {exc}", file=sys.stderr)
        return 2
    except TransportError as exc:
        print(f"refitd {args.command}: cannot reach the daemon: {exc}", file=sys.stderr)
        return 2
    except RefitError as exc:
        print(f"refitd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def show_command(
    args: argparse.Namespace,
    get: Callable[[Any], Awaitable[Any]],
    show: Callable[[Any], None],
) -> int:
    """The shape of a read-only command: ``get(client)`` once, then print it as
    JSON under ``--json``, else ``show(value)`` (tables); exit codes as
    :func:`run_command`."""

    async def body(client: Any) -> int:
        value = await get(client)
        if args.json:
            print_json(value)
        else:
            show(value)
        return 0

    return run_command(args, body)


def print_json(value: Any) -> None:
    """``value`` (Structs, lists, dicts) as indented JSON on stdout."""
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``64.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def print_table(
    title: str, columns: Sequence[Column], rows: Iterable[Any], empty: str = "none"
) -> None:
    """A rich table of ``rows``; ``columns`` pairs a header with a cell function.

    A table wider than the terminal (80 columns when piped, or ``$COLUMNS``) would
    fold every header and cell into fragments; it is printed as one block per row
    instead, a ``header  value`` line per column, which stays readable at any width."""
    from rich.console import Console
    from rich.table import Table

    items = list(rows)
    console = Console()
    if not items:
        console.print(f"{title}: {empty}")
        return
    table = Table(title=title, title_justify="left")
    for header, _ in columns:
        table.add_column(header, overflow="fold")
    cells = [[str(cell(item)) for _, cell in columns] for item in items]
    for row in cells:
        table.add_row(*row)
    natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    if natural <= console.width:
        console.print(table)
        return
    console.print(title, highlight=False)
    for row in cells:
        block = Table.grid(padding=(0, 2))
        block.add_column(style="bold", no_wrap=True)
        block.add_column(overflow="fold")
        for (header, _), value in zip(columns, row, strict=True):
            block.add_row(header, value)
        console.print()
        console.print(block, highlight=False)


def progress_bar(total_bytes: int, description: str) -> Any:
    """A rich progress bar for a byte-counting operation: use as a context manager,
    then ``bar.update(task, completed=n)``. Returns ``(progress, task_id)``."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )
    task = progress.add_task(description, total=total_bytes or None)
    return progress, task
