"""The etcd cluster registry: registration, discovery, push of new versions, the
registry as the peer allow-list, leaving within the lease TTL, and re-registering
after etcd restarts. A real etcd server and real daemons on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from support.daemons import GatedCopier, daemon_config, serving_daemons
from support.etcd import key_event, needs_etcd, serving_etcd
from support.toy import publish_tensor, pull_rows

from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon
from refitd.cluster.directory import daemon_key, source_key
from refitd.config import RegistryConfig
from refitd.daemon.app.node import Daemon
from refitd.errors import NotFoundError, ProtocolError, TransportError
from refitd.wire import (
    DaemonRecord,
    PullState,
)
from transports.segments import SharedSegment

pytestmark = [needs_etcd, pytest.mark.timeout(120)]

SECRET = b"s" * 32
TTL = 2.0


@pytest_asyncio.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[object]:
    async with serving_etcd(tmp_path / "etcd") as server:
        yield server


def daemon(etcd: object, node: str, **kw: object) -> Daemon:
    reg = RegistryConfig(kind="etcd", endpoints=(etcd.endpoint,), lease_ttl_s=TTL)  # type: ignore[attr-defined]
    opts = daemon_config(node_id=node, transport="shm", registry=reg)
    return Daemon(opts, secret=SECRET, **kw)  # type: ignore[arg-type]


async def publish(c: RefitClient, model: str, version: int, fill: int = 7) -> int:
    src = await c.create_region(64)
    SharedSegment.attach(src.handle, 64).numpy()[:] = fill
    await publish_tensor(c, model, version, src.region_id, 64)
    return src.region_id


async def test_an_engine_daemon_finds_the_daemon_holding_a_version_and_every_registered_peer(
    etcd: object,
) -> None:
    async with serving_daemons(daemon(etcd, "trainer"), daemon(etcd, "engine")) as (ct, ce):
        await publish(ct, "m", 1)
        found = await ce.next_version("m", after=0, timeout_s=30)
        assert found.version == 1 and found.complete
        assert [(h.node_id, h.url, h.parts) for h in found.holders] == [
            ("trainer", ct.base_url, [0])
        ]
        latest = await ce.cluster_version("m", "latest")
        assert latest.version == 1
        assert {d.node_id for d in await ce.cluster_daemons()} == {"trainer", "engine"}


async def test_a_waiting_engine_is_told_of_a_new_version_as_it_is_published(
    etcd: object,
) -> None:
    async with serving_daemons(daemon(etcd, "trainer"), daemon(etcd, "engine")) as (ct, ce):
        await publish(ct, "m", 1)
        assert (await ce.next_version("m", after=0, timeout_s=30)).version == 1
        waiting = asyncio.create_task(ce.next_version("m", after=1, timeout_s=60))
        await asyncio.sleep(0)
        assert not waiting.done()
        await publish(ct, "m", 2)
        got = await waiting  # one request, answered when the watch delivers the put
        assert got.version == 2 and got.complete
        with pytest.raises(NotFoundError, match="newer than 2"):
            await ce.next_version("m", after=2, timeout_s=0.2)


async def test_a_pull_from_a_daemon_not_in_the_registry_is_refused_naming_it(
    etcd: object,
) -> None:
    outsider = Daemon(daemon_config(node_id="outsider", transport="shm"), secret=SECRET)
    # Served apart: serving_daemons makes the daemons it serves together trust each other.
    async with serving_daemons(daemon(etcd, "engine")) as (ce,), serving_daemons(outsider) as (co,):
        region = await publish(co, "m", 1)
        lease = await co.acquire_lease("m", 1)
        dst = await ce.create_region(64)
        req = pull_rows(
            "m", 1, lease.lease_id, (region, 0, dst.region_id, 0, 64), source=co.base_url
        )
        with pytest.raises(ProtocolError, match="is not a trusted peer of this daemon"):
            await ce.submit_pull(req)


async def test_a_registry_record_not_signed_with_the_deployment_secret_is_not_trusted(
    etcd: object,
) -> None:
    import aetcd

    outsider = Daemon(daemon_config(node_id="forged", transport="shm"), secret=SECRET)
    async with (
        serving_daemons(daemon(etcd, "trainer"), daemon(etcd, "engine")) as (ct, ce),
        serving_daemons(outsider) as (co,),
    ):
        forged = DaemonRecord("forged", co.base_url, 1, "shm").signed(b"x" * 32)
        async with aetcd.Client(etcd.host, etcd.port) as c:  # type: ignore[attr-defined]
            await c.put(daemon_key("/refitd", "forged").encode(), msgspec.msgpack.encode(forged))
        # Watch events arrive in order: once the engine sees this later version, it
        # has seen (and judged) the forged record too.
        await publish(ct, "m", 1)
        await ce.next_version("m", after=0, timeout_s=30)
        assert "forged" not in {d.node_id for d in await ce.cluster_daemons()}
        region = await publish(co, "n", 1)
        lease = await co.acquire_lease("n", 1)
        req = pull_rows("n", 1, lease.lease_id, (region, 0, region, 0, 1), source=co.base_url)
        with pytest.raises(ProtocolError, match="is not a trusted peer of this daemon"):
            await ce.submit_pull(req)


async def test_a_pull_from_a_daemon_that_leaves_the_registry_fails_naming_it(
    etcd: object,
) -> None:
    gate = GatedCopier()
    trainer = daemon(etcd, "trainer")
    engine = daemon(etcd, "engine", copier=gate)
    async with serving_daemons(trainer, engine) as (ct, ce):
        region = await publish(ct, "m", 1)
        await ce.next_version("m", after=0, timeout_s=30)
        lease = await ct.acquire_lease("m", 1)
        with SharedSegment.create(64, "dst") as seg:
            dst = await ce.attach_region(seg.name, 64)
            row = (region, 0, dst.region_id, 0, 64)
            req = pull_rows("m", 1, lease.lease_id, row, source=ct.base_url)
            job = await ce.submit_pull(req)
            await gate.entered.wait()
            # The trainer's lease ends (as when it expires): the engine's daemon
            # fails the pull reading from it at once, naming it.
            await end_lease(etcd, "trainer")
            with pytest.raises(TransportError) as failed:
                await asyncio.wait_for(ce.wait_pull(job.pull_id), 30)
            gate.gate.set()
            assert (await ce.pull_status(job.pull_id)).state is PullState.FAILED
            detail = str(failed.value)
            assert "'trainer'" in detail and ct.base_url in detail
            assert "left the cluster registry" in detail
            assert not seg.numpy().any()
        assert (await ce.health())["status"] == "ok"


async def end_lease(etcd: object, node: str) -> None:
    """Revoke the etcd lease ``node`` registered under, as if it had expired."""
    import aetcd

    async with aetcd.Client(etcd.host, etcd.port) as c:  # type: ignore[attr-defined]
        got = await c.get(daemon_key("/refitd", node).encode())
        assert got is not None
        await c.revoke_lease(got.lease)


def registry_args(etcd: object) -> list[str]:
    return [
        "--set",
        "registry.kind=etcd",
        "--set",
        f"registry.endpoints={etcd.endpoint}",  # type: ignore[attr-defined]
        "--set",
        f"registry.lease_ttl_s={TTL}",
    ]


async def test_a_daemon_that_dies_is_gone_from_the_registry_within_its_lease_ttl(
    etcd: object, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    async with (
        serving_daemons(daemon(etcd, "engine")) as (ce,),
        spawn_daemon(
            secret_file=str(secret),
            transport="shm",
            node_id="doomed",
            extra_args=registry_args(etcd),
        ) as doomed,
    ):
        await key_event(etcd, daemon_key("/refitd", "doomed"), "PUT", 30)  # type: ignore[arg-type]
        async with RefitClient(doomed.url) as cd:
            region = await publish(cd, "m", 1)
            lease = await cd.acquire_lease("m", 1)
        assert (await ce.next_version("m", after=0, timeout_s=30)).holders[0].node_id == "doomed"
        os.kill(doomed.pid, signal.SIGKILL)  # no deregistration: only the TTL can tell
        t = time.perf_counter()
        await key_event(etcd, daemon_key("/refitd", "doomed"), "DELETE", 30)  # type: ignore[arg-type]
        assert time.perf_counter() - t <= TTL + 3.0  # etcd expires leases every 0.5 s
        # Watch events arrive in order: once the engine sees a later write, it has
        # seen the delete.
        await publish(ce, "barrier", 1)
        await ce.next_version("barrier", after=0, timeout_s=30)
        assert "doomed" not in {d.node_id for d in await ce.cluster_daemons()}
        with pytest.raises(NotFoundError, match="no registered daemon holds 'm' version 1"):
            await ce.cluster_version("m", 1)
        # A new pull naming it is refused before anything is contacted, naming it.
        dst = await ce.create_region(64)
        req = pull_rows(
            "m", 1, lease.lease_id, (region, 0, dst.region_id, 0, 64), source=doomed.url
        )
        with pytest.raises(ProtocolError, match=f"source '{doomed.url}' refused"):
            await ce.submit_pull(req)


async def test_daemons_register_again_and_republish_after_etcd_restarts_empty(
    tmp_path: Path,
) -> None:
    from refitd.cluster.etcdserver import _free_port

    port = _free_port("127.0.0.1")
    async with serving_etcd(tmp_path / "etcd1", port=port) as first:
        trainer, engine = daemon(first, "trainer"), daemon(first, "engine")
        async with serving_daemons(trainer, engine) as (ct, ce):
            await publish(ct, "m", 1)
            await ce.next_version("m", after=0, timeout_s=30)
            first.kill()
            await first.proc.wait()
            # A new etcd on the same address that lost everything (the worst case).
            async with serving_etcd(tmp_path / "etcd2", port=port) as second:
                for node in ("trainer", "engine"):
                    await key_event(second, daemon_key("/refitd", node), "PUT", 60)
                await key_event(second, source_key("/refitd", "m", 1, "trainer"), "PUT", 30)
                found = await ce.next_version("m", after=0, timeout_s=30)
                assert [h.node_id for h in found.holders] == ["trainer"]
                await publish(ct, "m", 2)
                assert (await ce.next_version("m", after=1, timeout_s=30)).version == 2


async def test_a_daemon_stopped_gracefully_leaves_the_registry_at_once(
    etcd: object, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    args = [*registry_args(etcd), "--set", "registry.lease_ttl_s=60"]
    async with spawn_daemon(
        secret_file=str(secret), transport="shm", node_id="leaving", extra_args=args
    ):
        await key_event(etcd, daemon_key("/refitd", "leaving"), "PUT", 30)  # type: ignore[arg-type]
        t = time.perf_counter()
    # SIGTERM: the daemon revoked its lease on the way out, long before the 60 s TTL.
    await key_event(etcd, daemon_key("/refitd", "leaving"), "DELETE", 30)  # type: ignore[arg-type]
    assert time.perf_counter() - t < 20


async def test_a_registry_that_cannot_register_refuses_to_start_naming_the_endpoint() -> None:
    from refitd.cluster.etcd import EtcdRegistry
    from refitd.cluster.etcdserver import _free_port

    port = _free_port("127.0.0.1")  # nothing listens there
    reg = EtcdRegistry([f"http://127.0.0.1:{port}"], "/refitd", SECRET, start_timeout_s=1.0)
    with pytest.raises(TransportError, match=f"etcd registry at 127.0.0.1:{port} did not accept"):
        await reg.start(DaemonRecord("x", "http://127.0.0.1:1", 1, "shm"))


@needs_etcd
async def test_etcd_started_on_a_port_another_process_took_meanwhile_starts_again_on_another(
    tmp_path: Path,
) -> None:
    """The race a busy machine runs: a port picked free is bound by someone else before
    etcd binds it. The picker (our interface) hands out a port a real listening socket
    holds, first for the client and then for the peer; etcd must come up all the same,
    on ports nobody held."""
    import socket

    from refitd.cluster.etcdserver import _free_port, run_etcd

    with socket.socket() as held_client, socket.socket() as held_peer:
        held = []
        for s in (held_client, held_peer):
            s.bind(("127.0.0.1", 0))
            s.listen()
            held.append(s.getsockname()[1])
        handed = iter(held)

        def pick(host: str) -> int:
            return next(handed, None) or _free_port(host)

        async with run_etcd(tmp_path / "etcd", pick_port=pick) as server:
            assert server.port not in held
            import aetcd

            async with aetcd.Client(server.host, server.port, timeout=5) as c:
                await c.put(b"k", b"v")
                assert (await c.get(b"k")).value == b"v"
