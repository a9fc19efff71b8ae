"""Expert slot pools hosted by a real daemon on 127.0.0.1:0, driven through RefitClient.

Host rows and slots are real shared-memory regions of the daemon; the tests map them
by handle (as a trainer or an engine would) to write rows and read slots back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.daemons import served
from support.ops import serving_tenants
from support.toy import publish_tensor, pull_rows

from refitd.client.http import RefitClient
from refitd.daemon.experts.memory import touched_rows
from refitd.errors import AccessDenied, ConflictError, NotFoundError, PlanError, ProtocolError
from refitd.wire import (
    PoolInfo,
)
from transports.segments import SharedSegment

ROW_BYTES = [16, 8, 24]  # three banks of different widths, as gate/up/down differ
LAYERS, EXPERTS, SLOTS = 2, 4, 6


@pytest.fixture
async def client() -> AsyncIterator[RefitClient]:
    async with served() as s:
        yield s.client


@contextlib.contextmanager
def mapped(handle: str, nbytes: int) -> Iterator[np.ndarray]:
    seg = SharedSegment.attach(handle, nbytes)
    try:
        yield seg.numpy()
    finally:
        seg.close()


class Pool:
    """A pool's two regions mapped in the test process, addressed by its layout."""

    def __init__(self, info: PoolInfo, host: np.ndarray, slots: np.ndarray) -> None:
        self.info, self.host, self.slots = info, host, slots

    def host_row(self, bank: int, layer: int, expert: int) -> np.ndarray:
        w = self.info.row_bytes[bank]
        at = self.info.host_bank_offsets[bank] + (layer * self.info.experts + expert) * w
        return self.host[at : at + w]

    def slot(self, bank: int, slot: int) -> np.ndarray:
        w = self.info.row_bytes[bank]
        at = self.info.slot_bank_offsets[bank] + slot * w
        return self.slots[at : at + w]

    def holds(self, slot: int, layer: int, expert: int) -> bool:
        return all(
            np.array_equal(self.slot(b, slot), self.host_row(b, layer, expert))
            for b in range(len(self.info.row_bytes))
        )


@contextlib.asynccontextmanager
async def pool(c: RefitClient, name: str = "moe", **kw: Any) -> AsyncIterator[Pool]:
    info = await c.create_pool(
        name,
        layers=kw.pop("layers", LAYERS),
        experts=kw.pop("experts", EXPERTS),
        slots=kw.pop("slots", SLOTS),
        row_bytes=ROW_BYTES,
        **kw,
    )
    regions = {r.region_id: r for r in await c.regions()}
    host, slots = regions[info.host_region], regions[info.slot_region]
    with mapped(host.handle, host.nbytes) as h, mapped(slots.handle, slots.nbytes) as s:
        # Every row of every bank distinct, so a slot's bytes name its expert.
        h[:] = np.random.default_rng(7).integers(0, 256, h.size, dtype=np.uint8)
        yield Pool(info, h, s)


async def test_a_pool_lays_out_host_rows_and_slots_in_two_daemon_regions(
    client: RefitClient,
) -> None:
    async with pool(client) as p:
        regions = {r.region_id: r for r in await client.regions()}
        assert regions[p.info.host_region].nbytes == sum(ROW_BYTES) * LAYERS * EXPERTS
        assert regions[p.info.slot_region].nbytes == sum(ROW_BYTES) * SLOTS
        assert p.info.host_bank_offsets == [0, 16 * 8, 24 * 8]
        assert p.info.slot_bank_offsets == [0, 16 * 6, 24 * 6]
        assert p.info.residency == ["pinned", "pinned"]
        assert [q.name for q in await client.pools()] == ["moe"]


async def test_ensure_copies_the_routed_experts_rows_bit_exact_into_the_slots_it_names(
    client: RefitClient,
) -> None:
    async with pool(client) as p:
        r = await client.ensure("moe", 1, [2, 0, 2])
        assert r.active == 2 and r.missing == 2 and r.fetched == 2
        assert r.slots[0] == r.slots[2] and len(set(r.slots)) == 2
        assert r.copied_bytes == 2 * sum(ROW_BYTES)
        for slot, expert in zip(r.slots, [2, 0, 2], strict=True):
            assert p.holds(slot, 1, expert)
        assert sorted(zip(r.copied_experts, r.copied_slots, strict=True)) == sorted(
            {(2, r.slots[0]), (0, r.slots[1])}
        )


async def test_a_warm_step_moves_zero_bytes_and_answers_the_same_slots(
    client: RefitClient,
) -> None:
    async with pool(client) as p:
        cold = await client.ensure("moe", 0, [1, 3])
        warm = await client.ensure("moe", 0, [3, 1])
        assert warm.warm and warm.copied_bytes == 0 and warm.fetched == 0
        assert warm.slots == cold.slots[::-1]
        assert p.holds(warm.slots[0], 0, 3) and p.holds(warm.slots[1], 0, 1)
        info = await client.pool("moe")
        assert (info.plans, info.warm_plans, info.hits, info.misses) == (2, 1, 2, 2)
        assert info.copied_bytes == 2 * sum(ROW_BYTES)
        stats = await client.pool_stats("moe")
        assert stats.occupied_slots == 2 and stats.copied_bytes == info.copied_bytes


async def test_a_prefetched_expert_is_in_its_slot_when_the_step_names_it_and_is_not_copied_again(
    client: RefitClient,
) -> None:
    async with pool(client) as p:
        await client.ensure("moe", 0, [0])
        pre = await client.prefetch("moe", 1, [3, 1])
        assert pre.copied_experts == [3, 1] and len(pre.copied_slots) == 2
        assert pre.copied_bytes == 2 * sum(ROW_BYTES)
        step = await client.ensure("moe", 1, [1, 3])
        assert step.missing == 0 and step.copied_bytes == 0 and step.warm
        assert step.slots == pre.copied_slots[::-1]
        assert p.holds(step.slots[0], 1, 1) and p.holds(step.slots[1], 1, 3)
        info = await client.pool("moe")
        assert info.prefetched_bytes == 2 * sum(ROW_BYTES)
        assert (info.prefetch_used, info.prefetch_wasted, info.in_flight_slots) == (2, 0, 0)
        assert info.copied_bytes == 3 * sum(ROW_BYTES)


async def test_a_prefetch_by_scores_skips_low_confidence_experts_and_keeps_resident_ones(
    client: RefitClient,
) -> None:
    async with pool(client):
        await client.ensure("moe", 0, [2])
        pre = await client.prefetch("moe", 0, scores=[0.5, 0.05, 0.9, 0.3], min_score=0.1)
        assert pre.copied_experts == [0, 3]  # 2 is resident, 1 scored below the floor
        assert (pre.resident, pre.skipped) == (1, 0)
        capped = await client.prefetch("moe", 1, [0, 1, 2], budget=1)
        assert capped.copied_experts == [0] and capped.skipped == 2


async def test_a_pool_deleted_right_after_a_prefetch_lets_its_copies_land_first(
    client: RefitClient,
) -> None:
    # The copies write into the slot region; deleting it under them would be a write
    # into freed memory. The answer is built after the copies landed.
    async with pool(client):
        await client.prefetch("moe", 0, [0, 1, 2])
        deleted = await client.delete_pool("moe")
    assert deleted.in_flight_slots == 0
    assert deleted.prefetched_bytes == 3 * sum(ROW_BYTES)
    assert await client.regions() == []


async def test_prefetch_requests_that_cannot_be_served_are_refused_by_name(
    client: RefitClient,
) -> None:
    async with pool(client):
        with pytest.raises(ProtocolError, match="experts or scores, not both"):
            await client.prefetch("moe", 0, [1], scores=[0.1] * EXPERTS)
        with pytest.raises(ProtocolError, match="3 scores for 4 experts"):
            await client.prefetch("moe", 0, scores=[0.1] * 3)
        with pytest.raises(PlanError, match="layer 2 is outside"):
            await client.prefetch("moe", 2, [0])
        with pytest.raises(PlanError, match="prediction names expert 4"):
            await client.prefetch("moe", 0, [4])
        assert (await client.pool("moe")).occupied_slots == 0


async def test_invalidating_a_rewritten_expert_makes_the_next_step_fetch_its_new_rows(
    client: RefitClient,
) -> None:
    async with pool(client) as p:
        first = await client.ensure("moe", 0, [1, 2])
        for b in range(3):  # a refit rewrites expert 1's rows behind the pool's back
            p.host_row(b, 0, 1)[:] = 0xAB
        stale = await client.ensure("moe", 0, [1, 2])
        assert stale.warm and not p.holds(stale.slots[0], 0, 1)  # why invalidate exists
        dropped = await client.invalidate("moe", [(0, 1), (1, 3)])
        assert dropped.slots == [first.slots[0]]  # expert (1, 3) held no slot
        assert [(e.layer, e.expert) for e in dropped.experts] == [(0, 1)]
        again = await client.ensure("moe", 0, [1, 2])
        assert again.fetched == 1 and again.copied_experts == [1]
        assert again.copied_bytes == sum(ROW_BYTES)
        assert p.holds(again.slots[0], 0, 1) and p.holds(again.slots[1], 0, 2)
        assert (await client.pool("moe")).stale_invalidations == 1


async def test_a_pull_into_the_host_rows_invalidates_exactly_the_experts_it_rewrites(
    client: RefitClient,
) -> None:
    async with pool(client) as p:
        before = await client.ensure("moe", 1, [0, 1, 3])
        # The trainer publishes new rows for bank 2 of expert (1, 3) and the pool's
        # owner pulls them into the host region, as a refit does.
        src = await client.create_region(64, label="trainer")
        regions = {r.region_id: r for r in await client.regions()}
        with mapped(regions[src.region_id].handle, 64) as s:
            s[:] = 0x5A
        await publish_tensor(client, "m", 1, src.region_id, 64)
        lease = await client.acquire_lease("m", 1)
        at = p.info.host_bank_offsets[2] + (1 * EXPERTS + 3) * ROW_BYTES[2]
        await client.pull(
            pull_rows("m", 1, lease.lease_id, (src.region_id, 0, p.info.host_region, at, 24))
        )
        assert (p.host_row(2, 1, 3) == 0x5A).all()
        after = await client.ensure("moe", 1, [0, 1, 3])
        assert after.copied_experts == [3]  # experts 0 and 1 stayed warm
        assert after.slots[:2] == before.slots[:2]
        assert all(p.holds(s, 1, e) for s, e in zip(after.slots, [0, 1, 3], strict=True))


async def test_a_pull_into_the_slot_region_is_refused_and_every_slot_keeps_its_expert(
    client: RefitClient,
) -> None:
    """Only the pool's own copies write its slots: a pull that wrote one would leave the
    cache naming an expert for a slot that holds other bytes."""
    async with pool(client) as p:
        warm = await client.ensure("moe", 0, [0, 1])
        src = await client.create_region(64, label="trainer")
        regions = {r.region_id: r for r in await client.regions()}
        with mapped(regions[src.region_id].handle, 64) as s:
            s[:] = 0xA5
        await publish_tensor(client, "m", 1, src.region_id, 64)
        lease = await client.acquire_lease("m", 1)
        at = p.info.slot_bank_offsets[0] + warm.slots[0] * ROW_BYTES[0]
        before = p.slots.copy()
        with pytest.raises(
            AccessDenied,
            match=f"slot region of expert pool 'moe'.*host region {p.info.host_region}",
        ):
            await client.pull(
                pull_rows("m", 1, lease.lease_id, (src.region_id, 0, p.info.slot_region, at, 16))
            )
        assert np.array_equal(p.slots, before)
        again = await client.ensure("moe", 0, [0, 1])
        assert again.copied_bytes == 0 and again.slots == warm.slots
        assert all(p.holds(s, 0, e) for s, e in zip(again.slots, [0, 1], strict=True))


async def test_a_plan_the_executor_refuses_answers_422_naming_it_and_leaves_the_pool_consistent(
    client: RefitClient,
) -> None:
    # Layer 1's rows are pageable (a CPU layer): the executor refuses any per-slot copy.
    async with pool(client, slots=4, residency=["pinned", "pageable"], cpu_layers=[1]) as p:
        full = await client.ensure("moe", 0, [0, 1, 2, 3])
        assert full.fetched == 4
        with pytest.raises(PlanError, match="layer 1 has pageable host rows") as refused:
            # The cache had to evict two of layer 0's experts to plan this.
            await client.ensure("moe", 1, [0, 1])
        assert "whole-layer copy" in str(refused.value)
        info = await client.pool("moe")
        assert info.occupied_slots == 2  # the promised slots were given up, not kept
        # Every slot the pool still names holds its expert's bytes; the rest refetch.
        again = await client.ensure("moe", 0, [0, 1, 2, 3])
        assert again.fetched == 2 and again.copied_bytes == 2 * sum(ROW_BYTES)
        assert all(p.holds(s, 0, e) for s, e in zip(again.slots, range(4), strict=True))
        # A warm step on the CPU layer is refused too: the route is checked every time.
        with pytest.raises(PlanError, match="pageable"):
            await client.ensure("moe", 1, [])


async def test_pool_requests_that_cannot_be_served_are_refused_by_name(
    client: RefitClient,
) -> None:
    with pytest.raises(PlanError, match="3 slots cannot hold one layer's 4 experts"):
        await client.create_pool("small", layers=1, experts=4, slots=3, row_bytes=[8])
    with pytest.raises(PlanError, match=r"layers \[1\] are not pinned yet not CPU layers"):
        await client.create_pool(
            "bad", layers=2, experts=2, slots=2, row_bytes=[8], residency=["pinned", "locked"]
        )
    assert await client.regions() == []  # a refused pool leaves no region behind
    async with pool(client) as p:
        with pytest.raises(ConflictError, match="a pool of that name exists"):
            await client.create_pool("moe", layers=1, experts=1, slots=1, row_bytes=[8])
        with pytest.raises(ConflictError, match="expert pool 'moe' holds it"):
            await client.delete_region(p.info.host_region)
        with pytest.raises(PlanError, match=r"outside 0\.\.3"):
            await client.ensure("moe", 0, [4])
        with pytest.raises(PlanError, match="layer 2 is outside"):
            await client.ensure("moe", 2, [0])
        with pytest.raises(ProtocolError, match="nothing was dropped"):
            await client.invalidate("moe", [(0, 0), (0, 9)])
        with pytest.raises(NotFoundError, match="expert pool 'nope'"):
            await client.ensure("nope", 0, [0])
    deleted = await client.delete_pool("moe")
    assert deleted.name == "moe"
    assert await client.pools() == [] and await client.regions() == []


async def test_pool_gauges_appear_in_metrics_fed_from_the_pool() -> None:
    async with served(wired=True) as daemon, RefitClient(daemon.url) as c, pool(c):
        await c.ensure("moe", 0, [0, 1])
        await c.ensure("moe", 0, [0, 1])
        await c.invalidate("moe", layers=[0])
        async with aiohttp.ClientSession() as s, s.get(f"{daemon.url}/metrics") as resp:
            text = await resp.text()
    assert 'refitd_expert_pool_slots{pool="moe"} 6.0' in text
    assert 'refitd_expert_pool_hits_total{pool="moe"} 2.0' in text
    assert 'refitd_expert_pool_misses_total{pool="moe"} 2.0' in text
    assert f'refitd_expert_pool_copied_bytes_total{{pool="moe"}} {2.0 * sum(ROW_BYTES)}' in text
    assert 'refitd_expert_pool_stale_invalidations_total{pool="moe"} 2.0' in text
    assert 'refitd_expert_pool_occupied_slots{pool="moe"} 0.0' in text


async def test_a_token_holder_may_not_drive_another_principals_pool(tmp_path: Any) -> None:
    async with serving_tenants(tmp_path, {"engine": "e-secret", "other": "o-secret"}) as (_, c):
        engine, other = c["engine"], c["other"]
        info = await engine.create_pool("moe", layers=1, experts=2, slots=2, row_bytes=[8])
        assert info.owner == "engine"
        with pytest.raises(AccessDenied, match="other may not write expert pool 'moe'"):
            await other.ensure("moe", 0, [0])
        with pytest.raises(AccessDenied, match="other may not delete expert pool 'moe'"):
            await other.delete_pool("moe")
        assert (await engine.ensure("moe", 0, [0, 1])).fetched == 2


@settings(max_examples=200, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    rows=st.integers(1, 12),
    writes=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 40)), max_size=6),
)
def test_a_write_touches_exactly_the_rows_whose_bytes_it_overlaps(
    widths: list[int], rows: int, writes: list[tuple[int, int]]
) -> None:
    offsets = [sum(w * rows for w in widths[:b]) for b in range(len(widths))]
    ranges = np.array(writes, dtype=np.int64).reshape(-1, 2)
    want = set()
    for lo, n in writes:  # byte by byte: which row of which bank holds each byte
        for byte in range(lo, lo + n):
            for base, w in zip(offsets, widths, strict=True):
                if base <= byte < base + rows * w:
                    want.add((byte - base) // w)
    assert touched_rows(ranges, offsets, widths, rows).tolist() == sorted(want)
