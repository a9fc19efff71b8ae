"""The daemon the hostile-input tests attack, and what they send it.

``hostile_daemon()`` serves a real daemon on 127.0.0.1:0 (shared-memory data plane,
no UCX) with version 1 of a toy model published and leased, and a destination region
that must stay zero under refused requests; when the block ends it checks that the
daemon still answers health and executes a valid local pull byte-exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import numpy as np

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.wire import (
    MSGPACK,
    DescriptorTable,
    ManifestIn,
    PullRequest,
    ShardEntry,
    TensorEntry,
)
from support.daemons import FakeClock, daemon_config, served
from transports.segments import SharedSegment

#: the test daemon's request size limit in bytes: a million descriptor rows (40 MB) exceed it
MAX_BODY = 4 << 20
#: the toy tensor 'w' is 4x8 float32: 128 bytes in a 128-byte daemon-owned region
W_BYTES = 128


@dataclass
class Env:
    client: RefitClient
    http: aiohttp.ClientSession
    url: str
    daemon: Daemon
    clock: FakeClock  # the daemon's clock: leases expire only when a test moves it
    src: int  # region holding version 1 of 'toy'
    dst: int  # the test's destination region (must stay zero under refused pulls)
    dseg: SharedSegment
    lease: str
    expected: np.ndarray  # the source bytes a valid pull must deliver

    async def send(
        self, method: str, path: str, data: bytes | None = None, ctype: str | None = MSGPACK
    ) -> tuple[int, dict[str, Any]]:
        """Send raw ``data``; return the status and the decoded JSON error body."""
        headers = {"Content-Type": ctype} if ctype else {}
        async with self.http.request(method, self.url + path, data=data, headers=headers) as r:
            raw = await r.read()
        try:
            return r.status, (msgspec.json.decode(raw) if raw else {})
        except msgspec.DecodeError:  # not our error shape (e.g. aiohttp's own 500 page)
            return r.status, {"raw": raw[:200]}

    async def refused(
        self,
        method: str,
        path: str,
        value: Any = None,
        *,
        raw: bytes | None = None,
        ctype: str | None = MSGPACK,
        status: int | tuple[int, ...] | None = None,
    ) -> str:
        """Send ``value`` (msgpack-encoded) or ``raw``; assert a 4xx in the error shape.

        Returns the refusal's detail so a test can check it names what was refused."""
        data = raw if raw is not None else msgspec.msgpack.encode(value)
        code, body = await self.send(method, path, data, ctype)
        assert 400 <= code < 500, (code, body)
        if status is not None:
            assert code in ((status,) if isinstance(status, int) else status), (code, body)
        assert isinstance(body.get("error"), str) and body["error"], body
        assert isinstance(body.get("detail"), str) and body["detail"], body
        return str(body["detail"])


def toy_manifest(region: int, version: int = 1, part: int = 0, parts: int = 1) -> ManifestIn:
    return ManifestIn(
        "toy",
        version,
        part,
        parts,
        [TensorEntry("w", (4, 8), "float32", [ShardEntry((0, 0), (4, 8), region, 0)])],
    )


def rows(*rs: list[int]) -> bytes:
    return np.array(rs, dtype="<i8").reshape(-1, 5).tobytes()


def pull_body(env: Env, table: bytes, **kw: Any) -> dict[str, Any]:
    return {
        "model": "toy",
        "version": 1,
        "lease_id": env.lease,
        "descriptors": {"table": table},
        **kw,
    }


@contextlib.asynccontextmanager
async def hostile_daemon() -> AsyncIterator[Env]:
    """A daemon holding version 1 of 'toy' under a lease, and a zeroed destination
    region; on exit, checks that the daemon still serves a valid pull byte-exact and
    that nothing before it wrote into the destination."""
    opts = daemon_config(
        node_id="hostile", transport="shm", max_request_bytes=MAX_BODY, shutdown_grace_s=0.5
    )
    clock = FakeClock()
    daemon = Daemon(opts, clock=clock)
    async with served(daemon) as s, aiohttp.ClientSession() as http:
        c, url = s.client, s.url
        info = await c.create_region(W_BYTES, label="w")
        with SharedSegment.attach(info.handle, info.nbytes) as sseg:
            expected = 1.0 + np.arange(32, dtype=np.float32)
            sseg.numpy(np.float32)[:] = expected
        await c.publish(toy_manifest(info.region_id))
        lease = await c.acquire_lease("toy", 1, ttl_s=600)
        with SharedSegment.create(W_BYTES, "dst") as dseg:
            dinfo = await c.attach_region(dseg.name, W_BYTES, label="dst")
            e = Env(
                c,
                http,
                url,
                daemon,
                clock,
                info.region_id,
                dinfo.region_id,
                dseg,
                lease.lease_id,
                expected,
            )
            yield e
            # The daemon survived, and nothing refused wrote a byte.
            assert (await c.health())["status"] == "ok"
            assert not dseg.numpy(np.uint8).any(), "a refused request wrote into the destination"
            res = await c.pull(
                PullRequest(
                    "toy",
                    1,
                    lease.lease_id,
                    DescriptorTable(rows([info.region_id, 0, dinfo.region_id, 0, W_BYTES])),
                )
            )
            assert res.bytes_done == W_BYTES
            assert np.array_equal(dseg.numpy(np.float32), expected)
