"""Host mirrors' routes (issue 35) attacked by a hostile tenant and a replaying peer
(issue 36).

Two real daemons on 127.0.0.1:0, authenticating with tokens: a source (the
trainer's) and a mirror host (``mirrors.policy = always``) that reads it over
``tcp``. Tenant ``a`` and the mirror host's daemon (``peer``) may read model ``m``;
tenant ``b`` may not, at either daemon. Each test is one rule, named as that rule.

Each rule here once failed: the refusal told which versions are mirrored, or a
signed lease request could be replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import daemon_config
from support.mirrorhosts import TokenedHosts, tokened_hosts

from refitd.daemon.app.node import Daemon
from refitd.errors import AccessDenied
from refitd.wire import DescriptorTable, ManifestIn, PullRequest, ShardEntry, TensorEntry
from refitd.wire import routes as api
from refitd.wire.mirrors import MirrorLease
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"hostile-mirrors-secret-0123456789"
MODEL = "m"
NBYTES = 1 << 20
READERS = ("m=a", "m=peer")


@contextlib.asynccontextmanager
async def hosts(tmp: Path) -> AsyncIterator[TokenedHosts]:
    common: dict[str, Any] = {"transport": "tcp", "readers": READERS}
    sopts = daemon_config(node_id="trainer", **common)
    mopts = daemon_config(node_id="host-a", policy="always", **common)
    src, mirror = Daemon(sopts, secret=SECRET), Daemon(mopts, secret=SECRET)
    async with tokened_hosts(tmp, src, mirror) as h:
        yield h


async def mirrored(h: TokenedHosts) -> str:
    """v1 of ``m`` published at the source and pulled through the mirror host (which
    mirrors it); the source lease the pull read under."""
    info = await h.sc.create_region(NBYTES, label="src")
    with SharedSegment.attach(info.handle, NBYTES) as seg:
        seg.numpy()[:] = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8)
    t = TensorEntry("w", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), info.region_id, 0)])
    await h.sc.publish(ManifestIn(MODEL, 1, 0, 1, [t]))
    lease = await h.sc.acquire_lease(MODEL, 1, 600.0)
    dst = await h.mc.create_region(NBYTES, label="engine")
    rows = np.array([[info.region_id, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
    req = PullRequest(MODEL, 1, lease.lease_id, DescriptorTable.pack(rows), [], h.source_url)
    assert (await h.mc.pull(req)).path == "shm"  # served from the mirror: it exists
    return lease.lease_id


async def as_b(url: str, path: str) -> tuple[int, Any]:
    headers = {"Authorization": "Bearer token-of-b", "Accept": "application/json"}
    async with aiohttp.ClientSession() as http, http.get(url + path, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def refused_alike(answers: list[tuple[int, Any]]) -> None:
    """Every answer the same 4xx refusal in the error shape."""
    for status, res in answers:
        assert 400 <= status < 500, answers
        assert isinstance(res, dict) and set(res) == {"error", "detail"}, answers
    assert len({s for s, _ in answers}) == 1, answers


async def test_a_non_reader_learns_nothing_of_which_versions_are_mirrored_from_their_state(
    tmp_path: Path,
) -> None:
    async with hosts(tmp_path) as h:
        await mirrored(h)
        answers = [
            await as_b(h.mirror_url, api.MIRROR_STATE.url(model=MODEL, version=v)) for v in (1, 7)
        ]
        refused_alike(answers)


async def test_a_feed_under_a_made_up_lease_is_refused_alike_whether_or_not_the_mirror_exists(
    tmp_path: Path,
) -> None:
    async with hosts(tmp_path) as h:
        await mirrored(h)
        answers = [
            await as_b(
                h.mirror_url,
                api.MIRROR_FEED.url(model=MODEL, version=v) + "?lease=made-up-lease",
            )
            for v in (1, 7)
        ]
        refused_alike(answers)


async def test_a_signed_mirror_lease_request_replayed_is_refused(tmp_path: Path) -> None:
    """The relay's signed request, replayed by tenant b (a reader of m at neither
    daemon, whose own tenants never lease a mirror), once got a second lease: a
    request is granted once (its nonce), and only while fresh (its issue time)."""
    async with hosts(tmp_path) as h:
        at_source = await mirrored(h)
        ask = MirrorLease.fresh(MODEL, 1, at_source, "relay-b", 60.0).signed(SECRET)
        first = await h.mc._send(api.MIRROR_LEASE, ask)
        assert first.model == MODEL
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                h.mirror_url + api.MIRROR_LEASE.url(),
                data=msgspec.msgpack.encode(ask),
                headers={
                    "Authorization": "Bearer token-of-b",
                    "Content-Type": "application/msgpack",
                    "Accept": "application/json",
                },
            ) as r,
        ):
            status, res = r.status, await r.json(content_type=None)
        assert 400 <= status < 500, (status, res)
        assert set(res) == {"error", "detail"}, res


async def test_a_signed_mirror_lease_request_issued_long_ago_or_without_a_nonce_is_refused(
    tmp_path: Path,
) -> None:
    async with hosts(tmp_path) as h:
        at_source = await mirrored(h)
        fresh = MirrorLease.fresh(MODEL, 1, at_source, "relay-b", 60.0)
        for stale in (
            msgspec.structs.replace(fresh, issued_at=fresh.issued_at - 3600),
            msgspec.structs.replace(fresh, issued_at=fresh.issued_at + 3600),
            msgspec.structs.replace(fresh, nonce=""),
        ):
            with pytest.raises(AccessDenied, match="not within 60 s"):
                await h.mc._send(api.MIRROR_LEASE, stale.signed(SECRET))
        assert (await h.mc._send(api.MIRROR_LEASE, fresh.signed(SECRET))).model == MODEL
