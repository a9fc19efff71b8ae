"""`refitd status` says which data path each known peer gets, and why."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from support.daemons import daemon_config, serving_daemons

from refitd.daemon.app.node import Daemon
from refitd.daemon.pull.paths import has_rdma

pytestmark = pytest.mark.timeout(120)

PEER = "http://10.0.0.7:7450"


async def status(url: str, *extra: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "refitd.cli", "status", "--url", url, *extra,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    out, _ = await proc.communicate()
    return out.decode()


async def test_status_says_which_path_a_trusted_peer_would_get_in_auto_and_why() -> None:
    async with serving_daemons(Daemon(daemon_config(allow=(PEER,)))) as (c,):
        node = await c.node()
        remote = "ucx" if has_rdma(node.ucx_transports) else "tcp"
        want = f"shm if proven on this host at pull time, else {remote}"
        assert node.paths[PEER].startswith(want), node.paths
        assert json.loads(await status(c.base_url, "--json"))["paths"] == node.paths
        text = await status(c.base_url)
        assert f"path from {PEER}" in text and want in text
        if remote == "tcp":
            assert "this host's UCX offers no RDMA" in text


async def test_status_says_a_forced_transport_is_what_every_peer_gets() -> None:
    async with serving_daemons(Daemon(daemon_config(allow=(PEER,), transport="tcp"))) as (c,):
        assert (await c.node()).paths == {PEER: "tcp: forced (--transport tcp)"}
