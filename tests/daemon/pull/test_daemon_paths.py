"""Which path a pull takes: shared memory for a peer proven on this host; UCX where
both ends have RDMA; refitd's own ``tcp`` lanes otherwise (this machine has no RDMA).

Real daemons in this process (real HTTP on 127.0.0.1, real shared memory, real UCX
data planes). A daemon given another ``boot_id`` stands for a daemon on another
host: the one thing two daemons on one machine cannot otherwise be made to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
import numpy as np
import pytest
from support.daemons import GatedCopier, daemon_config, served

from refitd.client.http import RefitClient
from refitd.config import load_config
from refitd.daemon.app.handlers import PULLS
from refitd.daemon.app.node import Daemon
from refitd.daemon.pull.paths import has_rdma, transport_schemes
from refitd.daemon.pull.pulls import PullManager
from refitd.errors import TransportError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PeerRegions,
    PullRequest,
    PullState,
    ShardEntry,
    TensorEntry,
)
from transports.interface import PeerInfo
from transports.segments import SHM_DIR, SharedSegment
from transports.shm import SegmentKey
from transports.tcp import TcpTransport

pytestmark = pytest.mark.timeout(90)

SECRET = b"p" * 32
NBYTES = 4096


@dataclass
class Node:
    daemon: Daemon
    client: RefitClient
    url: str
    pulls: PullManager


@contextlib.asynccontextmanager
async def node(
    name: str,
    metrics: bool = False,
    copier: GatedCopier | None = None,
    boot_id: str = "",
    **options: object,
) -> AsyncIterator[Node]:
    options.setdefault("allow", ("http://127.0.0.1:*",))  # the other test daemons
    d = Daemon(
        daemon_config(node_id=name, **options), secret=SECRET, boot_id=boot_id, copier=copier
    )
    async with served(d, wired=metrics) as s:
        yield Node(d, s.client, s.url, s.app[PULLS])


async def publish(src: Node, fill: int, model: str = "m") -> tuple[int, SharedSegment]:
    """``model`` v1: one uint8 tensor of NBYTES bytes, every byte ``fill``."""
    info = await src.client.create_region(NBYTES, label="w")
    seg = SharedSegment.attach(info.handle, info.nbytes)
    seg.numpy()[:] = fill
    shard = ShardEntry((0,), (NBYTES,), info.region_id, 0)
    await src.client.publish(
        ManifestIn(model, 1, 0, 1, [TensorEntry("w", (NBYTES,), "uint8", [shard])])
    )
    return info.region_id, seg


async def pull_all(
    src: Node, dst: Node, region: int, model: str = "m"
) -> tuple[PullRequest, SharedSegment, int]:
    """A request for every byte of ``region`` at ``src`` into a new segment at ``dst``."""
    seg = SharedSegment.create(NBYTES, "dst")
    info = await dst.client.attach_region(seg.name, NBYTES)
    lease = await src.client.acquire_lease(model, 1)
    rows = np.array([[region, 0, info.region_id, 0, NBYTES]], dtype=np.int64)
    req = PullRequest(model, 1, lease.lease_id, DescriptorTable.pack(rows), [], src.url)
    return req, seg, info.region_id


async def test_auto_is_the_default_mode_and_starts_tcp_and_ucx_only_where_ucx_offers_rdma() -> None:
    assert Daemon().mode == "auto"
    assert load_config(env={}, overrides={}).data_plane.transport == "auto"
    async with node("solo") as n:
        assert (await n.client.ready())["transport"] == "auto"
        info = await n.client.node()
        assert info.worker_info["scheme"] == "tcp"
        rdma = has_rdma(info.ucx_transports)
        assert set(n.daemon.plane.by_scheme) == ({"tcp", "ucx"} if rdma else {"tcp"})
    assert transport_schemes("auto", ["tcp/eth0", "cma/memory"]) == ["tcp"]
    assert transport_schemes("auto", ["tcp/eth0", "rc_mlx5/mlx5_0:1"]) == ["tcp", "ucx"]
    assert transport_schemes("ucx", []) == ["ucx"]
    assert transport_schemes("shm", ["rc_mlx5/mlx5_0:1"]) == []


async def test_in_auto_mode_each_peer_gets_its_own_path_and_metrics_count_bytes_by_it() -> None:
    async with (
        node("near") as near,
        node("far", boot_id="another-host") as far,
        node("engine", metrics=True) as engine,
    ):
        r_near, _ = await publish(near, 7)
        r_far, _ = await publish(far, 9)
        got = {}
        for src, region, fill in ((near, r_near, 7), (far, r_far, 9)):
            req, seg, _ = await pull_all(src, engine, region)
            with seg:
                res = await engine.client.pull(req)
                assert res.state is PullState.DONE and res.bytes_done == NBYTES
                assert (seg.numpy() == fill).all()
            got[src.daemon.node_id] = res.path
        assert got == {"near": "shm", "far": "tcp"}
        listed = {p.path for p in await engine.client.pulls()}
        assert listed == {"shm", "tcp"}
        async with aiohttp.ClientSession() as s, s.get(f"{engine.url}/metrics") as resp:
            text = await resp.text()
        assert f'refitd_pulled_bytes_total{{transport="shm"}} {float(NBYTES)}' in text
        assert f'refitd_pulled_bytes_total{{transport="tcp"}} {float(NBYTES)}' in text
        # the node says which path each peer got, and why
        paths = (await engine.client.node()).paths
        assert paths["near"].startswith("shm: proven on this host")
        assert paths["far"].startswith("tcp: no RDMA between the two")
        assert paths["http://127.0.0.1:*"].startswith("shm if proven on this host")


@pytest.mark.parametrize("scheme", ["tcp", "ucx"])
async def test_a_forced_transport_reads_even_a_peer_on_this_host_through_it(scheme: str) -> None:
    async with node("src", transport=scheme) as src, node("engine", transport=scheme) as engine:
        region, _ = await publish(src, 3)
        req, seg, _ = await pull_all(src, engine, region)
        with seg:
            res = await engine.client.pull(req)
            assert res.path == scheme and (seg.numpy() == 3).all()
        assert (await engine.client.node()).paths["src"].startswith(f"{scheme}: forced")


async def test_a_forced_transport_the_source_does_not_serve_is_refused_naming_both() -> None:
    async with node("src", transport="tcp") as src, node("engine", transport="ucx") as engine:
        region, _ = await publish(src, 3)
        req, seg, _ = await pull_all(src, engine, region)
        with seg, pytest.raises(TransportError, match="it serves tcp, this daemon ucx"):
            await engine.client.pull(req)


async def test_forced_shm_runs_no_ucx_and_reads_a_peer_on_this_host_through_its_segments() -> None:
    async with node("src", transport="shm") as src, node("engine", transport="shm") as engine:
        assert (await engine.client.node()).worker_info == {}
        region, _ = await publish(src, 5)
        req, seg, _ = await pull_all(src, engine, region)
        with seg:
            res = await engine.client.pull(req)
            assert res.path == "shm" and (seg.numpy() == 5).all()


async def test_forced_shm_refuses_a_peer_on_another_host_before_any_byte_moves() -> None:
    async with (
        node("far", boot_id="another-host") as far,
        node("engine", transport="shm") as engine,
    ):
        region, _ = await publish(far, 1)
        req, seg, _ = await pull_all(far, engine, region)
        with seg:
            with pytest.raises(TransportError, match=r"--transport shm.*boot id differs"):
                await engine.client.submit_pull(req)
            assert not seg.numpy().any()
            assert await engine.client.pulls() == []


async def test_a_same_host_record_is_trusted_only_for_the_very_file_and_size_it_signs() -> None:
    async with node("src") as src, node("engine") as engine:
        region, _ = await publish(src, 2)
        # Without a lease the records name no segment (and carry no transport keys).
        assert (await src.client.peer_regions([region])).adverts == {}
        lease = await src.client.acquire_lease("m", 1)
        rec = await src.client.peer_regions([region], lease.lease_id, "m", 1)
        rec.verify(SECRET)
        assert await engine.pulls.paths.shm_refusal(rec) is None
        advert = PeerInfo.decode(rec.adverts["shm"])
        assert [r.region_id for r in advert.regions] == [region]  # what the lease reads

        def changed(**fields: object) -> PeerRegions:
            listed = msgspec.structs.replace(advert.regions[0], **fields)
            shm = msgspec.structs.replace(advert, regions=(listed,)).signed(SECRET)
            return msgspec.structs.replace(rec, adverts={**rec.adverts, "shm": shm.encode()})

        # A segment of that name that is another file (another /dev/shm, say).
        key = SegmentKey.decode(advert.regions[0].key)
        other = changed(key=key._replace(ino=key.ino + 1).encode())
        assert "another file" in str(await engine.pulls.paths.shm_refusal(other))
        # A record stating another size than the segment's.
        assert "expected 2048" in str(
            await engine.pulls.paths.shm_refusal(changed(size=NBYTES // 2))
        )
        # Records with no same-host advertisement are not trusted either.
        bare = msgspec.structs.replace(rec, adverts={})
        assert "no same-host advertisement" in str(await engine.pulls.paths.shm_refusal(bare))


async def test_a_same_host_pull_keeps_the_peers_mappings_between_pulls() -> None:
    async with node("src", transport="shm") as src, node("engine", transport="shm") as engine:
        region, _ = await publish(src, 4)
        for _ in range(3):
            req, seg, dst = await pull_all(src, engine, region)
            with seg:
                res = await engine.client.pull(req)
                assert res.path == "shm" and (seg.numpy() == 4).all()
            await engine.client.delete_region(dst)
        # One mapping of the source's segment, made by the first pull, reused since.
        assert engine.daemon.plane.shm.maps_made == 1 and engine.daemon.plane.shm.mapped == 1


async def test_a_same_host_pull_from_a_peer_whose_segment_maps_another_file_is_refused() -> None:
    """... before any byte moves, naming the region and why."""
    async with node("src", transport="shm") as src, node("engine", transport="shm") as engine:
        region, _ = await publish(src, 4)
        name = src.daemon.store.regions.get(region).handle
        # The name now maps another file of the same size (what another /dev/shm shows).
        os.unlink(SHM_DIR / name)
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, NBYTES)
        os.close(fd)
        req, seg, _ = await pull_all(src, engine, region)
        with seg:
            with pytest.raises(
                TransportError, match=rf"region {region} of 'src' does not map here: .*another file"
            ):
                await engine.client.submit_pull(req)
            assert not seg.numpy().any() and await engine.client.pulls() == []
        assert engine.daemon.plane.shm.mapped == 0


async def test_a_pull_from_this_daemon_reads_through_its_own_segments_without_mapping_any() -> None:
    async with node("solo", transport="shm") as n:
        region, _ = await publish(n, 6)
        seg = SharedSegment.create(NBYTES, "dst")
        with seg:
            info = await n.client.attach_region(seg.name, NBYTES)
            lease = await n.client.acquire_lease("m", 1)
            rows = np.array([[region, 0, info.region_id, 0, NBYTES]], dtype=np.int64)
            res = await n.client.pull(
                PullRequest("m", 1, lease.lease_id, DescriptorTable.pack(rows), [])
            )
            assert res.path == "shm" and (seg.numpy() == 6).all()
        assert n.daemon.plane.shm.maps_made == 0


async def test_same_host_pulls_under_two_leases_from_one_peer_at_once_both_land() -> None:
    """Each pull reads through its own connection, listing only what its lease may
    read; the two share the mappings, and neither's record replaces the other's."""
    gate = GatedCopier()
    async with (
        node("src", transport="shm") as src,
        node("engine", transport="shm", copier=gate) as engine,
    ):
        r_m, _ = await publish(src, 1, "m")
        r_n, _ = await publish(src, 2, "n")
        req_m, seg_m, _ = await pull_all(src, engine, r_m, "m")
        req_n, seg_n, _ = await pull_all(src, engine, r_n, "n")
        with seg_m, seg_n:
            first = await engine.client.submit_pull(req_m)
            await gate.entered.wait()  # m's bytes are mid-flight
            second = await engine.client.submit_pull(req_n)
            gate.gate.set()
            for started in (first, second):
                res = await engine.client.wait_pull(started.pull_id)
                assert res.state is PullState.DONE, res.error
            assert (seg_m.numpy() == 1).all() and (seg_n.numpy() == 2).all()


async def test_pulls_that_find_no_connection_to_a_peer_at_once_open_one_and_share_it() -> None:
    """Two pulls from one peer, both asking for its shared connection before either
    has it, get the same one: the second waits for the first's instead of opening
    its own (which nothing kept, so nothing closed: its sockets, and over UCX its
    child's endpoints to the peer, outlived the peer's life)."""
    async with node("src", transport="tcp") as src, node("engine", transport="tcp") as engine:
        await publish(src, 5)
        lease = await src.client.acquire_lease("m", 1)
        peer = src.daemon.leases.leased_regions(None, lease.lease_id, "m", 1)
        paths = engine.pulls.paths
        tcp = engine.daemon.plane.by_scheme["tcp"]
        assert isinstance(tcp, TcpTransport)
        await asyncio.gather(*(paths.transport_peer(peer, "tcp") for _ in range(3)))
        assert len(tcp._peers) == 1, "a second connection to one peer life was opened"


async def test_data_plane_lanes_and_port_configure_the_tcp_data_server() -> None:
    config = load_config(env={}, overrides={"data_plane.lanes": "2"})
    assert config.data_plane.lanes == 2 and config.data_plane.tcp_port == 0
    async with node("solo", transport="tcp", lanes=2) as n:
        t = n.daemon.plane.by_scheme["tcp"]
        assert isinstance(t, TcpTransport) and t.lanes == 2 and t.require_lease
        assert t.incarnation == n.daemon.incarnation, (
            "a restarted daemon's data server has a new incarnation"
        )


async def test_the_tcp_data_server_answers_only_trusted_peers_hosts_and_loopback() -> None:
    async with node("solo", transport="tcp", allow=("http://10.0.0.7:*",)) as n:
        accept = n.daemon.plane.by_scheme["tcp"].accept  # type: ignore[attr-defined]
        assert accept("10.0.0.7") and accept("127.0.0.1")
        assert not accept("10.0.0.8"), "a host neither allow-listed nor registered"
        n.daemon.peers.trust("http://10.0.0.8:7450", origin="registry")
        assert accept("10.0.0.8"), "a daemon the registry lists is trusted"
