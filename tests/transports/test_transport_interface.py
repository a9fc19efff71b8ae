"""The interface module: batch validation, coalescing, records and the registry."""

from __future__ import annotations

import ctypes
import itertools

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import transports.interface as interface
from refitd.errors import NotFoundError, ProtocolError
from transports.batch import (
    READ_DTYPE,
    as_read_batch,
    coalesce,
    split_shares,
    suspect_ranges,
    validate_batch,
)
from transports.interface import (
    AdvertisedRegion,
    ByteRange,
    PeerInfo,
    ReadRefused,
    UnknownScheme,
    create_transport,
    register_transport,
)
from transports.reference import ReferenceTransport

LOCAL = {1: 100, 2: 50}
REMOTE = {5: 80}

reads = st.tuples(
    st.sampled_from([0, 1, 2, 5]),
    st.integers(-3, 120),
    st.sampled_from([1, 5, 6]),
    st.integers(-3, 120),
    st.integers(-2, 90),
)


def in_bounds(r: tuple[int, int, int, int, int]) -> bool:
    lr, lo, rr, ro, n = r
    return (
        lr in LOCAL
        and rr in REMOTE
        and n >= 0
        and lo >= 0
        and ro >= 0
        and lo + n <= LOCAL[lr]
        and ro + n <= REMOTE[rr]
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(reads, max_size=6))
def test_validation_accepts_exactly_the_batches_whose_reads_are_all_in_bounds_and_disjoint(
    rows: list[tuple[int, int, int, int, int]],
) -> None:
    ok = all(in_bounds(r) for r in rows)
    if ok:
        spans = sorted((lr, lo, lo + n) for lr, lo, _, _, n in rows if n > 0)
        ok = all(a[0] != b[0] or b[1] >= a[2] for a, b in itertools.pairwise(spans))
    batch = as_read_batch(rows) if rows else np.zeros(0, READ_DTYPE)
    if ok:
        validate_batch(batch, LOCAL, REMOTE)
    else:
        with pytest.raises(ReadRefused) as exc:
            validate_batch(batch, LOCAL, REMOTE)
        assert "nothing in the batch was read" in str(exc.value)


def apply(batch: np.ndarray, dst: np.ndarray, src: np.ndarray) -> None:
    for r in batch:
        lo, ro, n = int(r["local_offset"]), int(r["remote_offset"]), int(r["nbytes"])
        dst[lo : lo + n] = src[ro : ro + n]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 15), st.integers(0, 3)), max_size=16, unique_by=lambda t: t[0]
    )
)
def test_coalescing_merges_neighbours_without_changing_what_lands(
    slots: list[tuple[int, int]],
) -> None:
    piece = 8
    b = np.array(
        [(1, s * piece, 5, (s + shift) * piece % 160, piece) for s, shift in slots], READ_DTYPE
    )
    src = np.arange(160, dtype=np.uint8)
    want, got = np.zeros(128, np.uint8), np.zeros(128, np.uint8)
    apply(b, want, src)
    merged = coalesce(b)
    apply(merged, got, src)
    assert np.array_equal(want, got)
    assert len(merged) <= len(b)


def test_a_contiguous_run_of_reads_becomes_one_read() -> None:
    b = as_read_batch([(1, i * 4, 5, 40 + i * 4, 4) for i in range(10)][::-1])
    assert coalesce(b).tolist() == [(1, 0, 5, 40, 40)]


def test_suspect_ranges_are_sorted_and_merged_per_region() -> None:
    b = as_read_batch(
        [(2, 0, 5, 0, 4), (1, 10, 5, 0, 5), (1, 0, 5, 0, 10), (1, 30, 5, 0, 1), (1, 40, 5, 0, 0)]
    )
    assert suspect_ranges(b) == [ByteRange(1, 0, 15), ByteRange(1, 30, 1), ByteRange(2, 0, 4)]


def test_a_refusal_names_the_read_its_regions_offsets_and_length() -> None:
    with pytest.raises(
        ReadRefused, match=r"read #0 \(local region 1 @ 90, remote region 5 @ 0, 20 bytes\) refused"
    ):
        validate_batch(as_read_batch([(1, 90, 5, 0, 20)]), LOCAL, REMOTE)


def test_a_signed_record_survives_encoding_and_any_changed_field_breaks_its_mac() -> None:
    secret = b"k" * 16
    info = PeerInfo("ucx", "a", b"addr", (AdvertisedRegion(1, 2, 3, 4, b"key"),)).signed(secret)
    PeerInfo.decode(info.encode()).verify(secret)
    for changed in (
        msgspec.structs.replace(info, address=b"addr2"),
        msgspec.structs.replace(info, peer_id="b"),
        msgspec.structs.replace(info, regions=(AdvertisedRegion(1, 3, 3, 4, b"key"),)),
        msgspec.structs.replace(info, regions=(AdvertisedRegion(1, 2, 3, 4, b"kez"),)),
        msgspec.structs.replace(info, regions=()),
    ):
        with pytest.raises(interface.UnauthenticatedPeer):
            changed.verify(secret)


def test_a_malformed_record_is_refused_as_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        PeerInfo.decode(b"\x01\x02garbage")


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ProtocolError, match="need at least 16 bytes"):
        ReferenceTransport(secret=b"short")


def test_an_unknown_scheme_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        UnknownScheme, match=r"'rdma' refused: not registered.*local.*reference.*ucx"
    ) as exc:
        create_transport("rdma", secret=b"k" * 16)
    assert isinstance(exc.value, NotFoundError)


async def test_a_deployment_registers_its_own_transport_by_scheme() -> None:
    class Counting(ReferenceTransport):
        scheme = "counting"
        copies = 0

        async def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
            type(self).copies += len(nbytes)
            for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
                ctypes.memmove(d, s, n)

    register_transport("counting", Counting)
    assert "counting" in interface.schemes()
    from transports.checks import check_scattered_batch, open_pair

    async with open_pair("counting", 64 << 10, 64 << 10) as pair:
        await check_scattered_batch(pair)
    assert Counting.copies == 16


def test_all_names_the_public_interface() -> None:
    public = {
        n
        for n, v in vars(interface).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == interface.__name__
    }
    assert public - {"ReadBatch", "ENTRY_POINT_GROUP"} <= set(interface.__all__)
    assert all(hasattr(interface, n) for n in interface.__all__)


def test_all_names_the_public_batch_algebra() -> None:
    import transports.batch as batch

    public = {
        n
        for n, v in vars(batch).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == batch.__name__
    }
    assert public <= set(batch.__all__)
    assert all(hasattr(batch, n) for n in batch.__all__)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 4))
def test_shares_cover_every_byte_once_and_are_about_equal(lengths: list[int], shares: int) -> None:
    n = np.array(lengths, np.int64)
    dst = np.cumsum(np.concatenate(([0], n[:-1]))) + 1000
    src = dst + 5000
    tag = np.arange(len(n), dtype=np.int64)
    covered: list[tuple[int, int, int]] = []
    parts = split_shares(dst, src, n, shares, tag)
    for d, s, ln, tg in parts:
        assert (s - d == 5000).all(), "a split moved a destination away from its source"
        covered += [(int(a), int(b), int(t)) for a, b, t in zip(d, ln, tg, strict=True)]
    covered.sort()
    spans = [(a, a + b) for a, b, _ in covered if b > 0]
    assert all(x[1] == y[0] for x, y in itertools.pairwise(spans)) or not spans
    assert sum(b for _, b, _ in covered) == int(n.sum())
    total = int(n.sum())
    if total and len(parts) > 1:
        assert max(int(p[2].sum()) for p in parts) <= total // shares + 1
