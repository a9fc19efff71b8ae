"""Trainer-side sources: each rank's local shards with their global placement, never
a gathered tensor; published zero-copy once adopted."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon
from refitd.errors import PlanError
from refitd.integrations.sources import (
    FSDPSource,
    LocalShard,
    MegatronSource,
    ShardPublisher,
    TensorSource,
    reserve_bytes,
)

pytestmark = pytest.mark.timeout(120)


def _fsdp_rank(rank: int, port: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.Linear(7, 1))
    fully_shard(model)
    shards = FSDPSource(model, name_map={"0.weight": "first.weight"}).shards()
    queue.put([(rank, s.name, s.offset, s.global_shape, s.tensor.tolist()) for s in shards])
    dist.destroy_process_group()


def test_fsdp2_ranks_publish_their_own_rows_including_an_uneven_and_an_empty_last_shard() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = [row for _ in procs for row in queue.get(timeout=90)]
    for p in procs:
        p.join(30)
    torch.manual_seed(0)
    full = dict(
        torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.Linear(7, 1)).named_parameters()
    )
    full["first.weight"] = full.pop("0.weight")
    blocks = {(rank, name): (off, shape, torch.tensor(t)) for rank, name, off, shape, t in got}
    # 7 rows split as torch.chunk does: 4 + 3; the 1-row tensors leave rank 1 empty.
    assert blocks[(0, "first.weight")][0] == (0, 0) and blocks[(1, "first.weight")][0] == (4, 0)
    assert (1, "1.weight") not in blocks and (1, "1.bias") not in blocks
    for (_, name), (off, shape, t) in blocks.items():
        assert shape == tuple(full[name].shape)
        assert torch.equal(t, full[name].detach()[off[0] : off[0] + t.shape[0]])
    rows = {
        name: sum(t.shape[0] for (_, n), (_, _, t) in blocks.items() if n == name) for name in full
    }
    assert rows == {name: p.shape[0] for name, p in full.items()}


def test_megatron_blocks_keep_their_global_placement_and_a_block_out_of_bounds_is_refused() -> None:
    w = torch.arange(24.0).view(4, 6)
    [shard] = MegatronSource([("w", w[:, 3:], (0, 3), (4, 6))]).shards()
    assert (shard.offset, shard.global_shape) == ((0, 3), (4, 6))
    with pytest.raises(PlanError, match="does not fit"):
        list(MegatronSource([("w", w, (1, 0), (4, 6))]).shards())


def test_a_name_map_renames_tensors_or_leaves_them_out() -> None:
    state = {"a": torch.zeros(2), "b": torch.ones(3)}
    names = [s.name for s in TensorSource(state, lambda n: None if n == "a" else f"x.{n}").shards()]
    assert names == ["x.b"]


def test_reserve_sizes_every_block_to_a_64_byte_boundary() -> None:
    shards = [
        LocalShard("a", torch.zeros(3, dtype=torch.bfloat16), (0,), (3,)),
        LocalShard("b", torch.zeros(17), (0,), (17,)),
    ]
    assert reserve_bytes(shards) == 64 + 128


async def test_adopted_tensors_are_published_with_no_copy_after_the_first_round(
    secret_file: str,
) -> None:
    weights = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    async with spawn_daemon(secret_file=secret_file) as d, RefitClient(d.url) as client:
        pub = ShardPublisher(client, "adopt", adopt=True)
        await pub.publish(TensorSource(weights), 1)
        assert pub.copied_bytes == (64 + 8) * 4
        weights["w"].add_(1)  # the trainer's update lands in the published memory
        await pub.publish(TensorSource(weights), 2)
        assert pub.copied_bytes == 0
        m = await client.manifest("adopt", 2)
        [w] = [t for t in m.tensors if t.name == "w"]
        [region] = [r for r in await client.regions() if r.region_id == w.shards[0].region]
        from transports.segments import SharedSegment

        seg = SharedSegment.attach(region.handle, region.nbytes)
        try:
            at = w.shards[0].byte_offset
            assert torch.equal(seg.torch(torch.float32, at, 64).view(8, 8), weights["w"])
        finally:
            seg.close()
        await pub.close()


def _adopting_rank(rank: int, port: int, url: str, queue: Any) -> None:
    import asyncio

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        fully_shard(m)
        return m

    adopted, reference = build(), build()
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (adopted, reference)]

    async def rounds() -> list[Any]:
        async with RefitClient(url) as client:
            pub = ShardPublisher(client, "fsdp-adopt", rank, 2, adopt=True)
            await pub.publish(FSDPSource(adopted), 1)
            first = pub.copied_bytes
            for m, opt in zip((adopted, reference), optims):  # one training step each
                torch.manual_seed(1)
                m(torch.randn(4, 8)).square().sum().backward()
                opt.step()
            same = all(
                torch.equal(a.to_local(), b.to_local())
                for a, b in zip(adopted.parameters(), reference.parameters())
            )
            dist.barrier()
            await pub.publish(FSDPSource(adopted), 2)
            views = {name: v for (name, _), v in pub.publisher._views.items()}  # type: ignore[union-attr]
            inside = {
                n: p.to_local().data_ptr() == views[n].data_ptr()
                for n, p in adopted.named_parameters()
                if p.to_local().numel()
            }
            out = [first, pub.copied_bytes, same, inside]
            dist.barrier()
            await pub.close()
            return out

    queue.put(asyncio.run(rounds()))
    dist.destroy_process_group()


def test_adopted_fsdp2_shards_train_in_the_published_memory_and_publish_with_no_copy(
    tmp_path: Any,
) -> None:
    from refitd.bench.vllm import start_daemon

    daemon, url = start_daemon(tmp_path)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_adopting_rank, args=(r, port, url, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=90) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        daemon.terminate()
        daemon.wait(30)
    for first, second, same, inside in results:
        assert first > 0 and second == 0 and same
        # Linear(8, 2)'s 2 weight rows split evenly; its bias too: all moved.
        assert inside and all(inside.values()), inside
