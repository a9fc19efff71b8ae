"""A host mirror follows the source's rules: a pull served from it ends as a direct
pull of the same lease would, the mirror's objects have an owner and a bound, and its
routes answer what they must, in the error shape.

Two real daemons in this process on 127.0.0.1:0: a source (the trainer's) and a
mirror host (``mirrors.policy = always``) that reads it over ``tcp``, as another host
would. Where a test must hold the mirrored pull mid-copy, the mirror host's same-host
copier is gated (`support.daemons.GatedCopier`); everything else is real.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from support.daemons import GatedCopier, daemon_config, serving_daemons
from support.mirrorhosts import tokened_hosts

from refitd.client.http import RefitClient
from refitd.daemon.access.auth import TokenBook
from refitd.daemon.app.node import Daemon
from refitd.errors import AccessDenied, ConfigError, NotFoundError, RefitError
from refitd.wire import (
    DescriptorTable,
    LeaseRequest,
    ManifestIn,
    PullRequest,
    PullState,
    RegionInfo,
    ShardEntry,
    TensorEntry,
)
from refitd.wire import routes as api
from refitd.wire.mirrors import MirrorLease
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

SECRET = b"mirror-trust-secret-0123456789abc"
MODEL = "m"
NBYTES = 6 << 20
WAIT_S = 60.0
"""Safety net of a wait on a daemon (never what a test measures)."""


def pattern(version: int) -> np.ndarray:
    words = np.arange(NBYTES // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words + np.uint64(version)).view(np.uint8)


@dataclass
class Hosts:
    source: Daemon
    mirror: Daemon
    sc: RefitClient  # a client of the source daemon
    mc: RefitClient  # a client of the mirror host's daemon
    copier: GatedCopier | None


@contextlib.asynccontextmanager
async def hosts(
    *,
    gated: bool = False,
    tokens: Path | None = None,
    source_readers: tuple[str, ...] = (),
    **mirror_options: object,
) -> AsyncIterator[Hosts]:
    """The two daemons. With ``tokens`` (a folder for their token file) both daemons
    authenticate their clients (`support.mirrorhosts.tokened_hosts`): ``sc`` is
    ``peer`` at the source, ``mc`` is ``a`` at the mirror host; ``source_readers`` are
    the source's ``[models] readers``."""
    copier = GatedCopier() if gated else None
    if copier is not None:
        copier.gate.set()  # open until a test closes it
    sopts = daemon_config(node_id="trainer", transport="tcp", readers=source_readers)
    src = Daemon(sopts, secret=SECRET)
    mopts = daemon_config(node_id="host-a", transport="tcp", policy="always", **mirror_options)
    mirror = Daemon(mopts, secret=SECRET, copier=copier)
    if tokens is None:
        async with serving_daemons(src, mirror) as (sc, mc):
            yield Hosts(src, mirror, sc, mc, copier)
        return
    async with tokened_hosts(tokens, src, mirror) as t:
        yield Hosts(src, mirror, t.sc, t.mc, copier)


async def publish(c: RefitClient, version: int = 1) -> int:
    """Version ``version`` of one tensor in a new region; returns the region id."""
    info = await c.create_region(NBYTES, label=f"src-{version}")
    with SharedSegment.attach(info.handle, NBYTES) as seg:
        seg.numpy()[:] = pattern(version)
    t = TensorEntry("w", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), info.region_id, 0)])
    await c.publish(ManifestIn(MODEL, version, 0, 1, [t]))
    return info.region_id


async def pull_request(
    h: Hosts, src_region: int, lease_id: str, version: int = 1
) -> tuple[PullRequest, RegionInfo]:
    """A pull of the whole tensor into a new region of the mirror host."""
    dst = await h.mc.create_region(NBYTES, label="engine")
    rows = np.array([[src_region, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
    url = h.sc.base_url
    return PullRequest(MODEL, version, lease_id, DescriptorTable.pack(rows), [], url), dst


# ---------------------------------------------------------------- (5) leases


async def test_a_pull_served_from_a_mirror_fails_when_its_lease_is_released_at_the_source_mid_pull() -> (
    None
):
    async with hosts(gated=True) as h:
        assert h.copier is not None
        region = await publish(h.sc)
        # a first engine makes the mirror complete
        first = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, first.lease_id)
        assert (await h.mc.pull(req)).path == "shm"
        await h.sc.release_lease(first.lease_id)
        # a second engine's pull is held mid-copy, from the complete mirror
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id)
        h.copier.gate.clear()
        h.copier.entered.clear()
        started = await h.mc.submit_pull(req)
        async with asyncio.timeout(WAIT_S):
            await h.copier.entered.wait()
        await h.sc.release_lease(lease.lease_id)  # the engine's lease ends at the source
        h.copier.gate.set()
        with pytest.raises(RefitError) as err:
            await h.mc.wait_pull(started.pull_id)
        assert lease.lease_id in str(err.value)
        ended = await h.mc.pull_status(started.pull_id)
        assert ended.state is PullState.FAILED and ended.suspect


async def test_a_pull_whose_lease_ended_while_the_mirror_filled_is_refused_before_a_byte_moves() -> (
    None
):
    async with hosts() as h:
        region = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, dst = await pull_request(h, region, lease.lease_id)
        # the mirror completes for another engine; then this engine's lease ends
        other = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req2, _ = await pull_request(h, region, other.lease_id)
        await h.mc.pull(req2)
        await h.sc.release_lease(lease.lease_id)
        with pytest.raises(RefitError, match="lease"):
            await h.mc.pull(req)
        with SharedSegment.attach(dst.handle, NBYTES) as seg:
            assert not seg.numpy().any(), "a byte moved under an ended lease"


# ---------------------------------------------------------------- (1) owners and budget


async def test_a_tenant_that_owns_nothing_can_neither_publish_into_drain_nor_retire_a_mirrored_model(
    tmp_path: Path,
) -> None:
    async with hosts(tokens=tmp_path) as h:
        region = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id)
        assert (await h.mc.pull(req)).path == "shm"  # read from this host's mirror
        async with RefitClient(h.mc.base_url, token="token-of-b") as b:
            own = await b.create_region(NBYTES, label="b")
            t = TensorEntry(
                "w", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), own.region_id, 0)]
            )
            with pytest.raises(AccessDenied):
                await b.publish(ManifestIn(MODEL, 2, 0, 1, [t]))
            with pytest.raises(AccessDenied):
                await b.wait_drain(MODEL, 1, 1.0, retire=True)
        # tenant a (the engine) cannot take it over either: the daemon holds it
        with pytest.raises(AccessDenied):
            await h.mc.wait_drain(MODEL, 1, 1.0, retire=True)
        versions = h.mirror.registry.versions()
        assert [(v.model, v.version, v.state.value) for v in versions] == [(MODEL, 1, "ready")]
        again = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, again.lease_id)
        assert (await h.mc.pull(req)).path == "shm"


async def test_a_model_a_local_tenant_owns_is_not_mirrored_into_and_the_pull_reads_its_source(
    tmp_path: Path,
) -> None:
    async with hosts(tokens=tmp_path) as h:
        region = await publish(h.sc, 3)
        async with RefitClient(h.mc.base_url, token="token-of-b") as b:
            own = await b.create_region(NBYTES, label="b")
            t = TensorEntry(
                "w", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), own.region_id, 0)]
            )
            await b.publish(ManifestIn(MODEL, 1, 0, 1, [t]))  # b owns "m" on this host
        lease = await h.sc.acquire_lease(MODEL, 3, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id, version=3)
        assert (await h.mc.pull(req)).path == "tcp"
        with pytest.raises(NotFoundError):
            await h.mc._send(api.MIRROR_STATE, model=MODEL, version=3)


async def test_mirrors_past_the_host_budget_are_not_made_and_the_pull_reads_its_source() -> None:
    async with hosts(max_bytes=NBYTES - 1) as h:
        region = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id)
        assert (await h.mc.pull(req)).path == "tcp"
        with pytest.raises(NotFoundError):
            await h.mc._send(api.MIRROR_STATE, model=MODEL, version=1)
        made = [r for r in h.mirror.store.regions if r.owner == "refitd-mirror"]
        assert made == []


async def test_a_mirror_within_the_budget_shows_its_bytes_and_the_budget() -> None:
    async with hosts(max_bytes=2 * NBYTES) as h:
        region = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id)
        assert (await h.mc.pull(req)).path == "shm"
        st = await h.mc._send(api.MIRROR_STATE, model=MODEL, version=1)
        assert (st.nbytes, st.held_bytes, st.budget_bytes) == (NBYTES, NBYTES, 2 * NBYTES)


def test_a_token_may_not_take_the_name_the_daemon_owns_its_mirrors_by(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("refitd-mirror some-token\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="refitd-mirror"):
        TokenBook.load(path)


# ---------------------------------------------------------------- (7) query parameters


@pytest.mark.parametrize(
    "query", ["after=x", "after=1e99", "timeout=x", "timeout=nan", "after=", "version=1"]
)
async def test_a_malformed_query_parameter_of_the_mirror_state_is_a_400_in_the_error_shape(
    query: str,
) -> None:
    async with hosts() as h:
        region = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, lease.lease_id)
        await h.mc.pull(req)  # the mirror exists
        url = f"{h.mc.base_url}/v1/mirrors/{MODEL}/1?{query}"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            body = await r.json(content_type=None)
        if query == "version=1":  # not a parameter of this route: ignored
            assert r.status == 200, body
        else:
            assert r.status == 400, body
            assert body["error"] == "ProtocolError" and body["detail"]


# ---------------------------------------------------------------- (2) readers


async def test_a_tenant_the_source_refuses_cannot_read_the_mirrored_version_on_the_mirror_host(
    tmp_path: Path,
) -> None:
    readers = ("m=a", "m=peer")  # b may not read m at the source, nor its listing here
    async with hosts(tokens=tmp_path, source_readers=readers, readers=readers) as h:
        region = await publish(h.sc)
        async with RefitClient(h.sc.base_url, token="token-of-a") as a_at_source:
            lease = await a_at_source.acquire_lease(MODEL, 1, 60.0)
            req, _ = await pull_request(h, region, lease.lease_id)
            assert (await h.mc.pull(req)).path == "shm"  # a reads through the mirror
            async with RefitClient(h.sc.base_url, token="token-of-b") as b_at_source:
                with pytest.raises(AccessDenied):
                    await b_at_source.acquire_lease(MODEL, 1, 60.0)
            async with RefitClient(h.mc.base_url, token="token-of-b") as b:
                with pytest.raises(AccessDenied):
                    await b.acquire_lease(MODEL, 1, 60.0)
                with pytest.raises(AccessDenied):
                    await b.manifest(MODEL, 1)
                with pytest.raises(AccessDenied):
                    await b._send(api.MIRROR_STATE, model=MODEL, version=1)
                assert [v for v in await b.all_versions() if v.model == MODEL] == []
                mirrored = [r for r in await b.regions() if r.owner == "refitd-mirror"]
                assert mirrored and all(r.label == "mirror" for r in mirrored)


async def test_a_tenant_never_leases_a_mirrored_version_on_its_host_even_under_a_live_source_lease(
    tmp_path: Path,
) -> None:
    """A host's own tenants read a mirrored version only through their daemon's rules
    (a pull naming the source, served from the mirror): no lease on the copy itself."""
    async with hosts(tokens=tmp_path, source_readers=("m=a", "m=b", "m=peer")) as h:
        region = await publish(h.sc)
        at_source = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, at_source.lease_id)
        await h.mc.pull(req)  # the mirror exists
        async with (
            RefitClient(h.sc.base_url, token="token-of-b") as b_at_source,
            RefitClient(h.mc.base_url, token="token-of-b") as b,
        ):
            mine = await b_at_source.acquire_lease(MODEL, 1, 60.0)
            for ask in (
                LeaseRequest(MODEL, 1, 30.0),
                LeaseRequest(MODEL, 1, 30.0, source_lease=mine.lease_id),
            ):
                with pytest.raises(AccessDenied, match="peer daemons"):
                    await b._send(api.ACQUIRE_LEASE, ask)
            # a peer-daemon lease needs the deployment secret, whoever asks
            for forged in (
                MirrorLease(MODEL, 1, mine.lease_id, "b", 30.0),
                MirrorLease(MODEL, 1, mine.lease_id, "b", 30.0).signed(
                    b"not-the-deployment-secret-00000"
                ),
            ):
                with pytest.raises(AccessDenied, match="deployment secret"):
                    await b._send(api.MIRROR_LEASE, forged)
            # its pull through its own daemon is served from the mirror
            dst = await b.create_region(NBYTES, label="b-engine")
            rows = np.array([[region, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
            pull = PullRequest(
                MODEL, 1, mine.lease_id, DescriptorTable.pack(rows), [], h.sc.base_url
            )
            assert (await b.pull(pull)).path == "shm"


async def test_a_peer_daemon_leases_a_mirror_only_under_a_live_lease_at_its_source(
    tmp_path: Path,
) -> None:
    async with hosts(tokens=tmp_path, source_readers=("m=a", "m=peer")) as h:
        region = await publish(h.sc)
        at_source = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, region, at_source.lease_id)
        await h.mc.pull(req)  # the mirror exists
        ask = MirrorLease.fresh(MODEL, 1, at_source.lease_id, "relay-b", 3600.0)
        grant = await h.mc._send(api.MIRROR_LEASE, ask.signed(SECRET))
        assert grant.model == MODEL
        assert grant.expires_in_s <= 60.0  # no longer than the lease at the source has
        await h.sc.release_lease(at_source.lease_id)
        with pytest.raises(AccessDenied, match="source"):  # renewal checks it again
            await h.mc.renew_lease(grant.lease_id, 30.0)
        assert not h.mirror.registry.is_live(grant.lease_id)
        again = MirrorLease.fresh(MODEL, 1, at_source.lease_id, "relay-b", 3600.0)
        with pytest.raises(AccessDenied, match="source"):
            await h.mc._send(api.MIRROR_LEASE, again.signed(SECRET))


async def test_an_idle_mirror_is_evicted_to_make_room_for_a_new_one_within_the_budget() -> None:
    """A mirror nobody leases is a cache entry: when the budget is full, the least
    recently completed one goes (its version retired here first), not the new one."""
    async with hosts(max_bytes=NBYTES + NBYTES // 2) as h:
        first = await publish(h.sc)
        lease = await h.sc.acquire_lease(MODEL, 1, 60.0)
        req, _ = await pull_request(h, first, lease.lease_id)
        assert (await h.mc.pull(req)).path == "shm"
        await h.sc.release_lease(lease.lease_id)
        # another model: it fits only once the idle mirror of the first has gone
        info = await h.sc.create_region(NBYTES, label="other")
        with SharedSegment.attach(info.handle, NBYTES) as seg:
            seg.numpy()[:] = pattern(7)
        t = TensorEntry("w", (NBYTES,), "uint8", [ShardEntry((0,), (NBYTES,), info.region_id, 0)])
        await h.sc.publish(ManifestIn("other", 1, 0, 1, [t]))
        lease = await h.sc.acquire_lease("other", 1, 60.0)
        dst = await h.mc.create_region(NBYTES, label="engine")
        rows = np.array([[info.region_id, 0, dst.region_id, 0, NBYTES]], dtype=np.int64)
        req = PullRequest("other", 1, lease.lease_id, DescriptorTable.pack(rows), [], h.sc.base_url)
        assert (await h.mc.pull(req)).path == "shm"
        with SharedSegment.attach(dst.handle, NBYTES) as seg:
            assert np.array_equal(seg.numpy(), pattern(7))
        st = await h.mc._send(api.MIRROR_STATE, model="other", version=1)
        assert st.held_bytes == NBYTES <= st.budget_bytes
        with pytest.raises(NotFoundError):
            await h.mc._send(api.MIRROR_STATE, model=MODEL, version=1)
