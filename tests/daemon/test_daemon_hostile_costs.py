"""Cost amplification (issue 47): what one request makes the daemon hold or compute is
bounded by a setting and charged before the work starts.

A hostile tenant sends requests small in bytes that a daemon once expanded far past
them: a pack spec of a few bytes listing one run per element, a malformed spec that
ended in a bare 500. Each test is one rule, named as that rule, against a real
daemon on 127.0.0.1:0 with two token tenants: ``a`` publishes model ``am`` (v1 and
v2 of one bfloat16 tensor, so the daemon holds v2's delta against v1), ``b`` reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from support.tenants import TOKENS, two_tenants

from refitd.client.http import RefitClient
from refitd.daemon.node import Daemon
from refitd.wire import (
    DeltaPackRequest,
    DescriptorTable,
    ManifestIn,
    PackSpec,
    PullRequest,
    ShardEntry,
    TensorEntry,
)
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

ELEMS = 2048
"""bfloat16 elements of ``am``'s one tensor (4 KiB)."""
NBYTES = 2 * ELEMS
RUNS = 1000
"""``limits.max_plan_runs`` of the daemon under attack."""


@dataclass
class Env:
    daemon: Daemon
    url: str
    a: RefitClient
    b: RefitClient
    region: int  # v2's region


def manifest(version: int, region: int) -> ManifestIn:
    shard = ShardEntry((0,), (ELEMS,), region, 0)
    return ManifestIn("am", version, 0, 1, [TensorEntry("w", (ELEMS,), "bfloat16", [shard])])


@contextlib.asynccontextmanager
async def two_versions(tmp: Path, **options: Any) -> AsyncIterator[Env]:
    """``a`` publishes v1 and v2 of ``am`` (64 elements differ); v2's delta is ready."""
    settings: dict[str, Any] = {"deltas": True, "max_plan_runs": RUNS, **options}
    async with two_tenants(tmp, node_id="hostile-costs", **settings) as t:
        v1 = np.random.default_rng(1).integers(0, 1 << 16, ELEMS, dtype=np.uint16)
        v2 = v1.copy()
        v2[:64] += 1
        region = 0
        for version, words in ((1, v1), (2, v2)):
            info = await t.a.create_region(NBYTES, label=f"v{version}")
            with SharedSegment.attach(info.handle, NBYTES) as seg:
                seg.numpy(np.uint16)[:] = words
            await t.a.publish(manifest(version, info.region_id))
            region = info.region_id
        rec = await t.a.delta_info("am", 2, wait_s=60.0)
        assert rec.state == "ready", rec
        yield Env(t.served.daemon, t.served.url, t.a, t.b, region)


async def post(env: Env, path: str, value: Any) -> tuple[int, Any]:
    """``POST path`` of msgpack ``value`` as tenant b: the status and the answer."""
    headers = {"Authorization": f"Bearer {TOKENS['b']}", "Content-Type": "application/msgpack"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(env.url + path, data=msgspec.msgpack.encode(value), headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


def refused(status: int, res: Any, expected: int, *named: str) -> None:
    """``expected`` in the error shape, its detail naming each of ``named``."""
    assert status == expected, (status, res)
    assert isinstance(res, dict) and set(res) == {"error", "detail"}, res
    for word in named:
        assert word in res["detail"], (word, res)


def no_rows() -> DescriptorTable:
    return DescriptorTable(b"")


async def delta_request(env: Env, specs: list[PackSpec]) -> tuple[str, DeltaPackRequest]:
    lease = await env.b.acquire_lease("am", 2, ttl_s=600)
    rec = await env.b.delta_info("am", 2)
    req = DeltaPackRequest("am", 2, lease.lease_id, 1, rec.base_digest, no_rows(), specs)
    return lease.lease_id, req


# ---------------------------------------------------------------- class 2: specs expanded per run


async def test_a_stride_zero_delta_pack_spec_is_refused_before_it_is_expanded_run_by_run(
    tmp_path: Path,
) -> None:
    """A stride-0 spec at exactly the stream bound (4 times the version's bytes) of
    one bfloat16 element a run: 8,192 runs, more than ``limits.max_plan_runs``. It is
    refused (413 naming the setting) before the daemon lists a run; nothing is
    staged. Before, the daemon listed (and selected changes for) every run."""
    async with two_versions(tmp_path) as env:
        spec = PackSpec(env.region, 0, (4 * ELEMS,), (0,), 2, 0, 0)
        lease, req = await delta_request(env, [spec])
        status, res = await post(env, "/v1/deltas/pack", req)
        refused(status, res, 413, "limits.max_plan_runs", str(4 * ELEMS))
        assert env.daemon.staging.packed_for(lease) == {}


async def test_a_stride_zero_pack_spec_of_a_pull_or_a_peer_pack_is_refused_before_it_is_expanded(
    tmp_path: Path,
) -> None:
    """The same spec in a pull and in a peer pack: refused (413) before any run is
    listed or any byte moves, on every path that expands a spec."""
    async with two_versions(tmp_path) as env:
        dst = await env.b.create_region(4 * NBYTES, label="dst")
        lease = await env.b.acquire_lease("am", 2, ttl_s=600)
        spec = PackSpec(env.region, 0, (4 * ELEMS,), (0,), 2, dst.region_id, 0)
        pull = PullRequest("am", 2, lease.lease_id, no_rows(), [spec], "")
        status, res = await post(env, "/v1/pulls", pull)
        refused(status, res, 413, "limits.max_plan_runs")
        pack = {"model": "am", "version": 2, "lease_id": lease.lease_id, "specs": [spec]}
        status, res = await post(env, "/v1/peer/pack", pack)
        refused(status, res, 413, "limits.max_plan_runs")
        assert env.daemon.staging.packed_for(lease.lease_id) == {}


# ---------------------------------------------------------------- class 7: bare 500s


async def test_a_delta_pack_spec_whose_strides_and_shape_differ_in_length_is_a_400(
    tmp_path: Path,
) -> None:
    """As the pull and peer-pack paths answer: 400 naming the spec, nothing staged
    (it was a bare 500)."""
    async with two_versions(tmp_path) as env:
        lease, req = await delta_request(env, [PackSpec(env.region, 0, (4,), (1, 1), 2, 0, 0)])
        status, res = await post(env, "/v1/deltas/pack", req)
        refused(status, res, 400, "pack spec 0", "strides")
        assert env.daemon.staging.packed_for(lease) == {}
