"""The relay's holder book admits only peer daemons, bounded in size and work, and a
holder that does not answer is skipped without waiting out a pull's deadline.

A join (``POST /v1/mirrors/holders``) is a record signed with the deployment secret,
like every record one daemon believes from another: a principal of the daemon's HTTP
API who does not hold the secret cannot put a URL in the book. Its fields and its
body are bounded and refused before any work, and the book keeps a bounded number of
holders per version; a holder a joiner reports failed leaves the book.

Real daemons: in this process on 127.0.0.1:0 for the book, spawned processes reading
over ``tcp`` for the stopped relay.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import daemon_config, served

from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon
from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.chunks import MAX_HOLDERS
from refitd.wire import MSGPACK, ManifestIn, ShardEntry, TensorEntry
from refitd.wire.mirrors import HolderAssign, HolderJoin
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"relay-trust-secret-0123456789abcd"
MODEL = "m"


@contextlib.asynccontextmanager
async def source() -> AsyncIterator[tuple[str, RefitClient]]:
    """A daemon holding READY version 1 of ``MODEL``, trusting every daemon on
    127.0.0.1 (any port) as a peer."""
    opts = daemon_config(node_id="source", transport="shm", allow=("http://127.0.0.1:*",))
    async with served(Daemon(opts, secret=SECRET)) as s:
        url, c = s.url, s.client
        info = await c.create_region(4096, label="w")
        t = TensorEntry("w", (4096,), "uint8", [ShardEntry((0,), (4096,), info.region_id, 0)])
        await c.publish(ManifestIn(MODEL, 1, 0, 1, [t]))
        yield url, c


def join(url: str, exclude: list[str] | None = None, secret: bytes = SECRET) -> HolderJoin:
    return HolderJoin(MODEL, 1, url, "n", exclude or []).signed(secret)


async def post(base: str, body: bytes) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{base}/v1/mirrors/holders", data=body, headers={"Content-Type": MSGPACK}) as resp,
    ):
        raw = await resp.read()
        try:
            got = msgspec.msgpack.decode(raw) if raw else {}
        except msgspec.DecodeError:
            got = msgspec.json.decode(raw)
        return resp.status, got if isinstance(got, dict) else {"value": got}


async def holders(base: str) -> list[str]:
    """The book of version 1, as a signed join of a holder already in it reports."""
    status, got = await post(base, msgspec.msgpack.encode(join("http://127.0.0.1:1")))
    assert status == 200, got
    return msgspec.convert(got, HolderAssign).holders


async def test_a_join_without_the_deployment_secret_is_refused_and_the_book_is_unchanged() -> None:
    async with source() as (base, _):
        before = await holders(base)
        unsigned = HolderJoin(MODEL, 1, "http://127.0.0.1:9", "n", [])
        forged = join("http://127.0.0.1:9", secret=b"another-deployment-secret-000000")
        for j in (unsigned, forged):
            status, got = await post(base, msgspec.msgpack.encode(j))
            assert status == 403 and got["error"] == "AccessDenied", got
            assert "deployment secret" in str(got["detail"])
        assert await holders(base) == before


async def test_a_join_body_past_its_bound_is_refused_before_it_is_read() -> None:
    async with source() as (base, c):
        huge = join("http://127.0.0.1:9", [f"http://127.0.0.1:{i}" for i in range(60_000)])
        body = msgspec.msgpack.encode(huge)
        assert len(body) > 1 << 20
        status, got = await post(base, body)
        assert status == 413 and got["error"] == "RequestTooLarge", got
        assert (await c.health()) is not None
        assert "http://127.0.0.1:9" not in await holders(base)


@pytest.mark.parametrize(
    "fields",
    [
        {"url": "http://127.0.0.1:9/" + "x" * 4000},
        {"node_id": "n" * 4000},
        {"model": "m" * 4000},
        {"exclude": [f"http://127.0.0.1:{i}" for i in range(200)]},
    ],
    ids=["url", "node-id", "model", "exclude"],
)
async def test_a_join_with_a_field_past_its_bound_is_refused_in_the_error_shape(
    fields: dict[str, object],
) -> None:
    async with source() as (base, _):
        raw = msgspec.to_builtins(join("http://127.0.0.1:9"))
        assert isinstance(raw, dict)
        raw.update(fields)
        status, got = await post(base, msgspec.msgpack.encode(raw))
        assert status == 400 and got["error"] == "ProtocolError", got


async def test_the_book_keeps_a_bounded_number_of_holders_per_version() -> None:
    async with source() as (base, _):
        for port in range(2, MAX_HOLDERS + 20):
            status, got = await post(base, msgspec.msgpack.encode(join(f"http://127.0.0.1:{port}")))
            assert status == 200, got
            assert len(msgspec.convert(got, HolderAssign).holders) <= MAX_HOLDERS
        assert len(await holders(base)) <= MAX_HOLDERS


async def test_a_holder_a_joiner_reports_failed_is_no_longer_handed_out() -> None:
    async with source() as (base, _):
        status, got = await post(base, msgspec.msgpack.encode(join("http://127.0.0.1:2")))
        first = msgspec.convert(got, HolderAssign)
        assert status == 200 and first.seeders == ["http://127.0.0.1:2"] and first.deal
        status, got = await post(
            base, msgspec.msgpack.encode(join("http://127.0.0.1:3", ["http://127.0.0.1:2"]))
        )
        assert status == 200
        status, got = await post(base, msgspec.msgpack.encode(join("http://127.0.0.1:4")))
        a = msgspec.convert(got, HolderAssign)
        assert "http://127.0.0.1:2" not in a.holders
        named = {a.seeders[d] for d in a.deal}
        assert named == {"http://127.0.0.1:3"}  # the failed one's chunks: the joiner's now


# ---------------------------------------------------------------- a holder that does not answer

NBYTES = 8 << 20


def pattern(n: int, version: int) -> np.ndarray:
    words = np.arange((n + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words + np.uint64(version)).view(np.uint8)[:n]


@pytest.mark.timeout(150)
async def test_a_stopped_relay_is_skipped_long_before_the_pull_deadline(secret_file: str) -> None:
    """Host B's pull deadline is ten minutes; its relay, host A, is stopped. B's mirror
    still completes, from the source, within this test's safety net: a holder that
    does not answer costs a relay's answer deadline, not a pull's."""
    from refitd.wire import DescriptorTable, PullRequest
    from refitd.wire import routes as api

    common = ["--set", "peers.allow=http://127.0.0.1:*", "--set", "mirrors.policy=always"]
    slow = ["--set", "data_plane.pull_timeout_s=600"]
    async with contextlib.AsyncExitStack() as stack:
        spawned = [
            await stack.enter_async_context(
                spawn_daemon(
                    secret_file=secret_file,
                    transport="tcp",
                    node_id=name,
                    extra_args=[*common, *(slow if name == "host-b" else [])],
                )
            )
            for name in ("trainer", "host-a", "host-b")
        ]
        t, a, _ = spawned
        tc, ac, bc = [await stack.enter_async_context(RefitClient(d.url)) for d in spawned]
        region = await tc.create_region(NBYTES, label="src")
        with SharedSegment.attach(region.handle, NBYTES) as seg:
            seg.numpy()[:] = pattern(NBYTES, 1)
        tensor = TensorEntry(
            "blob", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), region.region_id, 0)]
        )
        await tc.publish(ManifestIn(MODEL, 1, 0, 1, [tensor]))

        async def refit(local: RefitClient) -> None:
            lease = await tc.acquire_lease(MODEL, 1, 120.0)
            dst = await local.create_region(NBYTES, label="engine")
            rows = np.array([[region.region_id, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
            req = PullRequest(MODEL, 1, lease.lease_id, DescriptorTable.pack(rows), [], t.url)
            await local.pull(req)
            with SharedSegment.attach(dst.handle, NBYTES) as seg:
                assert np.array_equal(seg.numpy(), pattern(NBYTES, 1))
            await tc.release_lease(lease.lease_id)

        await refit(ac)  # host A holds the mirror, and is in the book
        os.kill(a.pid, signal.SIGSTOP)
        try:
            await refit(bc)
            st = await bc._send(api.MIRROR_STATE, model=MODEL, version=1)
            assert st.complete and st.tried == [a.url, t.url]
        finally:
            os.kill(a.pid, signal.SIGCONT)
