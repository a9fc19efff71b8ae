"""The cost harness (issue 47): per route, what a tenant's worst inputs within its
caps cost the daemon, against what the cost model charges for them.

A real daemon (``support.costs``: its own loop in a thread, two token tenants) is
attacked route by route: pulls (a descriptor table at a body's size, a pack spec at
``limits.max_plan_runs``), a peer pack and a delta pack (stride-0 specs at that
bound), a publish at ``[pulls] deltas`` (two versions of a model of
``limits.max_manifest_shards`` tiny shards, the second compared with the first, its
base), an expert pool of many layers, a sparse segment attached, and a principal's whole allowance of long
polls (``/ready`` and a host mirror's state). Each attack runs twice: once for the
daemon's longest loop stall, once (allocations traced) for its memory. The test
prints one line per route and holds every route to: memory at most 4 times the
charge plus :data:`SLACK`, a stall of at most :data:`MAX_STALL_S`, and no answer a
bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from support.costs import TOKENS, InThread, daemon_in_a_thread, traced_peak
from support.settled import settled_delta

from refitd.client.http import RefitClient
from refitd.daemon.app.waits import WAITS
from refitd.daemon.delta.routes import DELTAS
from refitd.daemon.experts.pools import bookkeeping_bytes
from refitd.daemon.mirror.book import MAX_HOLDERS
from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.routes import MIRRORS
from refitd.daemon.pull.pulls import PLAN_RUN_BYTES
from refitd.daemon.state.manifestcheck import manifest_cost
from refitd.delta.compare import comparison_bytes
from refitd.wire import (
    DeltaPackRequest,
    DeltaStreamRequest,
    DescriptorTable,
    HolderJoin,
    ManifestIn,
    PackSpec,
    PoolCreate,
    PullRequest,
    ShardEntry,
    TensorEntry,
)
from refitd.wire.mirrors import MAX_EXCLUDE
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(300)

SLACK = 16 << 20
"""What any request may cost beyond its charge, bytes: buffers of connections and
answers, the daemon's own per-request objects."""
MAX_STALL_S = 0.100
"""The longest the daemon's loop may serve nothing else, s."""
RUN_BYTES = 40
"""What the cost model charges a run of a plan listed run by run, bytes (a pull's
runs are charged ``PLAN_RUN_BYTES`` while it runs: its rows, checks and batches)."""

ELEMS = 1 << 20
"""bfloat16 elements of model ``am`` (2 MiB a version)."""
RUNS = 1 << 19
"""``limits.max_plan_runs`` of the daemon under attack."""
ROWS = RUNS
"""Descriptors of the largest pull: its runs at ``limits.max_plan_runs`` (21 MB of body)."""
SHARDS = 100_000
"""``limits.max_manifest_shards`` of the daemon under attack."""
POLLS = 64


@dataclass
class Env:
    d: InThread
    url: str
    a: RefitClient
    b: RefitClient
    v2: int  # the region of version 2 of ``am``
    dst: int  # b's destination region (2 MiB)
    lease: str  # b's lease on v2
    base_digest: str
    tiny: int  # a's region of one bfloat16 element a shard (``SHARDS`` of them)
    threads: int  # the delta comparison's threads
    n: int = 0  # attacks made: names each one's new objects


async def post(env: Env, who: str, path: str, value: Any, url: str = "") -> int:
    """``POST path`` of ``value`` (msgpack) as ``who``: its status. A pull accepted
    (202) is waited for: what it costs while it runs counts too."""
    headers = {
        "Authorization": f"Bearer {TOKENS[who]}",
        "Content-Type": "application/msgpack",
        "Accept": "application/json",
    }
    body = value if isinstance(value, bytes) else msgspec.msgpack.encode(value)
    async with (
        aiohttp.ClientSession() as http,
        http.post((url or env.url) + path, data=body, headers=headers) as r,
    ):
        status = r.status
        if path.endswith("/stream") and status == 200:  # frames: read to the end
            await r.read()
            return status
        answer = await r.json(content_type=None)
    if path == "/v1/pulls" and status == 202:
        client = env.a if who == "a" else env.b
        await client.wait_pull(answer["pull_id"])
    return status


# ---------------------------------------------------------------- the attacks
# Each makes one worst request (or set of requests) and returns (charge, statuses).

Attack = Callable[[Env], Awaitable[tuple[int, list[int]]]]


async def pull_of_many_descriptors(env: Env) -> tuple[int, list[int]]:
    rows = np.zeros((ROWS, 5), dtype=np.int64)
    rows[:, 0], rows[:, 2], rows[:, 4] = env.v2, env.dst, 1
    rows[:, 1] = rows[:, 3] = np.arange(ROWS) * 2
    body = msgspec.msgpack.encode(
        PullRequest("am", 2, env.lease, DescriptorTable.pack(rows), [], "")
    )
    status = await post(env, "b", "/v1/pulls", body)
    return len(body) + PLAN_RUN_BYTES * ROWS, [status]


def stride_zero(dst: int) -> PackSpec:
    return PackSpec(0, 0, (RUNS,), (0,), 2, dst, 0)


async def pull_of_a_stride_zero_spec(env: Env) -> tuple[int, list[int]]:
    spec = msgspec.structs.replace(stride_zero(env.dst), src_region=env.v2)
    status = await post(
        env, "b", "/v1/pulls", PullRequest("am", 2, env.lease, DescriptorTable(b""), [spec], "")
    )
    return PLAN_RUN_BYTES * RUNS, [status]


async def peer_pack_of_a_stride_zero_spec(env: Env) -> tuple[int, list[int]]:
    spec = msgspec.structs.replace(stride_zero(0), src_region=env.v2)
    req = {"model": "am", "version": 2, "lease_id": env.lease, "specs": [spec]}
    status = await post(env, "b", "/v1/peer/pack", req)
    return RUN_BYTES * RUNS, [status]


async def delta_pack_of_a_stride_zero_spec(env: Env) -> tuple[int, list[int]]:
    spec = msgspec.structs.replace(stride_zero(0), src_region=env.v2)
    req = DeltaPackRequest("am", 2, env.lease, 1, env.base_digest, DescriptorTable(b""), [spec])
    status = await post(env, "b", "/v1/deltas/pack", req)
    # The staged delta is built in the daemon's memory before it is copied to its
    # region: charged as the region's bytes (at most the stream's, 2 B a run).
    return RUN_BYTES * RUNS + 2 * RUNS, [status]


async def delta_stream_of_a_stride_zero_spec(env: Env) -> tuple[int, list[int]]:
    spec = msgspec.structs.replace(stride_zero(0), src_region=env.v2)
    req = DeltaStreamRequest(
        "am", 2, env.lease, 1, env.base_digest, DescriptorTable(b""), [spec], chunk_bytes=1 << 12
    )
    status = await post(env, "b", "/v1/deltas/stream", req)
    # Charged as the delta pack is: the selection of the stream's runs, and a chunk's
    # encoded bytes at a time (at most the stream's, 2 B a run).
    return RUN_BYTES * RUNS + 2 * RUNS, [status]


def tiny_shards(region: int) -> list[TensorEntry]:
    """A manifest's tensors at ``limits.max_manifest_shards``: one-element shards."""
    half = SHARDS // 2  # a tensor lists at most 65,536 shards (a wire limit)
    return [
        TensorEntry(
            f"w{t}",
            (half,),
            "bfloat16",
            [ShardEntry((i,), (1,), region, 2 * (t * half + i)) for i in range(half)],
        )
        for t in range(2)
    ]


async def publish_of_the_largest_manifest_compared(env: Env) -> tuple[int, list[int]]:
    """Two versions of a model of tiny shards at ``deltas = true``: the second is
    compared with the first (READY, its base) block by block."""
    env.n += 1
    tensors = tiny_shards(env.tiny)
    charge, statuses = 0, []
    for version in (1, 2):
        m = ManifestIn(f"big{env.n}", version, 0, 1, tensors)
        body = msgspec.msgpack.encode(m)
        statuses.append(await post(env, "a", "/v1/sources", body))
        charge += manifest_cost(m) + len(body)
    rec = await settled_delta(env.a, f"big{env.n}", 2)
    assert rec.state == "ready" and rec.base_version == 1, rec
    return charge + comparison_bytes(env.threads, SHARDS), statuses


async def pool_of_many_layers(env: Env) -> tuple[int, list[int]]:
    env.n += 1
    spec = PoolCreate(name=f"wide{env.n}", layers=20_000, experts=4, slots=4, row_bytes=[1])
    status = await post(env, "a", "/v1/experts", spec)
    await env.a.delete_pool(spec.name)
    return bookkeeping_bytes(spec), [status]


async def attach_of_a_sparse_segment(env: Env) -> tuple[int, list[int]]:
    size = 256 << 20
    with SharedSegment.create(size, "sparse", reserve=False) as seg:
        req = {"handle": seg.name, "nbytes": size, "label": "sparse"}
        status = await post(env, "a", "/v1/regions/attach", req)
    return 0, [status]


async def held_long_polls(env: Env, path: str, who: str = "b", method: str = "GET") -> list[int]:
    """``POLLS`` long polls of ``who`` on ``path`` held at once, then dropped: each
    must give back its place within the wait below."""
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    headers = {"Authorization": f"Bearer {TOKENS[who]}", "Accept": "application/json"}
    polls = [
        asyncio.ensure_future(http.request(method, env.url + path, headers=headers))
        for _ in range(POLLS)
    ]
    try:
        async with asyncio.timeout(30.0):
            while env.d.call(lambda: env.d.served.app[WAITS].open(who)) < POLLS:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    finally:
        for p in polls:
            p.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        await http.close()
    async with asyncio.timeout(30.0):
        while env.d.call(lambda: env.d.served.app[WAITS].open(who)):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return []


async def ready_long_polls(env: Env) -> tuple[int, list[int]]:
    return 0, await held_long_polls(env, "/v1/sources/am/versions/99/ready?timeout=60")


async def mirror_state_long_polls(env: Env) -> tuple[int, list[int]]:
    return 0, await held_long_polls(env, "/v1/mirrors/am/7?after=0&timeout=60")


async def cluster_next_long_polls(env: Env) -> tuple[int, list[int]]:
    return 0, await held_long_polls(env, "/v1/cluster/sources/am/next?after=99&timeout=60")


async def drain_long_polls(env: Env) -> tuple[int, list[int]]:
    # b's lease holds v2: each drain of its owner waits, for as long as it asks.
    path = "/v1/sources/am/versions/2/drain?timeout=3600"
    return 0, await held_long_polls(env, path, who="a", method="POST")


async def holder_book_joins(env: Env) -> tuple[int, list[int]]:
    """A peer daemon's worst joins (signed, every field at its bound) past the book's
    holders, and a tenant's unsigned one."""
    secret = env.d.served.daemon.secret
    exclude = [f"http://127.0.0.1:{20_000 + k}" for k in range(MAX_EXCLUDE)]
    joins = [
        HolderJoin("am", 2, f"http://127.0.0.1:{10_000 + i}", f"n{i}", exclude, 1e12)
        for i in range(MAX_HOLDERS + 8)
    ]
    statuses = [await post(env, "a", "/v1/mirrors/holders", j.signed(secret)) for j in joins]
    statuses.append(await post(env, "a", "/v1/mirrors/holders", joins[0]))
    assert statuses[-1] == 403, statuses[-1]
    return 0, statuses


ATTACKS: list[tuple[str, Attack]] = [
    ("pull: descriptors at max_plan_runs", pull_of_many_descriptors),
    ("pull: stride-0 spec at max_plan_runs", pull_of_a_stride_zero_spec),
    ("peer pack: stride-0 spec at max_plan_runs", peer_pack_of_a_stride_zero_spec),
    ("delta pack: stride-0 spec at max_plan_runs", delta_pack_of_a_stride_zero_spec),
    ("delta stream: stride-0 spec at max_plan_runs", delta_stream_of_a_stride_zero_spec),
    ("publish: max_manifest_shards, compared", publish_of_the_largest_manifest_compared),
    ("pool: 20,000 layers", pool_of_many_layers),
    ("attach: 256 MiB sparse segment", attach_of_a_sparse_segment),
    ("long polls: 64 /ready", ready_long_polls),
    ("long polls: 64 mirror states", mirror_state_long_polls),
    ("long polls: 64 cluster next", cluster_next_long_polls),
    ("holder book: 72 signed joins at the bounds", holder_book_joins),
    ("long polls: 64 drains (last: it yields v2)", drain_long_polls),
]


@contextlib.asynccontextmanager
async def attacked(tmp: Path) -> Any:
    settings: dict[str, Any] = {
        "node_id": "cost-harness",
        "transport": "shm",
        "deltas": True,
        "max_plan_runs": RUNS,
        "max_manifest_shards": SHARDS,
        "allow": ("http://127.0.0.1:*",),  # the peers that join the holder book
    }
    with daemon_in_a_thread(tmp, **settings) as d:
        url = d.served.url
        async with (
            RefitClient(url, token=TOKENS["a"]) as a,
            RefitClient(url, token=TOKENS["b"]) as b,
        ):
            nbytes = 2 * ELEMS
            v1 = np.random.default_rng(1).integers(0, 1 << 16, ELEMS, dtype=np.uint16)
            v2 = v1.copy()
            v2[::97] += 1
            region = 0
            for version, words in ((1, v1), (2, v2)):
                info = await a.create_region(nbytes, label=f"v{version}")
                with SharedSegment.attach(info.handle, nbytes) as seg:
                    seg.numpy(np.uint16)[:] = words
                shard = ShardEntry((0,), (ELEMS,), info.region_id, 0)
                t = TensorEntry("w", (ELEMS,), "bfloat16", [shard])
                await a.publish(ManifestIn("am", version, 0, 1, [t]))
                region = info.region_id
            rec = await settled_delta(a, "am", 2)
            assert rec.state == "ready", rec
            lease = await b.acquire_lease("am", 2, 3600.0)
            dst = await b.create_region(nbytes, label="dst")
            mirror = Mirror("http://127.0.0.1:9", "am", 7)
            mirror.chunks = np.array([[region, 0, nbytes]], dtype=np.int64)
            mirror.done = np.zeros(1, dtype=bool)
            d.call(
                lambda: d.served.app[MIRRORS].by_key.__setitem__((mirror.source, "am", 7), mirror)
            )
            tiny = await a.create_region(2 * SHARDS, label="tiny")
            threads = d.call(lambda: d.served.app[DELTAS].threads)
            yield Env(
                d, url, a, b, region, dst.region_id, lease.lease_id, rec.base_digest,
                tiny.region_id, threads,
            )  # fmt: skip


async def test_every_route_costs_the_daemon_at_most_four_times_its_charge_and_never_stalls_its_loop(
    tmp_path: Path,
) -> None:
    # The test process holds what no daemon does (other tests' objects, the tenants'
    # clients): kept out of the collector's full passes, which would otherwise count
    # as the daemon's stalls.
    gc.collect()
    gc.freeze()
    try:
        await attack_every_route(tmp_path)
    finally:
        gc.unfreeze()


async def attack_every_route(tmp_path: Path) -> None:
    async with attacked(tmp_path) as env:
        lines, over = [], []
        for name, attack in ATTACKS:
            env.d.call(env.d.stall.reset)
            _, statuses = await attack(env)
            stall = env.d.call(lambda: env.d.stall.longest)
            with traced_peak() as peak:
                charge, more = await attack(env)
            held = peak[0]
            statuses += more
            bound = 4 * charge + SLACK
            lines.append(
                f"{name:44s} charge {charge / 2**20:8.2f} MiB  held {held / 2**20:8.2f} MiB "
                f"(bound {bound / 2**20:8.2f})  stall {stall * 1e3:6.1f} ms  answers {sorted(set(statuses))}"
            )
            if held > bound or stall > MAX_STALL_S or 500 in statuses:
                over.append(name)
        print("\n" + "\n".join(lines))
        assert over == [], over
