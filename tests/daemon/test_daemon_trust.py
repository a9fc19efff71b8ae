"""The trust model, rule by rule (see ``refitd/daemon/trust.py`` and the README's
"Trust model"): which sources a daemon contacts, what a lease reads, what a pull
writes, and that a READY version never changes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from support.hostile import W_BYTES, rows, toy_manifest

from refitd.client.http import RefitClient
from refitd.config import load_config
from refitd.daemon.node import Daemon, DaemonOptions
from refitd.daemon.peers import PeerPolicy, normalize_peer
from refitd.daemon.serve import listening
from refitd.errors import ConfigError, ProtocolError
from refitd.wire import DescriptorTable, PullRequest

PEER_TOKEN = "peer-token-never-for-strangers"


@contextlib.asynccontextmanager
async def recording_server() -> AsyncIterator[tuple[str, list[web.Request]]]:
    """An HTTP server on loopback that is not a refitd daemon: it records every
    request it receives (and its headers) and answers 404."""
    seen: list[web.Request] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(request)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def token_daemon(*peers: str) -> AsyncIterator[tuple[Daemon, RefitClient, int, int, str]]:
    """A daemon that presents ``PEER_TOKEN`` to the peers it reads from, with 'toy' v1
    published and leased; yields (daemon, client, src region, dst region, lease)."""
    d = Daemon(DaemonOptions(port=0, node_id="trusting", transport="shm", peers=peers))
    async with (
        listening(d.options, daemon=d, token=PEER_TOKEN) as (_, url),
        RefitClient(url) as c,
    ):
        src = await c.create_region(W_BYTES, label="w")
        dst = await c.create_region(W_BYTES, label="dst")
        await c.publish(toy_manifest(src.region_id))
        lease = await c.acquire_lease("toy", 1, ttl_s=600)
        yield d, c, src.region_id, dst.region_id, lease.lease_id


def _pull(src: int, dst: int, lease: str, source: str) -> PullRequest:
    return PullRequest("toy", 1, lease, DescriptorTable(rows([src, 0, dst, 0, 8])), source=source)


async def test_a_pull_from_an_untrusted_source_is_refused_400_and_the_source_never_sees_a_request() -> (
    None
):
    async with recording_server() as (stranger, seen), token_daemon() as (_, c, src, dst, lease):
        with pytest.raises(ProtocolError, match="not a trusted peer") as refused:
            await c.submit_pull(_pull(src, dst, lease, stranger))
        assert stranger in str(refused.value)
        assert seen == []  # no connection, so the peer token went nowhere
        assert await c.pulls() == []


@pytest.mark.parametrize(
    "source",
    ["file:///etc/passwd", "ftp://127.0.0.1:21", "127.0.0.1:7450", "http://", "unix:/run/x.sock"],
)
async def test_a_source_that_is_not_an_http_url_is_refused_400_not_502(source: str) -> None:
    async with token_daemon("http://127.0.0.1:*") as (_, c, src, dst, lease):
        with pytest.raises(ProtocolError, match="refused"):
            await c.submit_pull(_pull(src, dst, lease, source))


async def test_a_trusted_peer_is_contacted_with_the_peer_token() -> None:
    """The other side of the rule (so the refusal above is the allow-list at work)."""
    async with recording_server() as (peer, seen):
        async with token_daemon(peer) as (_, c, src, dst, lease):
            with pytest.raises(Exception):  # noqa: B017 - the stranger answers 404
                await c.submit_pull(_pull(src, dst, lease, peer))
        assert seen, "the trusted peer was never contacted"
        assert all(r.headers.get("Authorization") == f"Bearer {PEER_TOKEN}" for r in seen)


async def test_a_peer_trusted_at_run_time_is_contacted_and_one_forgotten_is_refused_again() -> None:
    async with recording_server() as (peer, seen), token_daemon() as (d, c, src, dst, lease):
        d.peers.trust(peer, origin="registry")
        with pytest.raises(Exception):  # noqa: B017 - the stranger answers 404
            await c.submit_pull(_pull(src, dst, lease, peer))
        assert seen
        contacted = len(seen)
        d.peers.replace("registry", [])
        with pytest.raises(ProtocolError, match="not a trusted peer"):
            await c.submit_pull(_pull(src, dst, lease, peer))
        assert len(seen) == contacted


def test_peer_urls_compare_by_scheme_host_port_and_path_after_normalising() -> None:
    p = PeerPolicy(["HTTP://Node-7:7450/", "https://10.0.0.9", "http://10.0.0.8:*"])
    assert p.allows("http://node-7:7450")
    assert p.allows("https://10.0.0.9:443/")
    assert p.allows("http://10.0.0.8:1") and p.allows("http://10.0.0.8:65535")
    assert not p.allows("http://node-7:7451")
    assert not p.allows("http://10.0.0.9")  # http, not https
    assert not p.allows("https://10.0.0.8:1")
    assert not p.allows("http://user:pw@node-7:7450")
    assert not p.allows("http://node-7:7450?x=1")
    assert normalize_peer("http://[::1]:5/") == "http://[::1]:5"


def test_a_malformed_peers_allow_entry_stops_the_config_load() -> None:
    with pytest.raises(ConfigError, match=r"peers\.allow.*file"):
        load_config(None, {}, {"peers.allow": "file:///etc/passwd"})
    with pytest.raises(ConfigError, match=r"peers\.allow"):
        load_config(None, {}, {"peers.allow": "http://a:*:*"})
    assert load_config(None, {}, {"peers.allow": "http://a:1,http://b:*"}).peers.allow == (
        "http://a:1",
        "http://b:*",
    )
