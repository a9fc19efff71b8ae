"""Rules on memory, not ids, and an owner for every object (issue 20, classes 1-2).

Two tenants, ``a`` and ``b`` (two bearer tokens), share one real daemon on
127.0.0.1:0; each test is one rule of the threat model (docs/trust.md), named as that
rule, attacked the way a tenant with only the API and the client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from support.daemons import FakeClock, GatedCopier, daemon_config, served, token_file
from support.hostile import rows

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.access.auth import check_startup
from refitd.daemon.app.node import Daemon
from refitd.errors import AccessDenied, ConfigError, ConflictError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PackSpec,
    PullRequest,
    PullState,
    ShardEntry,
    TensorEntry,
    VersionState,
)
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(60)

NBYTES = 128  # one 4x8 float32 tensor


def manifest(
    model: str, region: int, version: int = 1, part: int = 0, parts: int = 1
) -> ManifestIn:
    shard = ShardEntry((0, 0), (4, 8), region, 0)
    return ManifestIn(model, version, part, parts, [TensorEntry("w", (4, 8), "float32", [shard])])


@dataclass
class Tenants:
    daemon: Daemon
    url: str
    a: RefitClient
    b: RefitClient


@contextlib.asynccontextmanager
async def two_tenants(
    tmp: Path,
    *,
    copier: GatedCopier | None = None,
    clock: FakeClock | None = None,
    **options: object,
) -> AsyncIterator[Tenants]:
    tokens = token_file(tmp, {"a": "token-of-a", "b": "token-of-b"})
    opts = daemon_config(node_id="tenants", transport="shm", **options)
    d = Daemon(opts, copier=copier, **({"clock": clock} if clock is not None else {}))
    async with (
        served(d, access=ServerConfig(port=0, token_file=tokens)) as s,
        RefitClient(s.url, token="token-of-a") as a,
        RefitClient(s.url, token="token-of-b") as b,
    ):
        yield Tenants(d, s.url, a, b)


async def ready_model(c: RefitClient, model: str, fill: int = 7) -> int:
    """A READY v1 of ``model`` in a new region of ``c``'s, filled with ``fill``."""
    info = await c.create_region(NBYTES, label=model)
    with SharedSegment.attach(info.handle, info.nbytes) as seg:
        seg.numpy(np.uint8)[:] = fill
    await c.publish(manifest(model, info.region_id))
    return info.region_id


# ---------------------------------------------------------------- rules on memory


async def test_memory_the_daemon_already_holds_is_never_attached_as_a_second_region(
    tmp_path: Path,
) -> None:
    """By its own name, by a hard link, by its owner or another tenant: one memory
    is one region, so no alias walks past the rules of the first id."""
    async with two_tenants(tmp_path) as t:
        src = await ready_model(t.a, "am")
        handle = next(r.handle for r in await t.a.regions() if r.region_id == src)
        link = f"refitd-alias-{os.getpid()}"
        os.link(SHM_DIR / handle, SHM_DIR / link)
        try:
            for who in (t.a, t.b):
                for name in (handle, link):
                    with pytest.raises(ConflictError, match=f"already holds as region {src}"):
                        await who.attach_region(name, NBYTES)
        finally:
            os.unlink(SHM_DIR / link)
        assert [r.region_id for r in await t.a.regions()] == [src]
        # A client's own segment, attached twice, is refused the second time too.
        with SharedSegment.create(NBYTES, "own") as own:
            first = await t.b.attach_region(own.name, NBYTES)
            with pytest.raises(ConflictError, match=f"region {first.region_id}"):
                await t.b.attach_region(own.name, NBYTES)


async def test_without_tokens_a_ready_version_is_not_rewritten_through_an_alias() -> None:
    """The issue's hole: the direct pull into a READY region was 409, the same pull
    through a second id of that memory succeeded."""
    d = Daemon(daemon_config(node_id="alias", transport="shm"))
    async with served(d) as s:
        c = s.client
        src = await ready_model(c, "m", fill=7)
        other = await ready_model(c, "n", fill=9)
        lease = await c.acquire_lease("n", 1, ttl_s=600)
        handle = next(r.handle for r in await c.regions() if r.region_id == src)
        with pytest.raises(ConflictError):
            alias = await c.attach_region(handle, NBYTES)
            await c.pull(
                PullRequest(
                    "n", 1, lease.lease_id, DescriptorTable(rows([other, 0, alias.region_id, 0, 8]))
                )
            )
        seg = d.store.segments[src].numpy(np.uint8)
        assert (seg == 7).all(), "a READY version's bytes changed"


async def test_a_regions_segment_name_and_process_are_shown_only_to_its_owner(
    tmp_path: Path,
) -> None:
    async with two_tenants(tmp_path) as t:
        mine = await t.a.create_region(NBYTES, label="a-secret")
        assert mine.handle
        seen_by_a = {r.region_id: r for r in await t.a.regions()}
        seen_by_b = {r.region_id: r for r in await t.b.regions()}
        assert seen_by_a[mine.region_id].handle == mine.handle
        assert seen_by_a[mine.region_id].process  # the client library names its process
        assert seen_by_b[mine.region_id].handle == ""
        assert seen_by_b[mine.region_id].process == ""
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": "Bearer token-of-b", "Accept": "application/json"}
            async with http.get(f"{t.url}/v1/regions/{mine.region_id}", headers=headers) as r:
                assert (await r.json())["handle"] == ""
        # Records a peer asks for without a lease name no segment either.
        rec = await t.b.peer_regions([mine.region_id])
        assert [r.handle for r in rec.regions] == [""]


async def test_publishing_from_a_region_a_running_pull_writes_is_refused_409_naming_the_pull(
    tmp_path: Path,
) -> None:
    gated = GatedCopier()
    async with two_tenants(tmp_path, copier=gated) as t:
        src = await ready_model(t.a, "m", fill=5)
        lease = await t.a.acquire_lease("m", 1, ttl_s=600)
        dst = await t.a.create_region(NBYTES, label="dst")
        req = PullRequest(
            "m", 1, lease.lease_id, DescriptorTable(rows([src, 0, dst.region_id, 0, NBYTES]))
        )
        started = await t.a.submit_pull(req)
        await gated.entered.wait()
        with pytest.raises(ConflictError, match=f"running pull\\(s\\) {started.pull_id} write it"):
            await t.a.publish(manifest("m2", dst.region_id))
        gated.gate.set()
        assert (await t.a.wait_pull(started.pull_id)).state is PullState.DONE
        assert (await t.a.publish(manifest("m2", dst.region_id))).state is VersionState.READY


async def test_publishing_from_a_staging_region_is_refused_409(tmp_path: Path) -> None:
    async with two_tenants(tmp_path) as t:
        src = await ready_model(t.a, "m")
        lease = await t.a.acquire_lease("m", 1, ttl_s=600)
        spec = PackSpec(src, 0, (4, 8), (8, 1), 4, 0, 0)
        staged = await t.a.peer_pack("m", 1, lease.lease_id, [spec])
        sid = staged.region.region_id
        with pytest.raises(ConflictError, match=f"region {sid} refused: it is a staging region"):
            await t.a.publish(manifest("m2", sid))
        with pytest.raises((AccessDenied, ConflictError)):
            await t.b.publish(manifest("b2", sid))
        assert await t.a.versions("m2") == [] and await t.b.versions("b2") == []


async def test_publishing_from_an_expert_pools_region_is_refused_409(tmp_path: Path) -> None:
    """Else the next ``ensure`` would rewrite the READY version's slot bytes."""
    async with two_tenants(tmp_path) as t:
        pool = await t.a.create_pool("p", layers=1, experts=4, slots=4, row_bytes=[NBYTES // 4])
        for rid in (pool.slot_region, pool.host_region):
            with pytest.raises(ConflictError, match="expert pool 'p'"):
                await t.a.publish(manifest("m", rid))
        assert await t.a.versions("m") == []
        await t.a.ensure("p", 0, [0, 1])


# ---------------------------------------------------------------- owners


async def test_pulls_are_listed_read_and_cancelled_only_by_their_owner(tmp_path: Path) -> None:
    gated = GatedCopier()
    async with two_tenants(tmp_path, copier=gated) as t:
        src = await ready_model(t.a, "m")
        lease = await t.a.acquire_lease("m", 1, ttl_s=600)
        dst = await t.a.create_region(NBYTES, label="dst")
        req = PullRequest(
            "m", 1, lease.lease_id, DescriptorTable(rows([src, 0, dst.region_id, 0, NBYTES]))
        )
        started = await t.a.submit_pull(req)
        await gated.entered.wait()
        assert await t.b.pulls() == []
        with pytest.raises(AccessDenied, match=f"may not read pull {started.pull_id}"):
            await t.b.pull_status(started.pull_id)
        with pytest.raises(AccessDenied, match=f"may not cancel pull {started.pull_id}"):
            await t.b.cancel_pull(started.pull_id)
        assert [p.pull_id for p in await t.a.pulls()] == [started.pull_id]
        gated.gate.set()
        assert (await t.a.wait_pull(started.pull_id)).state is PullState.DONE


async def test_only_a_models_owner_drains_or_retires_it(tmp_path: Path) -> None:
    async with two_tenants(tmp_path) as t:
        await ready_model(t.a, "m")
        for retire in (True, False):
            with pytest.raises(AccessDenied, match="belongs to a"):
                await t.b.wait_drain("m", 1, timeout_s=1, retire=retire)
        assert (await t.a.version("m", 1)).state is VersionState.READY
        assert (
            await t.a.wait_drain("m", 1, timeout_s=1, retire=True)
        ).state is VersionState.RETIRED


async def test_a_model_belongs_to_its_first_publisher_and_nobody_else_publishes_into_it(
    tmp_path: Path,
) -> None:
    async with two_tenants(tmp_path) as t:
        await ready_model(t.a, "m", fill=1)
        b_region = await t.b.create_region(NBYTES, label="intruder")
        with pytest.raises(AccessDenied, match="may not publish into model 'm'"):
            await t.b.publish(manifest("m", b_region.region_id, version=2))
        assert (await t.a.version("m", "latest")).version == 1
        # Nor fill the missing part of the owner's pending version.
        a2 = await t.a.create_region(NBYTES, label="a2")
        await t.a.publish(manifest("m", a2.region_id, version=2, part=0, parts=2))
        with pytest.raises(AccessDenied, match="may not publish into model 'm'"):
            await t.b.publish(manifest("m", b_region.region_id, version=2, part=1, parts=2))
        assert (await t.a.version("m", 2)).state is VersionState.PENDING


async def test_configured_owners_and_readers_decide_who_publishes_and_who_leases(
    tmp_path: Path,
) -> None:
    async with two_tenants(tmp_path, owners=("m=a",), readers=("m=a",)) as t:
        b_region = await t.b.create_region(NBYTES, label="squat")
        with pytest.raises(AccessDenied, match="belongs to a"):
            await t.b.publish(manifest("m", b_region.region_id))  # first, yet not the owner
        await ready_model(t.a, "m")
        with pytest.raises(AccessDenied, match="may not lease model 'm'"):
            await t.b.acquire_lease("m", 1)
        with pytest.raises(AccessDenied):
            await t.b.manifest("m", 1)
        with pytest.raises(AccessDenied):
            await t.b.versions("m")
        await t.a.acquire_lease("m", 1)
        # A model the config does not list is read by everyone.
        await ready_model(t.a, "open")
        await t.b.acquire_lease("open", 1)


async def test_a_staging_region_is_its_leases_and_a_lease_reads_only_the_bytes_packed_for_it(
    tmp_path: Path,
) -> None:
    """A reused staging region once let a 16-byte pack read 65,520 bytes of another
    tenant's retired version: its scope was the whole region, never cleared."""
    big = 64 << 10
    async with two_tenants(tmp_path) as t:
        a_src = (await t.a.create_region(big, label="a-big")).region_id
        d = t.daemon
        d.store.segments[a_src].numpy(np.uint8)[:] = 0xAB
        shard = ShardEntry((0,), (big,), a_src, 0)
        await t.a.publish(ManifestIn("am", 1, 0, 1, [TensorEntry("w", (big,), "uint8", [shard])]))
        a_lease = await t.a.acquire_lease("am", 1, ttl_s=600)
        staged = await t.a.peer_pack(
            "am", 1, a_lease.lease_id, [PackSpec(a_src, 0, (big,), (1,), 1, 0, 0)]
        )
        sid = staged.region.region_id
        await t.a.peer_drop(sid, a_lease.lease_id)  # back to the pool, holding a's bytes
        b_src = await ready_model(t.b, "bm", fill=3)
        b_lease = await t.b.acquire_lease("bm", 1, ttl_s=600)
        theirs = await t.b.peer_pack(
            "bm", 1, b_lease.lease_id, [PackSpec(b_src, 0, (16,), (1,), 1, 0, 0)]
        )
        assert theirs.region.region_id != sid  # pooled for a's lease alone
        rec = await t.b.peer_regions([theirs.region.region_id], b_lease.lease_id, "bm", 1)
        assert rec.scope[theirs.region.region_id] == [(0, 16)]
        # a's own lease packs 16 bytes again: the pool's region, its tail zeroed.
        d.store.segments[a_src].numpy(np.uint8)[:16] = 3
        small = await t.a.peer_pack(
            "am", 1, a_lease.lease_id, [PackSpec(a_src, 0, (16,), (1,), 1, 0, 0)]
        )
        assert small.region.region_id == sid  # reused
        assert small.region.owner == "a"
        rec = await t.a.peer_regions([sid], a_lease.lease_id, "am", 1)
        assert rec.scope[sid] == [(0, 16)]
        view = d.store.segments[sid].numpy(np.uint8)
        assert (view[:16] == 3).all() and not view[16:].any(), "the first pack survived the reuse"


async def test_over_tcp_a_daemon_with_a_unix_socket_and_no_tokens_serves_only_public_paths(
    tmp_path: Path,
) -> None:
    """Else a uid the socket refuses would go round it over TCP as 'loopback'."""
    sock = tmp_path / "refitd.sock"
    access = ServerConfig(port=0, unix_socket=str(sock), allowed_uids=(12345,))
    opts = daemon_config(unix_socket=str(sock), node_id="sock", transport="shm")
    async with (
        served(Daemon(opts), access=access) as s,
        RefitClient("http://localhost", unix_path=str(sock)) as unix,
    ):
        tcp = s.client
        assert await tcp.health() == {"status": "ok"}
        with pytest.raises(AccessDenied, match="over TCP refused"):
            await tcp.create_region(NBYTES)
        with pytest.raises(AccessDenied, match="over TCP refused"):
            await tcp.regions()
        region = await unix.create_region(NBYTES)
        assert region.owner == f"uid:{os.getuid()}"


# ---------------------------------------------------------------- found by the hostile pass

NOBODY = 65534

ATTACH_AS = """
import json, socket, sys
body = json.dumps({"handle": sys.argv[2], "nbytes": int(sys.argv[3])}).encode()
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(
    b"POST /v1/regions/attach HTTP/1.0\\r\\nHost: refitd\\r\\nContent-Type: application/json"
    + b"\\r\\nContent-Length: " + str(len(body)).encode() + b"\\r\\n\\r\\n" + body
)
data = b""
while chunk := s.recv(65536):
    data += chunk
sys.stdout.write(data.decode())
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="refitd-own-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_a_socket_uid_attaches_only_segments_it_owns_never_the_daemons_files(
    shared_dir: Path,
) -> None:
    """The daemon opens files its caller cannot (its own user's, its group's): it must
    not map another user's unattached segment on a socket caller's behalf."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(python, os.X_OK):
        pytest.skip("needs root and a system python3 to connect as another uid")
    sock = str(shared_dir / "refitd.sock")
    access = ServerConfig(port=0, unix_socket=sock, allowed_uids=(NOBODY,))
    opts = daemon_config(unix_socket=sock, node_id="sock", transport="shm")
    d = Daemon(opts)
    async with served(d, access=access):
        os.chmod(sock, 0o777)
        with SharedSegment.create(NBYTES, "daemons-user") as theirs:  # root's, unattached
            proc = await asyncio.create_subprocess_exec(
                python, "-c", ATTACH_AS, sock, theirs.name, str(NBYTES),
                user=NOBODY, stdout=subprocess.PIPE,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        reply = out.decode()
        assert reply.startswith("HTTP/1.0 403"), reply
        assert f"belongs to uid 0, not to the caller's uid {NOBODY}" in reply
        assert len(d.store.regions) == 0


@pytest.mark.parametrize("name", ["loopback", "uid:0", "uid:1000"])
def test_a_token_named_as_another_kind_of_principal_stops_the_start(
    tmp_path: Path, name: str
) -> None:
    """Else a token named 'uid:0' would own what the socket's uid 0 made."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{name} some-token\n")
    tokens.chmod(0o600)
    with pytest.raises(ConfigError, match="another kind of principal"):
        check_startup(ServerConfig(port=0, token_file=str(tokens)))


async def test_expert_pools_are_listed_only_to_their_owner(tmp_path: Path) -> None:
    async with two_tenants(tmp_path) as t:
        await t.a.create_pool("a-pool", layers=1, experts=2, slots=2, row_bytes=[16])
        assert await t.b.pools() == []
        assert [p.name for p in await t.a.pools()] == ["a-pool"]
        with pytest.raises(AccessDenied):
            await t.b.pool("a-pool")


async def test_a_staging_region_whose_lease_ended_mid_read_is_never_repacked_for_another(
    tmp_path: Path,
) -> None:
    """A reader that lets its lease expire while its pull still reads the staging
    region must not then read what the daemon packs there for another tenant."""
    gated, clock = GatedCopier(), FakeClock()
    async with two_tenants(tmp_path, copier=gated, clock=clock) as t:
        a_src = await ready_model(t.a, "am", fill=1)
        a_lease = await t.a.acquire_lease("am", 1, ttl_s=60)
        dst = await t.a.create_region(NBYTES, label="dst")
        spec = PackSpec(a_src, 0, (NBYTES,), (1,), 1, dst.region_id, 0)
        empty = DescriptorTable(np.zeros((0, 5), dtype="<i8").tobytes())
        started = await t.a.submit_pull(PullRequest("am", 1, a_lease.lease_id, empty, [spec]))
        await gated.entered.wait()  # a's pull reads its staging region now
        clock.now += 61  # ... and its lease has ended
        b_src = await ready_model(t.b, "bm", fill=2)
        b_lease = await t.b.acquire_lease("bm", 1, ttl_s=600)
        b_spec = PackSpec(b_src, 0, (16,), (1,), 1, 0, 0)
        await t.b.peer_pack("bm", 1, b_lease.lease_id, [b_spec])
        gated.gate.set()
        with pytest.raises(ConflictError, match="lease"):  # it ended while bytes moved
            await t.a.wait_pull(started.pull_id)
        got = t.daemon.store.segments[dst.region_id].numpy(np.uint8)
        assert not (got == 2).any(), "a's destination received b's packed bytes"
