"""``refitd config check FILE``: validate a configuration as the daemon would load it."""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from refitd.ops.console import epilog, print_json

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = epilog(
        "refitd config check /etc/refitd/refitd.toml",
        "REFITD_SERVER_PORT=7451 refitd config check refitd.toml --show",
        "refitd config check refitd.toml --set server.host=0.0.0.0  # refused: needs a token",
    )
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser(
        "check",
        help="validate FILE (with the environment and --set applied) and report the result",
        description=(
            "Load FILE exactly as `refitd serve --config FILE` would, with REFITD_* "
            "environment variables and --set overrides applied, and report the first "
            "problem naming its key. Exit status 0 when valid, 1 when not."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=parser.epilog,
    )
    check.add_argument("file", metavar="FILE", help="the TOML configuration file")
    check.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key, as on the daemon's command line (repeatable)",
    )
    check.add_argument("--show", action="store_true", help="print the effective configuration")
    check.add_argument("--json", action="store_true", help="print the effective config as JSON")
    check.add_argument(
        "--no-env", action="store_true", help="ignore REFITD_* environment variables"
    )


def run(args: argparse.Namespace) -> int:
    from refitd.config import load_config, parse_overrides
    from refitd.daemon.access.auth import check_startup
    from refitd.errors import ConfigError

    try:
        config = load_config(
            args.file, {} if args.no_env else os.environ, parse_overrides(args.set)
        )
        # What the daemon checks before binding: the token file must be usable now.
        check_startup(config.server)
    except ConfigError as exc:
        print(f"{args.file}: invalid: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(config)
        return 0
    print(f"{args.file}: OK")
    if args.show:
        for section, table in msgspec.to_builtins(config).items():
            print(f"[{section}]")
            for key, value in table.items():
                shown = "(unset)" if value is None else msgspec.json.encode(value).decode()
                print(f"{key} = {shown}")
    return 0
