"""The trust model, rule by rule (see ``refitd/daemon/access/trust.py`` and docs/trust.md,
"Rules for everyone"): which sources a daemon contacts, what a lease reads, what a pull
writes, and that a READY version never changes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from aiohttp import web
from support.daemons import GatedCopier, daemon_config, served, serving_app, serving_daemons
from support.hostile import W_BYTES, rows, toy_manifest

from refitd.client.http import RefitClient
from refitd.config import load_config
from refitd.daemon.access.peers import PeerPolicy, normalize_peer
from refitd.daemon.app.node import Daemon
from refitd.daemon.pull.listeners import Caller, PullListener
from refitd.daemon.pull.pulls import LocalSource, PullJob, PullManager
from refitd.errors import AccessDenied, ConfigError, ConflictError, ProtocolError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PackSpec,
    PeerRegions,
    PullRequest,
    PullState,
    ShardEntry,
    StagedPack,
    TensorEntry,
    VersionState,
)
from transports.segments import SharedSegment

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
    async with serving_app(app) as url:
        yield url, seen


@contextlib.asynccontextmanager
async def token_daemon(*peers: str) -> AsyncIterator[tuple[Daemon, RefitClient, int, int, str]]:
    """A daemon that presents ``PEER_TOKEN`` to the peers it reads from, with 'toy' v1
    published and leased; yields (daemon, client, src region, dst region, lease)."""
    d = Daemon(daemon_config(node_id="trusting", transport="shm", allow=peers))
    async with served(d, token=PEER_TOKEN) as s:
        c = s.client
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


# ---------------------------------------------------------------- reads and writes


@dataclass
class Two:
    """One daemon serving two models: 'a' and 'b', each a READY v1 of one 4x8 float32
    tensor in its own 256-byte region (the tensor fills the first 128 bytes; the rest
    of the region is not part of the version), with 'a' leased."""

    daemon: Daemon
    client: RefitClient
    url: str
    a: int
    b: int
    b_seg: SharedSegment
    lease: str
    dst: int
    dst_seg: SharedSegment


def _manifest(model: str, region: int, version: int = 1) -> ManifestIn:
    shard = ShardEntry((0, 0), (4, 8), region, 0)
    return ManifestIn(model, version, 0, 1, [TensorEntry("w", (4, 8), "float32", [shard])])


@contextlib.asynccontextmanager
async def two_models(**kw: object) -> AsyncIterator[Two]:
    d = Daemon(daemon_config(node_id="two", transport="shm"), **kw)  # type: ignore[arg-type]
    async with served(d) as s:
        c, url = s.client, s.url
        regions = {}
        for i, model in enumerate("ab"):
            info = await c.create_region(2 * W_BYTES, label=model)
            with SharedSegment.attach(info.handle, info.nbytes) as seg:
                seg.numpy(np.uint8)[:] = 10 + i
            await c.publish(_manifest(model, info.region_id))
            regions[model] = info
        lease = await c.acquire_lease("a", 1, ttl_s=600)
        b = regions["b"]
        with (
            SharedSegment.attach(b.handle, b.nbytes) as b_seg,
            SharedSegment.create(2 * W_BYTES, "dst") as dst_seg,
        ):
            dst = await c.attach_region(dst_seg.name, dst_seg.size, label="dst")
            yield Two(
                d,
                c,
                url,
                regions["a"].region_id,
                b.region_id,
                b_seg,
                lease.lease_id,
                dst.region_id,
                dst_seg,
            )


def _req(t: Two, *table: list[int], specs: list[PackSpec] | None = None) -> PullRequest:
    return PullRequest("a", 1, t.lease, DescriptorTable(rows(*table)), specs or [])


def _local(d: Daemon) -> LocalSource:
    """Daemon ``d`` as the source of its own pulls, built with the parts it reads."""
    return LocalSource(
        d.plane, d.registry, d.staging, d.leases.leased_regions, d.leases.pack_leased
    )


async def test_a_pull_under_one_models_lease_never_writes_into_another_models_ready_region() -> (
    None
):
    async with two_models() as t:
        with pytest.raises(ConflictError, match=r"region .* holds 'b' version 1, which is ready"):
            await t.client.submit_pull(_req(t, [t.a, 0, t.b, 0, W_BYTES]))
        assert (t.b_seg.numpy(np.uint8) == 11).all()  # b's bytes never changed
        assert (await t.client.version("b", 1)).state is VersionState.READY
        assert await t.client.pulls() == []


async def test_a_pull_never_writes_into_a_pending_version_nor_a_retired_one_still_leased() -> None:
    async with two_models() as t:
        c = t.client
        pending = await c.create_region(W_BYTES, label="pending")
        await c.publish(ManifestIn("p", 1, 0, 2, [_manifest("p", pending.region_id).tensors[0]]))
        with pytest.raises(ConflictError, match="which is pending"):
            await c.submit_pull(_req(t, [t.a, 0, pending.region_id, 0, 8]))
        # 'b' v2 retires v1; a lease taken on v1 before keeps its region protected.
        old = await c.acquire_lease("b", 1, ttl_s=600)
        b2 = await c.create_region(W_BYTES, label="b2")
        await c.publish(_manifest("b", b2.region_id, version=2))
        assert (await c.version("b", 1)).state is VersionState.RETIRED
        with pytest.raises(ConflictError, match=r"which is leased \(retired\)"):
            await c.submit_pull(_req(t, [t.a, 0, t.b, 0, 8]))
        with pytest.raises(ConflictError, match="leased"):
            await c.delete_region(t.b)  # nor is it deleted under that reader
        await c.release_lease(old.lease_id)
        done = await c.pull(_req(t, [t.a, 0, t.b, 0, 8]))  # retired, unleased: writable
        assert done.state is PullState.DONE
        assert (t.b_seg.numpy(np.uint8)[:8] == 10).all()


async def test_a_pull_under_a_lease_never_reads_a_region_outside_that_leases_version() -> None:
    async with two_models() as t:
        c = t.client
        other = await c.create_region(W_BYTES, label="unpublished")
        for src, off in [(t.b, 0), (other.region_id, 0), (t.a, W_BYTES)]:
            with pytest.raises(AccessDenied, match="not part of 'a' version 1"):
                await c.submit_pull(_req(t, [src, off, t.dst, 0, 8]))
        # A read straddling the end of the tensor's bytes is refused as a whole.
        with pytest.raises(AccessDenied, match="descriptor 1 refused"):
            await c.submit_pull(_req(t, [t.a, 0, t.dst, 0, 8], [t.a, W_BYTES - 4, t.dst, 8, 8]))
        with pytest.raises(AccessDenied, match=r"region\(s\) \[\d+\] refused: not part of"):
            await c.submit_pull(_req(t, specs=[PackSpec(t.b, 0, (4, 2), (8, 1), 4, t.dst, 0)]))
        with pytest.raises(AccessDenied, match="pack spec 0 refused"):  # a's bytes past w
            spec = PackSpec(t.a, W_BYTES, (4, 2), (8, 1), 4, t.dst, 0)
            await c.submit_pull(_req(t, specs=[spec]))
        assert await c.pulls() == []
        assert not t.dst_seg.numpy(np.uint8).any()
        done = await c.pull(_req(t, [t.a, 0, t.dst, 0, W_BYTES]))
        assert done.state is PullState.DONE
        assert (t.dst_seg.numpy(np.uint8)[:W_BYTES] == 10).all()


async def test_peer_pack_and_peer_regions_under_a_lease_never_reach_outside_its_version() -> None:
    async with two_models() as t:
        c = t.client
        with pytest.raises(AccessDenied, match="not part of 'a' version 1"):
            await c.peer_pack("a", 1, t.lease, [PackSpec(t.b, 0, (4, 2), (8, 1), 4, 0, 0)])
        with pytest.raises(AccessDenied, match=rf"\[{t.b}\] refused"):
            await c.peer_regions([t.a, t.b], t.lease, "a", 1)
        rec = await c.peer_regions(None, t.lease, "a", 1)
        assert [r.region_id for r in rec.regions] == [t.a]
        assert rec.scope == {t.a: [(0, W_BYTES)]} and rec.lease_id == t.lease
        with pytest.raises(ConflictError, match="unknown or was released"):
            await c.peer_regions([t.a], "l0-forged", "a", 1)


async def test_a_remote_pull_under_a_lease_never_reads_outside_that_leases_version() -> None:
    a = Daemon(daemon_config(node_id="src"), secret=b"k" * 32)
    b = Daemon(daemon_config(node_id="dst"), secret=b"k" * 32)
    async with serving_daemons(a, b) as (ca, cb):
        regions = []
        for model in "ab":
            info = await ca.create_region(W_BYTES, label=model)
            await ca.publish(_manifest(model, info.region_id))
            regions.append(info.region_id)
        lease = await ca.acquire_lease("a", 1)
        dst = await cb.create_region(W_BYTES)
        req = PullRequest(
            "a",
            1,
            lease.lease_id,
            DescriptorTable(rows([regions[1], 0, dst.region_id, 0, 8])),
            [],
            ca.base_url,
        )
        with pytest.raises(AccessDenied, match="not part of 'a' version 1"):
            await cb.submit_pull(req)
        ok = msgspec.structs.replace(
            req, descriptors=DescriptorTable(rows([regions[0], 0, dst.region_id, 0, 8]))
        )
        assert (await cb.pull(ok)).state is PullState.DONE


# ---------------------------------------------------------------- staging


async def test_a_staging_region_is_released_only_by_the_lease_that_packed_it() -> None:
    async with two_models() as t:
        c = t.client
        staged = await c.peer_pack("a", 1, t.lease, [PackSpec(t.a, 0, (4, 2), (8, 1), 4, 0, 0)])
        sid = staged.region.region_id
        other = await c.acquire_lease("a", 1)
        for wrong in (other.lease_id, ""):
            with pytest.raises(AccessDenied, match="packed for another lease"):
                await c.peer_drop(sid, wrong)
        # Nor may anyone else read it: it is in the scope of its own lease only.
        assert sid not in (await c.peer_regions(None, other.lease_id, "a", 1)).scope
        assert (await c.peer_regions([sid], t.lease, "a", 1)).scope[sid] == [
            (0, staged.region.nbytes)
        ]
        with pytest.raises(AccessDenied, match="staging region"):
            await c.delete_region(sid)
        with pytest.raises(AccessDenied, match="staging region"):
            await c.submit_pull(_req(t, [t.a, 0, sid, 0, 8]))
        await c.peer_drop(sid, t.lease)


class LyingSource:
    """A source daemon that packs honestly but reports forged staging offsets: a
    fault a real daemon cannot produce, as an implementation of :class:`Source`."""

    filling = None

    def __init__(self, inner: LocalSource, offsets: list[int]) -> None:
        self.inner = inner
        self.offsets = offsets

    def loopback(self) -> None:
        return None  # another daemon: read over the path chosen for it

    def own(self, ids: list[int]) -> set[int]:
        return set()

    def granted(self, req: PullRequest) -> PeerRegions | None:
        return self.inner.granted(req)

    async def check_lease(self, lease_id: str, model: str, version: int) -> None:
        await self.inner.check_lease(lease_id, model, version)

    async def regions(self, ids: list[int], req: PullRequest) -> PeerRegions:
        return await self.inner.regions(ids, req)

    async def pack(
        self, model: str, version: int, lease_id: str, specs: list[PackSpec]
    ) -> StagedPack:
        staged = await self.inner.pack(model, version, lease_id, specs)
        return StagedPack(staged.region, self.offsets)

    async def drop(self, region_id: int, lease_id: str) -> None:
        await self.inner.drop(region_id, lease_id)


@pytest.mark.parametrize("offset", [-8, 1 << 40, 4096 - 4])
async def test_staged_offsets_a_source_sends_are_checked_like_descriptors_and_nothing_moves(
    offset: int,
) -> None:
    async with two_models() as t:
        liar = "http://liar.invalid:1"
        t.daemon.peers.trust(liar)
        pulls = PullManager(t.daemon, lambda _: LyingSource(_local(t.daemon), [offset]))
        spec = PackSpec(t.a, 0, (4, 2), (8, 1), 4, t.dst, 0)
        job = await pulls.submit(msgspec.structs.replace(_req(t, specs=[spec]), source=liar))
        await job.finished.wait()
        assert job.state is PullState.FAILED, job.snapshot()
        assert job.error is not None and "descriptor 0 refused" in job.error.detail
        assert job.suspect == []  # refused before any byte moved
        assert not t.dst_seg.numpy(np.uint8).any()
        await pulls.close()


# ---------------------------------------------------------------- deletes


async def test_a_region_is_not_deleted_while_a_running_pull_writes_it() -> None:
    gated = GatedCopier()
    async with two_models(copier=gated) as t:
        c = t.client
        started = await c.submit_pull(_req(t, [t.a, 0, t.dst, 0, W_BYTES]))
        await gated.entered.wait()
        with pytest.raises(ConflictError, match="running pull"):
            await c.delete_region(t.dst)
        gated.gate.set()
        assert (await c.wait_pull(started.pull_id)).state is PullState.DONE
        await c.delete_region(t.dst)


# ---------------------------------------------------------------- listeners


class Recorder(PullListener):
    """A listener that writes down what it is told, and refuses one destination."""

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse
        self.told: list[tuple[str, str, str]] = []

    def admit(self, req: PullRequest, caller: Caller) -> None:
        if self.refuse in {int(x) for x in req.descriptors.rows()[:, 2]}:
            raise AccessDenied(f"{caller.name} may not write region {self.refuse}")
        self.told.append(("admit", caller.name, ""))

    def started(self, job: PullJob) -> None:
        self.told.append(("started", job.pull_id, str(job.state)))

    def ended(self, job: PullJob) -> None:
        moved = "all" if job.ended is not None and job.bytes_done == job.bytes_total else "not"
        self.told.append(("ended", job.pull_id, f"{job.state} {moved}"))


async def test_listeners_are_told_of_a_pull_in_order_and_may_refuse_it_before_anything_moves() -> (
    None
):
    async with two_models() as t:
        recorder = Recorder(refuse=t.b)
        pulls = PullManager(t.daemon, lambda _: _local(t.daemon), [recorder])
        with pytest.raises(AccessDenied, match="may not write region"):
            await pulls.submit(_req(t, [t.a, 0, t.b, 0, 8]), Caller("alice"))
        assert recorder.told == [] and pulls.jobs == {}
        job = await pulls.submit(_req(t, [t.a, 0, t.dst, 0, W_BYTES]), Caller("alice"))
        await job.finished.wait()
        assert job.owner == "alice"
        assert recorder.told == [
            ("admit", "alice", ""),
            ("started", job.pull_id, "pending"),
            ("ended", job.pull_id, "done all"),
        ]
        assert (t.dst_seg.numpy(np.uint8)[:W_BYTES] == 10).all()
        await pulls.close()
