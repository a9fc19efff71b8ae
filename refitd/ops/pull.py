"""``refitd pull FILE``: submit a pull described in a file and follow it to its end.

The file (JSON; ``-`` reads standard input) is a pull request in the daemon's own
terms, region-relative descriptors as in ``POST /v1/pulls``::

    {
      "model": "qwen3",
      "version": "latest",
      "source": "",
      "descriptors": [[1, 0, 2, 0, 4096], [1, 8192, 2, 4096, 4096]]
    }

Each descriptor is ``[src_region, src_offset, dst_region, dst_offset, nbytes]``,
offsets and sizes in bytes, region ids as ``refitd regions`` lists them (the source's
on the source daemon). ``source`` is the base URL of the daemon holding the version,
``""`` for the daemon the command talks to; ``version`` is a number or ``"latest"``
(the newest READY one); ``lease_id`` is optional: without it the command leases the
version at the source for the pull and releases it after. ``pack_specs`` may list
source-side packs as ``[src_region, src_offset, shape, strides, itemsize,
dst_region, dst_offset]``.

Exit status: 0 when every byte landed, 1 when the daemon refused or the pull failed
or was cancelled (the destination ranges it left suspect are printed), 2 when the
daemon could not be reached or the file is malformed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

import msgspec

from refitd.ops.console import add_client_arguments, run_command, token_of

__all__ = ["PullFile", "add_arguments", "run"]


class PullFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a pull file holds; see the module docstring."""

    model: str
    descriptors: list[tuple[int, int, int, int, int]]
    version: int | str = "latest"
    source: str = ""
    lease_id: str = ""
    pack_specs: list[tuple[int, int, list[int], list[int], int, int, int]] = []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(
        parser,
        "refitd pull plan.json                  # progress bar until the last byte lands",
        "refitd pull plan.json --version 7      # this version instead of the file's",
        "refitd pull plan.json --json | jq .rate_gbps",
        "refitd pull - < plan.json --source http://10.0.0.7:7450 --token-file ~/.refitd-token",
        "",
        "plan.json, descriptors [src_region, src_offset, dst_region, dst_offset, nbytes]:",
        '  {"model": "m", "version": "latest", "source": "",',
        '   "descriptors": [[1, 0, 2, 0, 4096]]}',
    )
    parser.add_argument("file", metavar="FILE", help="the pull file (JSON), or - for stdin")
    parser.add_argument("--model", help="override the file's model")
    parser.add_argument("--version", help="override the file's version (a number or latest)")
    parser.add_argument("--source", help="override the file's source daemon URL ('' = this daemon)")
    parser.add_argument("--lease", metavar="LEASE_ID", help="use this lease held at the source")
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="TTL of the lease taken when none is given (default 60; renewed while running)",
    )


def read_pull_file(path: str, args: argparse.Namespace) -> PullFile:
    """Read and validate the file, then apply the command-line overrides."""
    from refitd.errors import ConfigError

    try:
        raw = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()  # noqa: SIM115
    except OSError as exc:
        raise ConfigError(f"pull file {path} cannot be read ({exc.strerror})") from None
    try:
        spec = msgspec.json.decode(raw, type=PullFile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(
            f"pull file {path} refused: {exc}; expected {{model, version, descriptors: "
            "[[src_region, src_offset, dst_region, dst_offset, nbytes], ...]}"
        ) from None
    changes: dict[str, Any] = {}
    if args.model:
        changes["model"] = args.model
    if args.version:
        changes["version"] = int(args.version) if args.version.isdigit() else args.version
    if args.source is not None:
        changes["source"] = args.source
    if args.lease:
        changes["lease_id"] = args.lease
    spec = msgspec.structs.replace(spec, **changes)
    if isinstance(spec.version, str) and spec.version != "latest":
        raise ConfigError(f"pull file {path}: version {spec.version!r} must be a number or latest")
    return spec


async def pull(client: Any, spec: PullFile, args: argparse.Namespace) -> int:
    """Lease (unless given), submit, follow with a progress bar; release what we took."""
    import numpy as np

    from refitd.client.http import RefitClient
    from refitd.client.leases import held_lease
    from refitd.ops.pulls import follow
    from refitd.wire import DescriptorTable, PackSpec, PullRequest

    rows = np.array(spec.descriptors, dtype=np.int64).reshape(-1, 5)
    packs = [
        PackSpec(s[0], s[1], tuple(s[2]), tuple(s[3]), s[4], s[5], s[6]) for s in spec.pack_specs
    ]
    async with contextlib.AsyncExitStack() as stack:
        source = client
        if spec.source:
            token = token_of(args)
            source = await stack.enter_async_context(RefitClient(spec.source, token=token))
        version = spec.version
        if not isinstance(version, int):
            version = (await source.version(spec.model, "latest")).version
        lease_id = spec.lease_id
        if not lease_id:
            # Kept alive until the pull ends, then released (one the source dropped
            # already, expired or restarted, is not an error of the pull).
            acquiring = source.acquire_lease(spec.model, version, args.lease_ttl, "refitd pull")
            held = held_lease(source, acquiring, args.lease_ttl)
            lease_id = (await stack.enter_async_context(held)).granted.lease_id
        req = PullRequest(
            spec.model, version, lease_id, DescriptorTable.pack(rows), packs, spec.source
        )
        started = await client.submit_pull(req)
        try:
            return await follow(client, started.pull_id, args.json)
        except asyncio.CancelledError:
            # Interrupted (Ctrl-C): do not leave the pull writing on without us.
            with contextlib.suppress(Exception):
                await asyncio.shield(client.cancel_pull(started.pull_id))
            raise
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    from refitd.errors import ConfigError

    try:
        spec = read_pull_file(args.file, args)
    except ConfigError as exc:
        print(f"refitd pull: {exc}", file=sys.stderr)
        return 2

    async def body(client: Any) -> int:
        return await pull(client, spec, args)

    return run_command(args, body)
