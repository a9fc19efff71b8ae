"""A source daemon and an engine's daemon "on another host", for the tests of "the
lease grant is the credential" (issue 50) and of a hostile tenant's attacks on it.

:func:`two_hosts` serves a source with two token tenants (``a``, ``b``) and the
engine's daemon, which reads from the source under the ``daemons`` token; both
share the deployment secret :data:`SECRET`. Each daemon is given its own boot id
(:func:`host_daemon`), so each is another host to the other: the one thing two
daemons on one machine cannot otherwise be made to show. The rest are the steps
those tests share: a version published (:func:`published`), a zeroed destination
at the engine's daemon (:func:`destination`), a pull presenting a lease's grant
(:func:`presenting`) and one honest pull first (:func:`acquainted`), and a bare HTTP
session to the source as a tenant, for requests spelled by hand (:func:`raw_session`,
:func:`status_of`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from refitd.wire import LeaseInfo, PullRequest, PullState
from support.daemons import daemon_config, served, token_file
from support.toy import publish_tensor, pull_rows
from transports.segments import SharedSegment

__all__ = [
    "NBYTES",
    "SECRET",
    "TOKENS",
    "Hosts",
    "acquainted",
    "destination",
    "host_daemon",
    "presenting",
    "published",
    "raw_session",
    "status_of",
    "tenants_access",
    "two_hosts",
]

SECRET = b"g" * 32
"""The deployment secret every daemon here shares."""
NBYTES = 4096
"""The bytes of each version the tests publish, and of each destination."""
TOKENS = {"a": "token-of-a", "b": "token-of-b", "daemons": "token-of-daemons"}
"""Principal -> bearer token, as the source's token file lists them."""


def host_daemon(node_id: str, boot_id: str) -> Daemon:
    """A daemon of this deployment (:data:`SECRET`) on the host ``boot_id``, trusting
    every daemon on 127.0.0.1 (any port) as a peer."""
    config = daemon_config(node_id=node_id, allow=("http://127.0.0.1:*",))
    return Daemon(config, secret=SECRET, boot_id=boot_id)


def tenants_access(tmp: Path) -> ServerConfig:
    """The ``[server]`` access settings of a source requiring :data:`TOKENS` (their
    file written in ``tmp``)."""
    return ServerConfig(port=0, token_file=token_file(tmp, TOKENS))


@dataclass(frozen=True)
class Hosts:
    """A source daemon with two token tenants (``a``, ``b``) and the engine's daemon on
    another host, which reads from it under the ``daemons`` token."""

    source: Daemon
    a: RefitClient
    b: RefitClient
    engine: RefitClient
    source_url: str


@contextlib.asynccontextmanager
async def two_hosts(tmp: Path, engine_boot: str = "host-b") -> AsyncIterator[Hosts]:
    """The source (node ``src`` on ``host-a``) and the engine's daemon (node ``eng`` on
    ``engine_boot``: ``host-a`` puts it on the source's host) served for the block."""
    src = host_daemon("src", "host-a")
    async with (
        served(src, access=tenants_access(tmp)) as s,
        served(host_daemon("eng", engine_boot), token=TOKENS["daemons"]) as e,
        RefitClient(s.url, token=TOKENS["a"]) as a,
        RefitClient(s.url, token=TOKENS["b"]) as b,
    ):
        yield Hosts(src, a, b, e.client, s.url)


async def published(c: RefitClient, model: str, fill: int, size: int = NBYTES) -> int:
    """``model`` v1 published by ``c``'s tenant: the first NBYTES bytes of a region of
    ``size`` bytes, all ``fill``; its region."""
    info = await c.create_region(size, label=model)
    with SharedSegment.attach(info.handle, info.nbytes) as seg:
        seg.numpy()[:] = fill
    await publish_tensor(c, model, 1, info.region_id, NBYTES)
    return info.region_id


@contextlib.asynccontextmanager
async def destination(h: Hosts) -> AsyncIterator[tuple[int, SharedSegment]]:
    """A zeroed region of the engine's daemon, and its segment."""
    seg = SharedSegment.create(NBYTES, "dst")
    with seg:
        info = await h.engine.attach_region(seg.name, NBYTES)
        yield info.region_id, seg


def presenting(lease: LeaseInfo, *rows: tuple[int, int, int, int, int], url: str) -> PullRequest:
    """A pull of ``rows`` from the daemon at ``url`` under ``lease``, presenting its grant."""
    req = pull_rows(lease.model, lease.version, lease.lease_id, *rows, source=url)
    return msgspec.structs.replace(req, grant=lease.records)


async def acquainted(h: Hosts, region: int) -> None:
    """One honest pull of ``ma`` (published in ``region``, every byte 7) by the
    engine's daemon: from then on it knows the source's node id, and reads with
    grants the source made."""
    lease = await h.a.acquire_lease("ma", 1)
    async with destination(h) as (dst, seg):
        res = await h.engine.pull(presenting(lease, (region, 0, dst, 0, NBYTES), url=h.source_url))
        assert res.state is PullState.DONE and (seg.numpy() == 7).all()
    await h.a.release_lease(lease.lease_id)


@contextlib.asynccontextmanager
async def raw_session(h: Hosts, who: str = "a") -> AsyncIterator[aiohttp.ClientSession]:
    """A bare HTTP session to the source as tenant ``who`` (its bearer token sent, each
    parameter spelled as the test writes it, not as the client would)."""
    headers = {"Authorization": f"Bearer {TOKENS[who]}"}
    async with aiohttp.ClientSession(h.source_url, headers=headers) as session:
        yield session


async def status_of(session: aiohttp.ClientSession, method: str, url: str) -> int:
    """The HTTP status of ``method url`` in ``session`` (its body read and dropped)."""
    async with session.request(method, url) as resp:
        await resp.read()
        return resp.status
