"""Every transport passes the same contract checks over real loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from transports import checks
from transports.checks import Pair, open_pair

# (scheme, options for the pulling transport); ucx with one lane and with two, tcp
# with one lane and its default four, so both the single-lane and the
# split-across-lanes paths meet the contract.
SCHEMES = [
    ("reference", {}),
    ("local", {}),
    ("shm", {}),
    ("ucx", {"lanes": 1}),
    ("ucx", {"lanes": 2}),
    ("tcp", {"lanes": 1}),
    ("tcp", {}),
]
IDS = ["reference", "local", "shm", "ucx-1-lane", "ucx-2-lanes", "tcp-1-lane", "tcp-4-lanes"]


@pytest.fixture(params=SCHEMES, ids=IDS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    scheme, options = request.param
    async with open_pair(scheme, 65 << 20, 65 << 20, **options) as p:
        yield p


@pytest.fixture(params=SCHEMES, ids=IDS)
async def small_pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    scheme, options = request.param
    async with open_pair(scheme, 4 << 20, 4 << 20, **options) as p:
        yield p


async def test_reads_of_0_b_1_b_4_kib_1_mib_and_64_mib_land_byte_exact(pair: Pair) -> None:
    await checks.check_sizes(pair)


async def test_a_shuffled_batch_of_4_kib_pieces_lands_each_piece_in_its_slot(
    small_pair: Pair,
) -> None:
    await checks.check_scattered_batch(small_pair)


async def test_a_contiguous_batch_lands_like_one_copy_in_any_read_order(small_pair: Pair) -> None:
    await checks.check_contiguous_batch(small_pair)


async def test_concurrent_batches_into_disjoint_ranges_all_complete(small_pair: Pair) -> None:
    await checks.check_concurrent_batches(small_pair)


async def test_structured_int64_and_tuple_batches_mean_the_same_reads(small_pair: Pair) -> None:
    await checks.check_input_forms(small_pair)
