"""`refitd status` lists the UCX transports the daemon's UCX can use here."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from support.daemons import daemon_config, serving_daemons

from refitd.daemon.app.node import Daemon
from refitd.ops.status import describe_ucx
from transports.ucx.info import parse_ucx_info

pytestmark = pytest.mark.timeout(120)

SAMPLE = """
#      Transport: tcp
#         Device: eth0
#  System device: <unknown>
#      Transport: rc_mlx5
#         Device: mlx5_0:1
#      Transport: tcp
#         Device: lo
#      Transport: cma
#         Device: memory
"""


def test_ucx_info_output_becomes_transport_device_pairs_and_rdma_is_named() -> None:
    pairs = parse_ucx_info(SAMPLE)
    assert pairs == ["cma/memory", "rc_mlx5/mlx5_0:1", "tcp/eth0", "tcp/lo"]
    assert describe_ucx(pairs) == "cma, rc_mlx5 (mlx5_0:1), tcp (eth0, lo); RDMA: rc_mlx5"
    assert "no RDMA" in describe_ucx(["tcp/eth0", "cma/memory"])


async def test_status_lists_the_transports_of_the_running_ucx_data_plane() -> None:
    async with serving_daemons(Daemon(daemon_config(transport="ucx"))) as (c,):
        node = await c.node()
        assert any(p.startswith("tcp/") for p in node.ucx_transports), node.ucx_transports
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "refitd.cli", "status", "--url", c.base_url, "--json",
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        out, _ = await proc.communicate()
        assert json.loads(out)["ucx_transports"] == node.ucx_transports
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "refitd.cli", "status", "--url", c.base_url,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "300"},
        )  # fmt: skip
        out, _ = await proc.communicate()
        # The PyPI UCX wheel has no verbs: status says so rather than implying RDMA.
        assert "UCX transports" in out.decode() and "tcp (" in out.decode()
