"""ReshardReceiver: fail closed before any transfer, then plan once and replay.

The transport here is the reference one, counting what it is asked to move, so a
refusal can be shown to have moved nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refitd.reshard.compile import SignatureMismatch, dest_layout_of
from refitd.reshard.coverage import destinations_of, unwritten
from refitd.reshard.reads import InMemoryReadExecutor, PackedRead, ReadDescriptor
from refitd.reshard.receiver import ReshardReceiver, _replay_ops
from refitd.reshard.replay import replay_ops
from refitd.reshard.types import CaptureResult, IncompleteRefit, RecordedCopy, UnsupportedReshard


class CountingTransport(InMemoryReadExecutor):
    def __init__(self) -> None:
        self.reads = 0

    def read(self, descriptors: list[ReadDescriptor]) -> None:
        self.reads += len(descriptors)
        super().read(descriptors)

    def read_packed(self, reads: list[PackedRead]) -> None:
        self.reads += len(reads)
        super().read_packed(reads)


def _world(kit: Any, base: int, blocks: int = 4) -> tuple[Any, torch.Tensor]:
    full = kit.distinct((32, 16), base=base)
    pub = kit.Published()
    pub.add("w", full, kit.dim_blocks((32, 16), 0, blocks))
    return pub, full


def _receiver(kit: Any, param: torch.Tensor, **kw: Any) -> ReshardReceiver:
    copy = kit.copy_record("w", (("narrow", (1, 4, 8), ()),), "p", param)
    return ReshardReceiver(CaptureResult(copies=[copy]), **kw)


def test_the_replay_helper_is_the_movement_op_replay() -> None:
    assert _replay_ops is replay_ops


def test_unattributed_writes_are_refused_before_any_transfer(kit: Any) -> None:
    pub, _ = _world(kit, 1)
    param = torch.zeros(32, 8)
    recv = _receiver(kit, param)
    recv.capture.unattributed = 2
    transport = CountingTransport()
    with pytest.raises(UnsupportedReshard, match="2 copy_ write"):
        recv.refit(pub.sources, lambda n: param.data_ptr(), transport, dest_layout_of({"p": param}))
    assert transport.reads == 0 and not param.any()


def test_unsupported_sources_are_refused_with_grouped_causes_before_any_transfer(kit: Any) -> None:
    pub, _ = _world(kit, 1)
    param = torch.zeros(32, 8)
    reasons = {f"e{i}": f"unsupported op aten.mul on lazy 'e{i}' (chain=())" for i in range(3)}
    recv = _receiver(kit, param)
    recv.capture.unsupported = list(reasons)
    recv.capture.unsupported_reasons = reasons
    transport = CountingTransport()
    with pytest.raises(UnsupportedReshard, match=r"unsupported op aten\.mul \(3 sources\)"):
        recv.refit(pub.sources, lambda n: param.data_ptr(), transport, dest_layout_of({"p": param}))
    assert transport.reads == 0 and not param.any()


def test_a_source_missing_from_the_manifest_is_refused_before_any_transfer(kit: Any) -> None:
    param = torch.zeros(32, 8)
    transport = CountingTransport()
    with pytest.raises(UnsupportedReshard, match="not in the published manifest"):
        _receiver(kit, param).refit({}, lambda n: param.data_ptr(), transport, {})
    assert transport.reads == 0


def test_refits_plan_once_and_replay_while_the_signature_holds(kit: Any) -> None:
    param = torch.zeros(32, 8)
    dest = dest_layout_of({"p": param})
    recv = _receiver(kit, param)
    for version in range(3):
        pub, full = _world(kit, 1 + 1000 * version)
        stats = recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
        assert torch.equal(param, full[:, 4:12]) and stats["bytes"] == 32 * 8 * 4
    assert recv.replans == 1
    pub, full = _world(kit, 7, blocks=2)  # the trainer re-sharded: replan, still exact
    recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
    assert recv.replans == 2 and torch.equal(param, full[:, 4:12])


def test_two_layouts_in_turn_are_planned_once_each_and_a_fifth_is_the_oldest_forgotten(
    kit: Any,
) -> None:
    param = torch.zeros(32, 8)
    dest = dest_layout_of({"p": param})
    recv = _receiver(kit, param)
    for version in range(6):  # a double-buffered trainer: two shard layouts in turn
        pub, full = _world(kit, 1 + version, blocks=(4, 2)[version % 2])
        recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
        assert torch.equal(param, full[:, 4:12])
    assert recv.replans == 2
    for blocks in (1, 8, 16, 32):  # four more layouts: the first two leave the cache
        pub, full = _world(kit, 100 + blocks, blocks=blocks)
        recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
    assert recv.replans == 6
    pub, full = _world(kit, 7, blocks=4)
    recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
    assert recv.replans == 7 and torch.equal(param, full[:, 4:12])


def test_a_strict_receiver_replays_only_the_signature_it_was_warmed_on(kit: Any) -> None:
    param = torch.zeros(32, 8)
    dest = dest_layout_of({"p": param})
    recv = _receiver(kit, param, strict=True)
    pub, full = _world(kit, 1)
    with pytest.raises(SignatureMismatch, match="warm"):
        recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
    recv.warm(pub.sources, dest)
    recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
    assert torch.equal(param, full[:, 4:12])
    moved, _ = _world(kit, 99, blocks=8)
    transport = CountingTransport()
    with pytest.raises(SignatureMismatch, match="Re-plan"):
        recv.refit(moved.sources, lambda n: param.data_ptr(), transport, dest)
    assert transport.reads == 0 and recv.replans == 1


def test_a_plan_leaving_any_parameter_or_buffer_unwritten_is_refused_naming_each(
    kit: Any,
) -> None:
    pub, _ = _world(kit, 1)
    param, other = torch.zeros(32, 8), torch.zeros(4)
    half = kit.copy_record(
        "w", (("narrow", (0, 0, 16), ()), ("narrow", (1, 4, 8), ())), "p", param[:16]
    )
    recv = ReshardReceiver(CaptureResult(copies=[half]))
    engine = torch.nn.Module()
    engine.p = torch.nn.Parameter(param, requires_grad=False)
    engine.q = torch.nn.Parameter(other, requires_grad=False)
    engine.register_buffer("running", torch.zeros(3))
    engine.register_buffer("rope_cache", torch.zeros(5), persistent=False)
    transport = CountingTransport()
    with pytest.raises(IncompleteRefit) as info:
        recv.refit(pub.sources, lambda n: param.data_ptr(), transport, destinations_of(engine))
    message = str(info.value)
    assert "p (128 of 256 elements)" in message and "q (all 4 elements)" in message
    assert "running (all 3 elements)" in message and "rope_cache" not in message
    assert info.value.missing == {"p": (128, 256), "q": (4, 4), "running": (3, 3)}
    assert transport.reads == 0 and not param.any()


def test_names_passed_in_allow_unwritten_may_stay_untouched(kit: Any) -> None:
    pub, full = _world(kit, 1)
    param, other = torch.zeros(32, 8), torch.zeros(4)
    dest = dest_layout_of({"p": param, "q": other})
    recv = _receiver(kit, param, allow_unwritten={"q"})
    recv.refit(pub.sources, lambda n: param.data_ptr(), CountingTransport(), dest)
    assert torch.equal(param, full[:, 4:12]) and not other.any()


def test_coverage_counts_strided_and_overlapping_copies_exactly() -> None:
    dest = torch.zeros(6, 4)
    cols = [
        RecordedCopy(
            "s", (), "d", v.storage_offset(), tuple(v.shape), tuple(v.stride()), dest.dtype
        )
        for v in (dest[:, 0:2], dest[:, 1:3], dest[2:5, 3])
    ]
    assert unwritten(CaptureResult(copies=cols), dest_layout_of({"d": dest})) == {"d": (3, 24)}
    # Column 3 misses rows 0, 1 and 5; one more copy writes rows 0..2 of it (stride 4).
    more = [*cols, RecordedCopy("s", (), "d", 3, (3, 1), (4, 1), dest.dtype)]
    assert unwritten(CaptureResult(copies=more), dest_layout_of({"d": dest})) == {"d": (1, 24)}
