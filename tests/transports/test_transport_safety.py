"""Refusals, one case per test, on every transport: a bad read or record moves nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import numpy as np
import pytest

from refitd.errors import ProtocolError
from transports.batch import READ_DTYPE
from transports.checks import LOCAL, REMOTE, Pair, check_refusal_reads_nothing, open_pair
from transports.interface import TransportClosed, UnauthenticatedPeer

SIZE = 1 << 20
BIG = (1 << 63) - 1


@pytest.fixture(params=["reference", "local", "ucx", "tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    async with open_pair(request.param, SIZE, SIZE) as p:
        yield p


async def test_a_read_past_the_end_of_the_remote_region_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(
        pair, (LOCAL, 0, REMOTE, SIZE - 10, 11), "remote range ends past"
    )


async def test_a_read_past_the_end_of_the_local_region_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(
        pair, (LOCAL, SIZE - 1, REMOTE, 0, 2), "local range ends past"
    )


async def test_a_negative_remote_offset_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(
        pair, (LOCAL, 8192, REMOTE, -4096, 4096), "negative remote offset"
    )


async def test_a_negative_local_offset_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(pair, (LOCAL, -1, REMOTE, 0, 1), "negative local offset")


async def test_a_negative_length_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(pair, (LOCAL, 8192, REMOTE, 0, -1), "negative length")


async def test_an_offset_plus_length_that_would_overflow_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(pair, (LOCAL, 8192, REMOTE, BIG, 2), "remote range ends past")


async def test_an_unknown_local_region_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(
        pair, (LOCAL + 1, 0, REMOTE, 0, 1), "not registered with this transport"
    )


async def test_a_region_the_peer_did_not_advertise_is_refused(pair: Pair) -> None:
    # LOCAL is registered here but is not in the peer's record: a foreign region.
    await check_refusal_reads_nothing(
        pair, (LOCAL, 8192, LOCAL, 0, 1), "not in the peer's authenticated record"
    )


async def test_a_zero_length_read_beyond_the_end_is_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(
        pair, (LOCAL, 8192, REMOTE, SIZE + 1, 0), "remote range ends past"
    )


async def test_overlapping_destinations_in_one_batch_are_refused(pair: Pair) -> None:
    await check_refusal_reads_nothing(pair, (LOCAL, 4095, REMOTE, 0, 2), "overlaps read #0")


async def test_a_zero_length_read_at_the_very_end_is_allowed_and_moves_nothing(pair: Pair) -> None:
    pair.local.numpy()[:] = 1
    await pair.peer.get(np.array([(LOCAL, SIZE, REMOTE, SIZE, 0)], READ_DTYPE))
    assert (pair.local.numpy() == 1).all()


async def test_an_empty_batch_is_a_no_op(pair: Pair) -> None:
    await pair.peer.get(np.zeros(0, READ_DTYPE))


async def test_a_batch_of_the_wrong_shape_is_refused(pair: Pair) -> None:
    with pytest.raises(ProtocolError, match="neither READ_DTYPE nor int64"):
        await pair.peer.get(np.zeros((3, 4), np.int64))


def _tamper(pair: Pair, **changes: object) -> object:
    info = pair.source.advertise()
    region = msgspec.structs.replace(info.regions[0], **changes)
    return msgspec.structs.replace(info, regions=(region,))


async def test_a_record_with_a_tampered_size_is_refused_before_connecting(pair: Pair) -> None:
    forged = _tamper(pair, size=SIZE * 2)
    with pytest.raises(UnauthenticatedPeer, match="MAC does not verify"):
        await pair.puller.connect(forged)  # type: ignore[arg-type]


async def test_a_record_with_a_tampered_key_is_refused_and_the_data_plane_survives(
    pair: Pair,
) -> None:
    pid = getattr(pair.puller, "pid", None)
    forged = _tamper(pair, key=b"\xff" * 64)
    with pytest.raises(UnauthenticatedPeer):
        await pair.puller.connect(forged)  # type: ignore[arg-type]
    with pytest.raises(UnauthenticatedPeer):
        await pair.peer.update(forged)  # type: ignore[arg-type]
    assert getattr(pair.puller, "pid", None) == pid, "the data-plane process was touched"
    await pair.peer.get([(LOCAL, 0, REMOTE, 0, 4096)])
    assert np.array_equal(pair.local.numpy()[:4096], pair.remote.numpy()[:4096])


async def test_a_record_signed_with_another_secret_is_refused(pair: Pair) -> None:
    foreign = pair.source.advertise().signed(b"another-deployment-secret")
    with pytest.raises(UnauthenticatedPeer):
        await pair.puller.connect(foreign)


async def test_a_closed_peer_refuses_to_read(pair: Pair) -> None:
    await pair.peer.close()
    with pytest.raises(TransportClosed, match="closed"):
        await pair.peer.get([(LOCAL, 0, REMOTE, 0, 1)])
