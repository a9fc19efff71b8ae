"""``refitd experts``: MoE expert slot pools hosted by the daemon.

Reads ``GET /v1/experts`` (a list of pool records). A daemon without expert pools,
or one built before pools existed, is reported as having none.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from refitd.ops.console import add_client_arguments, fetch, print_json, print_table, run_command

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd experts",
        "refitd experts --json | jq '.[].hits'",
    )


def _cell(key: str) -> Callable[[dict[str, Any]], object]:
    return lambda pool: pool.get(key, "-")


def run(args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        from refitd.errors import NotFoundError

        try:
            pools: list[dict[str, Any]] = await fetch(client, "/experts", list[dict[str, Any]])
        except NotFoundError:
            pools = []
        if args.json:
            print_json(pools)
            return 0
        keys = list(dict.fromkeys(k for pool in pools for k in pool))
        print_table(
            "expert pools",
            [(k, _cell(k)) for k in keys],
            pools,
            empty="none (this daemon hosts no expert pools)",
        )
        return 0

    return run_command(args, body)
