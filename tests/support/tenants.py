"""Two token tenants of one daemon, and the one-tensor versions and pulls their
tests make.

The tenants are ``a`` and ``b`` (:data:`TOKENS`); :func:`two_tenants` serves a daemon
that checks their tokens as ``refitd serve`` does and gives a client of each. A test
of long polls waits on the daemon's own count of them (:func:`until`), with a safety
bound well inside a wait's own timeout, so a place given back late fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.waits import MAX_WAIT_S
from refitd.wire import DescriptorTable, ManifestIn, PullRequest, ShardEntry, TensorEntry
from refitd.wire.leases import LeaseInfo
from support.daemons import Served, served, token_file

__all__ = [
    "SAFETY_S",
    "TOKENS",
    "TwoTenants",
    "headers",
    "publish_bytes",
    "pull_request",
    "two_tenants",
    "until",
]

TOKENS = {"a": "token-of-a", "b": "token-of-b"}
"""Principal -> bearer token, as the daemon's token file lists them."""
SAFETY_S = MAX_WAIT_S / 2
"""How long :func:`until` waits: what a test waits for must happen well before any
long poll times out."""


@dataclass(frozen=True)
class TwoTenants:
    """The daemon served (its app, URL and daemon) and a client of each tenant."""

    served: Served
    a: RefitClient
    b: RefitClient


@contextlib.asynccontextmanager
async def two_tenants(
    directory: Path, daemon: Daemon | None = None, **settings: Any
) -> AsyncIterator[TwoTenants]:
    """Serve ``daemon`` (else one of ``daemon_config(**settings)``) for the block,
    requiring the tokens of :data:`TOKENS` (their file written in ``directory``)."""
    access = ServerConfig(port=0, token_file=token_file(directory, TOKENS))
    async with (
        served(daemon, access=access, **settings) as s,
        RefitClient(s.url, token=TOKENS["a"]) as a,
        RefitClient(s.url, token=TOKENS["b"]) as b,
    ):
        yield TwoTenants(s, a, b)


def headers(who: str) -> dict[str, str]:
    """The headers of a raw HTTP request by tenant ``who``, asking for JSON."""
    return {"Authorization": f"Bearer {TOKENS[who]}", "Accept": "application/json"}


async def until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds; fail after :data:`SAFETY_S`. Polled: it
    reads the daemon's state (a count of open waits), which has no event to await."""
    async with asyncio.timeout(SAFETY_S):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def publish_bytes(
    client: RefitClient, model: str, version: int, region_id: int, nbytes: int
) -> None:
    """Publish bytes ``[0, nbytes)`` of region ``region_id`` as ``version`` of
    ``model``: one part, one tensor ``w`` of ``nbytes`` uint8 elements."""
    shard = ShardEntry((0,), (nbytes,), region_id, 0)
    tensor = TensorEntry("w", (nbytes,), "uint8", [shard])
    await client.publish(ManifestIn(model, version, 0, 1, [tensor]))


def pull_request(
    lease: LeaseInfo, rows: Sequence[tuple[int, int, int, int, int]], source: str = ""
) -> PullRequest:
    """A pull under ``lease`` of its version, of the descriptor ``rows`` (``(src region,
    src offset, dst region, dst offset, nbytes)``), from the daemon at ``source``
    (``""``: the daemon the pull is submitted to)."""
    table = DescriptorTable.pack(np.array(rows, dtype=np.int64).reshape(-1, 5))
    return PullRequest(lease.model, lease.version, lease.lease_id, table, [], source)
