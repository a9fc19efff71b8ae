"""The daemon's pure state: versions, merged manifests, leases, bounds checks."""

from __future__ import annotations

import numpy as np
import pytest
from support.daemons import FakeClock

from refitd.daemon.pull.plancheck import validate_descriptors, validate_plan
from refitd.daemon.state.registry import KEEP_RETIRED, Registry, check_manifest_bounds
from refitd.errors import ConflictError, NotFoundError, ProtocolError
from refitd.wire import (
    DescriptorTable,
    ManifestIn,
    PackSpec,
    ShardEntry,
    TensorEntry,
    VersionState,
)


def manifest(version: int, part: int, parts: int = 2, rows: int = 4) -> ManifestIn:
    # Each part holds rows [part*2, part*2+2) of w, and a full replica of b.
    w = TensorEntry("w", (rows, 3), "float32", [ShardEntry((part * 2, 0), (2, 3), 1, 0)])
    b = TensorEntry("b", (3,), "float32", [ShardEntry((0,), (3,), 10 + part, 0)])
    return ManifestIn("toy", version, part, parts, [w, b])


@pytest.fixture
def reg() -> tuple[Registry, FakeClock]:
    clock = FakeClock(100.0)
    return Registry("node", 1, clock), clock


def test_a_version_is_pending_until_every_part_published(reg):
    r, _ = reg
    assert r.publish(manifest(1, 0)).state is VersionState.PENDING
    with pytest.raises(ConflictError, match="pending"):
        r.merged("toy", 1)
    assert r.publish(manifest(1, 1)).state is VersionState.READY


def test_merged_manifest_lists_each_replicated_block_once(reg):
    r, _ = reg
    r.publish(manifest(1, 0))
    r.publish(manifest(1, 1))
    merged = {t.name: t for t in r.merged("toy", 1).tensors}
    assert [s.offset for s in merged["w"].shards] == [(0, 0), (2, 0)]
    assert [s.region for s in merged["b"].shards] == [10]  # lowest part's replica kept


def test_a_newer_ready_version_retires_older_ones(reg):
    r, _ = reg
    for v in (1, 2):
        r.publish(manifest(v, 0))
        r.publish(manifest(v, 1))
    assert r.version("toy", 1).state is VersionState.RETIRED
    assert r.latest_ready("toy") == 2
    with pytest.raises(ConflictError, match="newer version"):
        r.acquire("toy", 1, 10.0)


def test_parts_that_disagree_on_a_tensor_shape_are_refused(reg):
    r, _ = reg
    r.publish(manifest(1, 0, rows=4))
    with pytest.raises(ConflictError, match="'w'"):
        r.publish(manifest(1, 1, rows=6))


def test_publishing_into_a_ready_version_is_refused_while_leased_and_after_the_lease_expires(reg):
    r, clock = reg
    r.publish(manifest(1, 0))
    r.publish(manifest(1, 1))
    grant = r.acquire("toy", 1, 5.0)
    with pytest.raises(ConflictError, match="never changes once ready"):
        r.publish(manifest(1, 0))
    assert r.next_expiry("toy", 1) == pytest.approx(5.0)
    clock.now += 5.0
    assert r.active_leases("toy", 1) == []
    with pytest.raises(ConflictError, match="expired"):
        r.check(grant.lease_id, "toy", 1)
    with pytest.raises(ConflictError, match="never changes once ready"):
        r.publish(manifest(1, 0))
    assert r.version("toy", 1).state is VersionState.READY


def test_publishing_into_a_retired_version_is_refused_so_a_model_never_has_two_ready_versions(reg):
    r, _ = reg
    r.publish(manifest(1, 0, parts=1))
    r.publish(manifest(2, 0, parts=1))
    assert r.version("toy", 1).state is VersionState.RETIRED
    with pytest.raises(ConflictError, match="retired"):
        r.publish(manifest(1, 0, parts=1))
    r.retire("toy", 2)
    with pytest.raises(ConflictError, match="retired"):
        r.publish(manifest(2, 0, parts=1))
    assert [v.state for v in r.versions("toy")] == [VersionState.RETIRED] * 2


def test_a_models_versions_only_move_forward_and_latest_never_goes_back(reg):
    r, _ = reg
    r.publish(manifest(5, 0, parts=1))
    with pytest.raises(ConflictError, match="only move forward"):
        r.publish(manifest(3, 0, parts=1))
    r.retire("toy", 5)
    with pytest.raises(ConflictError, match="only move forward"):
        r.publish(manifest(4, 0, parts=1))
    r.publish(manifest(7, 0, parts=2))  # pending: latest is not back to anything older
    with pytest.raises(NotFoundError):
        r.latest_ready("toy")
    r.publish(manifest(7, 1, parts=2))
    assert r.latest_ready("toy") == 7


def test_a_pending_part_published_again_is_a_no_op_if_identical_and_refused_if_not(reg):
    r, _ = reg
    first = r.publish(manifest(1, 0))
    assert r.publish(manifest(1, 0)) == first
    with pytest.raises(ConflictError, match="already published"):
        r.publish(manifest(1, 0, rows=6))


def test_a_renewed_lease_outlives_its_first_ttl_and_a_released_one_is_gone(reg):
    r, clock = reg
    r.publish(manifest(1, 0, parts=1))
    g = r.acquire("toy", 1, 5.0)
    clock.now += 4.0
    r.renew(g.lease_id, 5.0)
    clock.now += 4.0
    assert r.check(g.lease_id, "toy", 1).lease_id == g.lease_id
    r.release(g.lease_id)
    with pytest.raises(ConflictError, match="unknown or was released"):
        r.check(g.lease_id, "toy", 1)


def test_a_lease_on_one_version_does_not_authorise_another(reg):
    r, _ = reg
    r.publish(manifest(1, 0, parts=1))
    g = r.acquire("toy", 1, 5.0)
    with pytest.raises(ConflictError, match="not 'toy' version 2"):
        r.check(g.lease_id, "toy", 2)


def test_leasing_an_unknown_version_is_not_found(reg):
    r, _ = reg
    with pytest.raises(NotFoundError):
        r.acquire("toy", 9, 5.0)


def test_a_shard_overrunning_its_region_is_refused_naming_it():
    m = manifest(1, 0)
    with pytest.raises(ProtocolError, match="'w' shard 0"):
        check_manifest_bounds(m, {1: 20, 10: 12})
    check_manifest_bounds(m, {1: 24, 10: 12})
    with pytest.raises(NotFoundError, match="unknown region 10"):
        check_manifest_bounds(m, {1: 24})


def table(rows: list[list[int]]) -> DescriptorTable:
    return DescriptorTable.pack(np.array(rows, dtype=np.int64).reshape(-1, 5))


def test_descriptors_inside_both_regions_pass_including_zero_length_at_the_end():
    rows = validate_descriptors(table([[1, 0, 2, 0, 8], [1, 16, 2, 8, 0]]), {1: 16}, {2: 8})
    assert rows.shape == (2, 5)


@pytest.mark.parametrize(
    "bad",
    [
        [1, 12, 2, 0, 8],  # source overrun
        [1, 0, 2, 4, 8],  # destination overrun
        [1, -1, 2, 0, 1],  # negative offset
        [1, 0, 2, 0, -1],  # negative size
        [3, 0, 2, 0, 1],  # unknown source region
        [1, 0, 3, 0, 1],  # unknown destination region
        [1, 2**62, 2, 0, 2**62],  # offset + size past int64 range
    ],
)
def test_the_first_bad_descriptor_is_refused_by_index(bad):
    with pytest.raises(ProtocolError, match="descriptor 1 refused"):
        validate_descriptors(table([[1, 0, 2, 0, 4], bad]), {1: 16}, {2: 8})


def test_a_truncated_descriptor_payload_is_refused():
    with pytest.raises(ProtocolError, match="40-byte rows"):
        DescriptorTable(b"\0" * 41).rows()


NO_ROWS = np.zeros((0, 5), dtype=np.int64)


def test_a_pack_spec_whose_strided_span_leaves_the_source_is_refused():
    ok = PackSpec(1, 0, (2, 2), (4, 1), 4, 2, 0)  # rows 0..1, cols 0..1 of a 2x4 f32
    validate_plan(NO_ROWS, [ok], {1: 32}, {2: 16})
    with pytest.raises(ProtocolError, match=r"pack spec 0 .*bytes \[8, 32\) of region 1"):
        validate_plan(NO_ROWS, [PackSpec(1, 8, (2, 2), (4, 1), 4, 2, 0)], {1: 24}, {2: 16})
    with pytest.raises(ProtocolError, match=r"pack spec 0 .*end past the destination"):
        validate_plan(NO_ROWS, [ok], {1: 32}, {2: 15})


def test_a_pack_spec_with_a_negative_stride_is_checked_on_the_span_it_really_reads():
    # Elements at byte 8 then 4 then 0: a span of [0, 12), though it starts at 8.
    back = PackSpec(1, 8, (3,), (-1,), 4, 2, 0)
    validate_plan(NO_ROWS, [back], {1: 12}, {2: 12})
    with pytest.raises(ProtocolError, match=r"pack spec 0 .*outside the source"):
        validate_plan(NO_ROWS, [PackSpec(1, 4, (3,), (-1,), 4, 2, 0)], {1: 12}, {2: 12})


def test_descriptors_and_pack_specs_are_refused_by_the_one_overlap_check_naming_both():
    rows = np.array([[1, 0, 2, 0, 8], [1, 8, 2, 8, 8]], dtype=np.int64)
    spec = PackSpec(1, 0, (2,), (1,), 4, 2, 12)  # 8 packed bytes at dst+12
    with pytest.raises(ProtocolError, match=r"descriptor 1 and pack spec 0 refused: .*overlap"):
        validate_plan(rows, [spec], {1: 32}, {2: 32})
    with pytest.raises(ProtocolError, match="pack spec 0 and pack spec 1 refused"):
        validate_plan(NO_ROWS, [spec, spec], {1: 32}, {2: 32})
    validate_plan(rows, [PackSpec(1, 0, (2,), (1,), 4, 2, 16)], {1: 32}, {2: 32})


def test_a_pack_spec_whose_shape_and_strides_disagree_is_refused_naming_it():
    with pytest.raises(ProtocolError, match=r"pack spec 1 .*disagree"):
        validate_plan(
            NO_ROWS,
            [PackSpec(1, 0, (2,), (1,), 4, 2, 0), PackSpec(1, 0, (2, 2), (1,), 4, 2, 8)],
            {1: 32},
            {2: 32},
        )


def test_a_long_transport_read_is_cut_into_pieces_covering_exactly_the_same_bytes():
    from transports.batch import as_read_batch, split_pieces

    reads = as_read_batch(np.array([[1, 0, 2, 100, 70], [3, 5, 4, 7, 10]], dtype=np.int64))
    out = split_pieces(reads, 32)
    assert [list(r) for r in out.tolist()] == [
        [1, 0, 2, 100, 32],
        [1, 32, 2, 132, 32],
        [1, 64, 2, 164, 6],
        [3, 5, 4, 7, 10],
    ]


def test_a_retired_version_refuses_new_leases_while_held_ones_stay_valid(reg):
    r, _ = reg
    r.publish(manifest(1, 0, parts=1))
    held = r.acquire("toy", 1, 10.0)
    assert r.retire("toy", 1).state is VersionState.RETIRED
    with pytest.raises(ConflictError, match="retired"):
        r.acquire("toy", 1, 10.0)
    assert r.check(held.lease_id, "toy", 1).lease_id == held.lease_id
    assert r.next_expiry("toy", 1) == pytest.approx(10.0)


def test_a_model_published_a_version_a_step_keeps_a_bounded_number_of_retired_records(reg):
    r, _ = reg
    for v in range(1, 201):
        r.publish(manifest(v, 0, parts=1))
    states = [(x.version, x.state) for x in r.versions("toy")]
    # The newest READY, and the last KEEP_RETIRED retired ones, still answered.
    assert states == [(v, VersionState.RETIRED) for v in range(192, 200)] + [
        (200, VersionState.READY)
    ]
    with pytest.raises(NotFoundError):
        r.version("toy", 1)
    # Forgotten records do not reopen old numbers: versions still only move forward.
    with pytest.raises(ConflictError, match="only move forward"):
        r.publish(manifest(1, 0, parts=1))


def test_a_leased_retired_version_keeps_its_record_until_the_lease_ends(reg):
    r, _ = reg
    r.publish(manifest(1, 0, parts=1))
    lease = r.acquire("toy", 1, 10.0)
    for v in range(2, 2 + 3 * KEEP_RETIRED):
        r.publish(manifest(v, 0, parts=1))
    assert r.version("toy", 1).state is VersionState.RETIRED
    assert r.check(lease.lease_id, "toy", 1).version == 1
    assert r.scope("toy", 1), "its scope (what the lease may read) went with its record"
    r.release(lease.lease_id)
    # Let go last: now among the records kept, forgotten once KEEP_RETIRED more go.
    assert r.version("toy", 1).state is VersionState.RETIRED
    for v in range(2 + 3 * KEEP_RETIRED, 2 + 4 * KEEP_RETIRED):
        r.publish(manifest(v, 0, parts=1))
    with pytest.raises(NotFoundError):
        r.version("toy", 1)


def test_a_pending_version_the_cluster_completes_elsewhere_is_leased_and_never_expires() -> None:
    clock = FakeClock(100.0)
    asked: list[tuple[str, int]] = []

    def elsewhere(model: str, version: int) -> bool:
        asked.append((model, version))
        return version == 1  # the cluster holds version 1's other part, not version 2's

    r = Registry("node", 1, clock, pending_ttl_s=60, complete_elsewhere=elsewhere)
    r.publish(manifest(1, 0))
    r.publish(manifest(2, 0))
    grant = r.acquire("toy", 1, 10.0)  # served for the part held here
    assert r.check(grant.lease_id, "toy", 1).version == 1
    with pytest.raises(ConflictError, match="pending"):
        r.acquire("toy", 2, 10.0)
    clock.now += 61
    assert r.expire_pending() == [("toy", 2)]  # only the one nobody completes
    assert r.version("toy", 1).state is VersionState.PENDING
    assert ("toy", 1) in asked


def test_a_registry_built_without_a_cluster_never_completes_a_version_elsewhere(reg) -> None:
    r, _ = reg
    r.publish(manifest(1, 0))
    assert not r.complete_elsewhere("toy", 1)
    with pytest.raises(ConflictError, match="pending"):
        r.acquire("toy", 1, 10.0)
