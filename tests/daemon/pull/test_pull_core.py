"""The pure core of a pull (:mod:`refitd.daemon.pull.core`): values in, values out.

Every input here is a real wire value (region records, a descriptor table, pack
specs, signed transport records); no daemon, no socket, no memory is involved.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.daemon.pull import core as pullcore
from refitd.daemon.pull.paths import choose_remote
from refitd.errors import AccessDenied, ConflictError, ProtocolError, TransportError
from refitd.wire import (
    DescriptorTable,
    MemoryKind,
    PackSpec,
    PeerRegions,
    PullRequest,
    RegionInfo,
    StagedPack,
)
from transports.interface import Capabilities, PeerInfo, transport_class
from transports.local import pack_strided

pytestmark = pytest.mark.timeout(30)

SECRET = b"c" * 32
LEASE = "lease-1"

TCP = transport_class("tcp").capabilities
UCX = transport_class("ucx").capabilities


def region(rid: int, nbytes: int, handle: str = "") -> RegionInfo:
    return RegionInfo(rid, MemoryKind.HOST, handle or f"seg{rid}", nbytes, 7)


def request(rows: list[list[int]], specs: list[PackSpec] | None = None) -> PullRequest:
    table = DescriptorTable.pack(np.array(rows, dtype=np.int64).reshape(-1, 5))
    return PullRequest("m", 1, LEASE, table, specs or [])


def peer(
    regions: list[RegionInfo],
    scope: dict[int, list[tuple[int, int]]],
    lease: str = LEASE,
    adverts: dict[str, bytes] | None = None,
) -> PeerRegions:
    return PeerRegions(
        "src",
        7,
        "auto",
        regions,
        lease_id=lease,
        scope=scope,
        adverts=adverts or {},
    )


def advert(scheme: str) -> bytes:
    return PeerInfo(scheme, "src", b"addr", ()).signed(SECRET).encode()


# ---------------------------------------------------------------- what a pull touches


def test_source_and_destination_ids_and_bytes_count_descriptors_and_pack_specs() -> None:
    spec = PackSpec(5, 0, (4, 2), (8, 1), 4, 9, 64)
    req = request([[1, 0, 2, 0, 16], [3, 8, 2, 16, 8]], [spec])
    rows = req.descriptors.rows()
    assert pullcore.source_ids(rows, req.pack_specs) == [1, 3, 5]
    assert pullcore.dst_ids(rows, req.pack_specs) == {2, 9}
    assert pullcore.total_bytes(rows, req.pack_specs) == 16 + 8 + 4 * 2 * 4


# ---------------------------------------------------------------- validation


def test_a_plan_inside_both_records_and_the_lease_scope_passes() -> None:
    req = request([[1, 0, 2, 0, 64], [1, 64, 2, 64, 64]])
    src = peer([region(1, 128)], {1: [(0, 128)]})
    pullcore.check_plan(req.descriptors.rows(), req, src, {2: 128})


def test_the_first_descriptor_leaving_its_source_region_is_named_and_refused() -> None:
    req = request([[1, 0, 2, 0, 64], [1, 100, 2, 64, 64]])
    src = peer([region(1, 128)], {1: [(0, 128)]})
    with pytest.raises(ProtocolError, match=r"descriptor 1 refused.*ends past the source"):
        pullcore.check_plan(req.descriptors.rows(), req, src, {2: 128})


def test_a_descriptor_into_a_region_this_daemon_does_not_hold_is_refused() -> None:
    req = request([[1, 0, 3, 0, 64]])
    src = peer([region(1, 128)], {1: [(0, 128)]})
    with pytest.raises(ProtocolError, match="destination region is not recorded"):
        pullcore.check_plan(req.descriptors.rows(), req, src, {2: 128})


def test_a_read_outside_the_lease_scope_is_refused_though_in_bounds() -> None:
    req = request([[1, 0, 2, 0, 64], [1, 64, 2, 64, 64]])
    src = peer([region(1, 128)], {1: [(0, 64)]})
    with pytest.raises(AccessDenied, match=r"descriptor 1 refused.*lease 'lease-1'"):
        pullcore.check_plan(req.descriptors.rows(), req, src, {2: 128})


def test_a_pack_spec_reading_outside_the_lease_scope_is_refused() -> None:
    spec = PackSpec(1, 64, (4,), (1,), 4, 2, 0)  # bytes [64, 80) of region 1
    req = request([], [spec])
    src = peer([region(1, 128)], {1: [(0, 64)]})
    with pytest.raises(AccessDenied):
        pullcore.check_plan(req.descriptors.rows(), req, src, {2: 128})


def test_records_given_under_another_lease_are_refused() -> None:
    req = request([[1, 0, 2, 0, 8]])
    src = peer([region(1, 128)], {1: [(0, 128)]}, lease="someone-else")
    with pytest.raises(ProtocolError, match="given under lease 'someone-else'"):
        pullcore.check_plan(req.descriptors.rows(), req, src, {2: 128})


def test_staged_offsets_are_checked_like_descriptors() -> None:
    specs = [PackSpec(1, 0, (2,), (1,), 8, 2, 0), PackSpec(1, 16, (2,), (1,), 8, 2, 16)]
    req = request([], specs)
    staging = region(40, 32)
    sp = peer([staging], {40: [(0, 32)]})
    extra = pullcore.staged_rows(StagedPack(staging, [0, 16]), specs)
    assert extra.tolist() == [[40, 0, 2, 0, 16], [40, 16, 2, 16, 16]]
    pullcore.check_staged(extra, sp, req, {2: 32})
    forged = pullcore.staged_rows(StagedPack(staging, [0, 24]), specs)  # leaves the region
    with pytest.raises(ProtocolError, match="descriptor 1 refused"):
        pullcore.check_staged(forged, sp, req, {2: 32})


def test_merging_the_staging_record_keeps_the_first_records_and_adds_its_own() -> None:
    a = peer([region(1, 128)], {1: [(0, 128)]}, adverts={"tcp": b"t", "shm": b"s1"})
    b = peer([region(1, 999), region(40, 32)], {40: [(0, 32)]}, adverts={"ucx": b"u", "shm": b"s2"})
    m = pullcore.merge_peer(a, b)
    assert [(r.region_id, r.nbytes) for r in m.regions] == [(1, 128), (40, 32)]
    assert m.scope == {1: [(0, 128)], 40: [(0, 32)]}
    # The staging record's same-host advertisement is the newer one (it lists both).
    assert m.adverts == {"tcp": b"t", "ucx": b"u", "shm": b"s2"}


# ---------------------------------------------------------------- path choice


def test_only_auto_and_shm_modes_try_shm_for_another_daemon() -> None:
    assert pullcore.tries_shm("auto") and pullcore.tries_shm("shm")
    assert not pullcore.tries_shm("tcp") and not pullcore.tries_shm("ucx")


def test_a_refused_shm_path_is_the_end_in_shm_mode_and_a_reason_in_auto() -> None:
    assert pullcore.shm_refused("auto", "src", "another boot") == "another boot"
    with pytest.raises(TransportError, match=r"shared-memory path only.*another boot"):
        pullcore.shm_refused("shm", "src", "another boot")


def test_auto_prefers_ucx_when_both_ends_run_it_else_tcp() -> None:
    both = peer([], {}, adverts={"tcp": advert("tcp"), "ucx": advert("ucx")})
    assert choose_remote("auto", {"tcp": TCP, "ucx": UCX}, both, "x")[0] == "ucx"
    assert choose_remote("auto", {"tcp": TCP}, both, "x")[0] == "tcp"
    scheme, why = choose_remote(
        "auto", {"tcp": TCP, "ucx": UCX}, peer([], {}, adverts={"tcp": advert("tcp")}), "far"
    )
    assert scheme == "tcp" and "not shm because far" in why


def test_auto_prefers_rdma_by_what_a_transport_can_do_not_by_its_name() -> None:
    # A deployment's own transport (an entry point) with RDMA is preferred as UCX is;
    # UCX without it is not: the choice asks the transports, never their names.
    both = peer([], {}, adverts={"tcp": advert("tcp"), "verbs": advert("verbs")})
    mine = {"tcp": TCP, "verbs": Capabilities(rdma=True)}
    scheme, why = choose_remote("auto", mine, both, "x")
    assert scheme == "verbs" and "both ends run verbs with RDMA" in why
    ucx = peer([], {}, adverts={"tcp": advert("tcp"), "ucx": advert("ucx")})
    plain = {"tcp": TCP, "ucx": Capabilities()}
    assert choose_remote("auto", plain, ucx, "x")[0] == "tcp"


def test_a_forced_scheme_the_peer_does_not_serve_is_refused() -> None:
    tcp_only = peer([], {}, adverts={"tcp": advert("tcp")})
    assert choose_remote("tcp", {"tcp": TCP}, tcp_only, "x") == (
        "tcp",
        "forced (--transport tcp)",
    )
    with pytest.raises(TransportError, match="it serves tcp, this daemon ucx"):
        choose_remote("ucx", {"ucx": UCX}, tcp_only, "x")
    with pytest.raises(TransportError, match="advertises no data plane"):
        choose_remote("auto", {"tcp": TCP}, peer([], {}), "x")
    # Its same-host advertisement is no path to another host.
    shm_only = peer([], {}, adverts={"shm": advert("shm")})
    with pytest.raises(TransportError, match="advertises no data plane"):
        choose_remote("auto", {"tcp": TCP}, shm_only, "x")


# ---------------------------------------------------------------- pacing


def test_a_read_longer_than_a_piece_is_cut_and_done_only_at_its_last_piece() -> None:
    rows = np.array([[1, 0, 2, 0, 10], [1, 10, 2, 10, 3]], dtype=np.int64)
    reads, ends = pullcore.cut(rows, pullcore.Pace(piece=4, reads=100, max_bytes=100))
    assert reads["nbytes"].tolist() == [4, 4, 2, 3]
    assert reads["remote_offset"].tolist() == [0, 4, 8, 10]
    assert reads["local_offset"].tolist() == [0, 4, 8, 10]
    assert ends.tolist() == [0, 0, 1, 1]


def test_shm_reads_are_not_cut() -> None:
    rows = np.array([[1, 0, 2, 0, 1 << 40]], dtype=np.int64)
    reads, ends = pullcore.cut(rows, pullcore.pace_for(transport_class("shm").capabilities))
    assert reads["nbytes"].tolist() == [1 << 40] and ends.tolist() == [1]
    assert pullcore.pace_for(UCX) == pullcore.TRANSPORT_PACE


def test_a_path_is_paced_as_its_transport_says() -> None:
    caps = Capabilities(piece=4, batch_reads=3)
    pace = pullcore.pace_for(caps)
    assert (pace.piece, pace.reads) == (4, 3)
    assert pullcore.pace_for(TCP).reads == 16384  # many small reads a batch over tcp


def test_spans_hold_at_most_their_reads_and_about_their_bytes_and_cover_every_read() -> None:
    sizes = np.array([3, 3, 3, 10, 1, 1, 1, 1], dtype=np.int64)
    spans = pullcore.spans(sizes, max_reads=3, max_bytes=6)
    assert spans == [(0, 2), (2, 3), (3, 4), (4, 7), (7, 8)]
    assert all(hi - lo <= 3 for lo, hi in spans)
    assert pullcore.spans(np.zeros(0, dtype=np.int64), 3, 6) == []


# ---------------------------------------------------------------- outcomes


def test_suspect_ranges_are_the_destinations_sorted_and_merged() -> None:
    rows = np.array(
        [[1, 0, 2, 8, 8], [1, 0, 2, 0, 8], [1, 0, 3, 4, 0], [1, 0, 3, 0, 4]], dtype=np.int64
    )
    assert pullcore.suspect(rows) == [(2, 0, 16), (3, 0, 4)]


def test_an_error_keeps_a_refit_error_class_and_names_anything_else_a_transport_error() -> None:
    where = pullcore.source_name("http://h:1", peer([], {}))
    assert where == "'src' at http://h:1"
    assert pullcore.source_name("", None) == "this daemon"
    e = pullcore.failed("p1", where, ConflictError("lease gone"))
    assert (e.error, e.detail) == (
        "ConflictError",
        "pull p1 from 'src' at http://h:1 failed: lease gone",
    )
    assert pullcore.failed("p1", where, OSError("boom")).error == "TransportError"
    assert pullcore.cancelled("p2", "by request").error == "ConflictError"
    assert "left" in pullcore.source_gone("p3", where, "it left").detail


def test_rows_pass_through_the_wire_table_unchanged() -> None:
    req = request([[1, 2, 3, 4, 5]])
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=PullRequest)
    assert pullcore.dst_ids(again.descriptors.rows(), []) == {3}


# ---------------------------------------------------------------- pack specs read directly


@st.composite
def strided_blocks(draw: st.DrawFn) -> tuple[int, list[PackSpec]]:
    """A source of ``size`` bytes and pack specs of blocks inside it: dense trailing
    runs (long enough to be read directly), any outer strides, zero-size blocks too."""
    itemsize = draw(st.sampled_from([1, 2, 4]))
    specs, dst = [], 0
    for _ in range(draw(st.integers(1, 4))):
        inner = draw(st.integers(pullcore.MIN_DIRECT_RUN // itemsize, 300))
        outer = draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))
        shape = (*outer, inner)
        strides, step = [1], inner
        for n in reversed(outer):
            step += draw(st.integers(0, 64))  # a gap between runs, or none
            strides.insert(0, step)
            step *= max(n, 1)
        spec = PackSpec(
            1, draw(st.integers(0, 64)) * itemsize, shape, tuple(strides), itemsize, 2, dst
        )
        specs.append(spec)
        dst += spec.nbytes
    size = max(
        s.src_offset
        + itemsize * (1 + sum(st_ * (n - 1) for st_, n in zip(s.strides, s.shape) if n))
        for s in specs
    )
    return size, specs


@settings(max_examples=150, deadline=None)
@given(strided_blocks())
def test_pack_specs_read_directly_land_exactly_the_bytes_the_source_would_pack(
    case: tuple[int, list[PackSpec]],
) -> None:
    size, specs = case
    src = np.random.default_rng(len(specs)).integers(0, 255, size, dtype=np.uint8)
    total = sum(s.nbytes for s in specs)
    packed = bytearray(total)
    for s in specs:  # the source's own gather, as the staging pack runs it
        pack_strided(
            memoryview(src),
            s.src_offset,
            s.shape,
            s.strides,
            s.itemsize,
            memoryview(packed),
            s.dst_offset,
        )
    out = pullcore.direct_reads(specs)
    assert out is not None
    rows, ends = out
    direct = np.zeros(total, dtype=np.uint8)
    for src_region, src_off, dst_region, dst_off, n in rows.tolist():
        assert (src_region, dst_region) == (1, 2)
        direct[dst_off : dst_off + n] = src[src_off : src_off + n]
    assert direct.tobytes() == bytes(packed)
    # one descriptor per spec: its last row
    assert int(ends.sum()) == len(specs) and ends[-1] == 1


def test_short_runs_or_too_many_rows_are_left_for_the_source_to_pack() -> None:
    short = PackSpec(1, 0, (8, 16), (32, 1), 2, 2, 0)  # 32-byte runs
    assert pullcore.direct_reads([short]) is None
    column = PackSpec(1, 0, (64, 128), (1, 64), 4, 2, 0)  # a transposed block: 4-byte runs
    assert pullcore.direct_reads([column]) is None
    many = PackSpec(1, 0, (5000, 256), (512, 1), 1, 2, 0)
    assert pullcore.direct_reads([many], max_rows=4999) is None
    rows, ends = pullcore.direct_reads([many]) or (None, None)
    assert rows is not None and ends is not None and len(rows) == 5000 and ends.sum() == 1
