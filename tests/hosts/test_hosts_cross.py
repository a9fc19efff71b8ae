"""Across simulated hosts: each its own network and /dev/shm, daemons on their own
addresses, bytes between them over the path ``auto`` picks (refitd's ``tcp`` lanes:
no shared memory, no RDMA) and over forced ``ucx`` (UCX over tcp)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hosts import cluster_of, needs_hosts, tx_bytes

pytestmark = [needs_hosts, pytest.mark.timeout(240)]

#: (data-plane mode of every daemon, the path the pulls must take)
PATHS = pytest.mark.parametrize(("mode", "path"), [("auto", "tcp"), ("ucx", "ucx")])

GIB = 0.01  # a few MiB: the flow is under test, not the speed


@PATHS
async def test_another_host_is_read_over_the_chosen_path_and_the_refit_is_bit_exact_then_replayed(
    tmp_path: Path, mode: str, path: str
) -> None:
    async with cluster_of(tmp_path, "trainer", "engine") as (cluster, (th, eh)):
        a = await cluster.daemon(
            th, "trainer-host", "--set", f"peers.allow=http://{eh.address}:*", transport=mode
        )
        # The engine's daemon reads only from peers it trusts (here: by [peers] allow),
        # and the trainer's tcp data server answers only hosts it trusts.
        b = await cluster.daemon(
            eh, "engine-host", "--set", f"peers.allow=http://{th.address}:*", transport=mode
        )
        trainer = await cluster.worker(th)
        engine = await cluster.worker(eh)
        common = {"model": "m", "gib": GIB, "layout": "megatron", "world": 2}
        for version in (1, 2):
            out = await trainer.call("publish", url=a.url, ranks=[0, 1], version=version, **common)
            assert out["ok"], out
            sent = await tx_bytes(th)
            got = await engine.call(
                "refit", local=b.url, source=a.url, tp=2, version=version, **common
            )
            assert got["ok"], got
            # The bytes crossed the trainer host's link (no path through the shared kernel).
            assert await tx_bytes(th) - sent >= got["bytes"]  # type: ignore[operator]
            # /dev/shm is private per host, so the same-host proof fails.
            assert got["paths"] == [path]
            assert got["verified"] is True
            assert got["replayed"] is (version == 2)


async def test_each_host_has_its_own_shm_and_nothing_is_left_after_teardown(
    tmp_path: Path,
) -> None:
    import asyncio

    from refitd.bench.simhosts import namespaces

    async with cluster_of(tmp_path, "a", "b") as (cluster, (a, b)):
        prefix = cluster.net.prefix
        mark = f"refitd-hosts-{prefix}"
        touch = await a.exec("touch", f"/dev/shm/{mark}")
        assert await touch.wait() == 0
        look = await b.exec("ls", "/dev/shm", stdout=asyncio.subprocess.PIPE)
        seen, _ = await look.communicate()
        assert mark not in seen.decode()
        assert not await asyncio.to_thread(Path("/dev/shm", mark).exists)
        assert any(n.startswith(prefix) for n in await asyncio.to_thread(namespaces))
    assert not any(n.startswith(prefix) for n in await asyncio.to_thread(namespaces))
