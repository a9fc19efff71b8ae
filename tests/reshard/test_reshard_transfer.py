"""plan_transfer / execute_transfer / exact_descriptors end to end.

A small engine (column-, row-parallel, fused qkv, a norm, optionally a loader doing
arithmetic) is captured on a meta twin; its sources are published from real
buffers; the plan is executed through the reference transport into zeroed real
parameters, which must equal the same engine's loader run on the full tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refitd.errors import TransportError
from refitd.reshard.geometry import capture_geometry
from refitd.reshard.reads import InMemoryReadExecutor, ReadDescriptor
from refitd.reshard.receiver import _replay_ops
from refitd.reshard.slice_plan import Shard
from refitd.reshard.transfer_plan import (
    SourceInfo,
    exact_descriptors,
    execute_transfer,
    plan_transfer,
)
from refitd.reshard.types import CaptureResult, RecordedCopy

F32 = torch.float32
EL = 4
FUSED = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}  # source -> (first row in qkv, rows)


class Engine(torch.nn.Module):
    """Parameters at one rank's shapes; loaders carve the full source down to them."""

    def __init__(self, with_bad: bool = False) -> None:
        super().__init__()
        self.col = torch.nn.Parameter(torch.zeros(4, 4))  # rows [0, 4) of an 8x4
        self.col.weight_loader = lambda p, w: p.data.copy_(w.narrow(0, 0, 4))  # type: ignore[attr-defined]
        self.row = torch.nn.Parameter(torch.zeros(4, 4))  # columns [0, 4) of a 4x8
        self.row.weight_loader = lambda p, w: p.data.copy_(w.narrow(1, 0, 4))  # type: ignore[attr-defined]
        self.qkv = torch.nn.Parameter(torch.zeros(8, 4))
        self.qkv.weight_loader = self._fused  # type: ignore[attr-defined]
        self.norm = torch.nn.Parameter(torch.zeros(4))
        self.norm.weight_loader = lambda p, w: p.data.copy_(w)  # type: ignore[attr-defined]
        if with_bad:
            self.bad = torch.nn.Parameter(torch.zeros(4, 4))
            self.bad.weight_loader = lambda p, w: p.data.copy_(w + 1)  # type: ignore[attr-defined]

    @staticmethod
    def _fused(param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        first, rows = FUSED[shard_id]
        param.data.narrow(0, first, rows).copy_(loaded)

    def load_weights(self, weights: Any) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            if name in FUSED:
                self.qkv.weight_loader(self.qkv, w, name)  # type: ignore[operator]
            else:
                params[name].weight_loader(params[name], w)  # type: ignore[attr-defined]


def manifest(with_bad: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    m = [
        ("col", F32, (8, 4)),
        ("row", F32, (4, 8)),
        ("q", F32, (4, 4)),
        ("k", F32, (2, 4)),
        ("v", F32, (2, 4)),
        ("norm", F32, (4,)),
    ]
    return [*m, ("bad", F32, (4, 4))] if with_bad else m


def full_sources(with_bad: bool = False) -> dict[str, torch.Tensor]:
    out, base = {}, 1
    for name, _, shape in manifest(with_bad):
        n = 1
        for s in shape:
            n *= s
        out[name] = (torch.arange(n, dtype=F32) + base).reshape(shape)
        base += n  # disjoint values across sources
    return out


def publish_whole(srcs: dict[str, torch.Tensor]) -> dict[str, SourceInfo]:
    return {
        name: SourceInfo(
            tuple(t.shape), F32, EL, [Shard((0,) * t.dim(), tuple(t.shape), name, t.data_ptr(), EL)]
        )
        for name, t in srcs.items()
    }


def truth(srcs: dict[str, torch.Tensor], with_bad: bool = False) -> dict[str, torch.Tensor]:
    engine = Engine(with_bad)
    engine.load_weights(list(srcs.items()))
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


def capture(with_bad: bool = False, only: set[str] | None = None) -> CaptureResult:
    with torch.device("meta"):
        twin = Engine(with_bad)
    m = [e for e in manifest(with_bad) if only is None or e[0] in only]
    return capture_geometry(twin, m)


class RecordingTransport(InMemoryReadExecutor):
    """The reference transport, remembering which sessions it read from."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()

    def read(self, descriptors: list[ReadDescriptor]) -> None:
        self.sessions.update(d.session for d in descriptors if d.nbytes)
        super().read(descriptors)


def test_every_parameter_is_rebuilt_from_shards_alone() -> None:
    srcs = full_sources()
    want = truth(srcs)
    plan = plan_transfer(capture(), publish_whole(srcs))
    assert plan.fallback == [] and plan.bytes_planned() > 0
    got = dict(Engine().named_parameters())
    stats = execute_transfer(plan, lambda n: got[n].data_ptr(), InMemoryReadExecutor())
    assert stats["bytes"] == plan.bytes_planned()
    for name in want:
        assert torch.equal(got[name].detach(), want[name]), name


def test_a_strided_column_slice_lands_row_by_row() -> None:
    srcs = full_sources()
    plan = plan_transfer(capture(only={"row"}), publish_whole({"row": srcs["row"]}))
    assert plan.fallback == []
    # Four rows, each a 16-byte run, none adjacent in the source: four reads.
    assert [(s.dst_byte, s.nbytes) for s in plan.reads] == [
        (0, 16),
        (16, 16),
        (32, 16),
        (48, 16),
    ]
    got = dict(Engine().named_parameters())
    execute_transfer(plan, lambda n: got[n].data_ptr(), InMemoryReadExecutor())
    assert torch.equal(got["row"].detach(), truth(srcs)["row"])


def test_over_budget_copy_is_read_whole_and_replayed_in_modelexpress_mode() -> None:
    srcs = full_sources()
    cap = capture(only={"row"})
    row = srcs["row"]
    plan = plan_transfer(cap, publish_whole({"row": row}), max_reads_per_copy=1, pack_specs=False)
    assert plan.reads == [] and len(plan.full_reads) == 1
    assert plan.exact_descriptor_count == 4
    assert plan.descriptor_count() == 1
    assert plan.descriptor_savings() == 3
    assert plan.exact_bytes == 16 * EL
    assert plan.extra_wire_bytes() == row.numel() * EL - plan.exact_bytes

    # Replay by hand, as a receiver would: fetch into staging, replay, copy.
    full_read = plan.full_reads[0]
    staging = torch.zeros_like(row)
    InMemoryReadExecutor().read(
        [
            ReadDescriptor(s.session, s.src_addr, staging.data_ptr() + s.dst_byte, s.nbytes)
            for s in full_read.reads
        ]
    )
    (copy,) = full_read.copies
    out = torch.zeros(4, 4)
    out.as_strided(copy.dest_shape, copy.dest_stride, copy.dest_offset).copy_(
        _replay_ops(staging, copy.op_chain)
    )
    assert torch.equal(out, truth(srcs)["row"])


def test_a_source_not_in_dim0_blocks_keeps_exact_descriptors() -> None:
    full = torch.arange(32, dtype=F32).reshape(4, 8)
    left, right = full[:, :4].contiguous(), full[:, 4:].contiguous()
    copy = RecordedCopy("w", (("narrow", (1, 1, 2), ()),), "w", 0, (4, 2), (2, 1), F32)
    source = SourceInfo(
        (4, 8),
        F32,
        EL,
        [
            Shard((0, 0), (4, 4), "left", left.data_ptr(), EL),
            Shard((0, 4), (4, 4), "right", right.data_ptr(), EL),
        ],
    )
    plan = plan_transfer(
        CaptureResult(copies=[copy]), {"w": source}, max_reads_per_copy=1, pack_specs=False
    )
    assert plan.full_reads == []
    assert plan.unbounded_sources == ["w"]
    assert len(plan.reads) == 4
    assert plan.descriptor_savings() == 0 and plan.extra_wire_bytes() == 0


def test_an_unsupported_source_is_never_planned_nor_fetched() -> None:
    srcs = full_sources(with_bad=True)
    plan = plan_transfer(capture(with_bad=True), publish_whole(srcs))
    assert "bad" in plan.fallback
    planned = {s.param_name for s in plan.reads}
    assert {"col", "row", "qkv", "norm"} <= planned  # the good ones still are
    assert "bad" not in planned
    got = dict(Engine(with_bad=True).named_parameters())
    reads = RecordingTransport()
    stats = execute_transfer(plan, lambda n: got[n].data_ptr(), reads)
    assert "bad" not in reads.sessions and reads.sessions
    # The stats carry fallback through, so the receiver can refuse the plan.
    assert stats["fallback"] == plan.fallback and "bad" in stats["fallback"]


def test_a_copy_of_a_source_missing_from_the_manifest_is_fallback() -> None:
    srcs = full_sources()
    published = publish_whole(srcs)
    del published["k"]
    plan = plan_transfer(capture(), published)
    assert plan.fallback == ["k"]
    assert "not in the published manifest" in plan.fallback_reasons["k"]
    assert all(s.session != "k" for s in plan.reads)


def test_exact_descriptors_are_exactly_what_execute_transfer_reads() -> None:
    srcs = full_sources()
    plan = plan_transfer(capture(), publish_whole(srcs))
    params = dict(Engine().named_parameters())
    built = exact_descriptors(plan, lambda n: params[n].data_ptr())
    recorded: list[ReadDescriptor] = []

    class Recorder:
        def read(self, descriptors: list[ReadDescriptor]) -> None:
            recorded.extend(descriptors)

    stats = execute_transfer(plan, lambda n: params[n].data_ptr(), Recorder())
    assert built == recorded
    assert stats["reads"] == len(built)
    assert stats["bytes"] == sum(d.nbytes for d in built)


def test_a_plan_with_pack_specs_is_refused_by_a_transport_that_cannot_pack() -> None:
    srcs = full_sources()
    plan = plan_transfer(
        capture(only={"row"}),
        publish_whole({"row": srcs["row"]}),
        1,
        descriptor_cost_bytes=0,
        pack_cost_bytes=0,
    )
    assert len(plan.packs) == 1

    class PlainReads:
        def read(self, descriptors: list[ReadDescriptor]) -> None:
            pass

    params = dict(Engine().named_parameters())
    with pytest.raises(TransportError, match="pack"):
        execute_transfer(plan, lambda n: params[n].data_ptr(), PlainReads())


def test_reads_from_replicas_never_read_a_byte_twice_and_spread_sessions(kit: Any) -> None:
    full = kit.distinct((8, 4))
    pub = kit.Published()
    blocks = kit.dim_blocks((8, 4), 0, 4)
    pub.add("w", full, blocks + blocks, sessions=["a", "a", "a", "a", "b", "b", "b", "b"])
    param = torch.zeros(8, 4)
    copy = kit.copy_record("w", (), "w", param)
    plan = plan_transfer(CaptureResult(copies=[copy]), pub.sources)
    assert plan.bytes_planned() == plan.exact_bytes == 8 * 4 * EL
    per_session = {s: sum(g.nbytes for g in plan.reads if g.session == s) for s in "ab"}
    assert per_session == {"a": 64, "b": 64}
    kit.reconstruct(plan, {"w": param})
    assert torch.equal(param, full)


# --- the cost model ---------------------------------------------------------------


_ALIVE: list[Any] = []


def _plan_one(
    kit: Any, full: torch.Tensor, boxes: Any, chain: Any, dest: torch.Tensor, budget: int, **kw: Any
) -> Any:
    pub = kit.Published()
    pub.add("w", full, boxes)
    copy = kit.copy_record("w", chain, "p", dest)
    plan = plan_transfer(CaptureResult(copies=[copy]), pub.sources, budget, **kw)
    _ALIVE.append(pub)  # the published buffers must outlive every read of them
    return plan, copy, pub


def test_a_copy_within_budget_is_pulled_exactly(kit: Any) -> None:
    full = kit.distinct((64, 64))
    param = torch.zeros(64, 8)
    plan, _, _ = _plan_one(
        kit, full, kit.dim_blocks((64, 64), 0, 4), [("narrow", (1, 8, 8), ())], param, 64
    )
    assert plan.choices == {"exact": 1, "pack": 0, "full": 0}
    assert len(plan.reads) == 64 and plan.extra_wire_bytes() == 0


def test_an_over_budget_strided_slice_of_a_large_tensor_becomes_one_pack_per_session(
    kit: Any,
) -> None:
    full = kit.distinct((512, 512))
    param = torch.zeros(512, 256)
    plan, _, _ = _plan_one(
        kit, full, kit.dim_blocks((512, 512), 0, 4), [("narrow", (1, 0, 256), ())], param, 8
    )
    assert plan.choices["pack"] == 1 and plan.reads == [] and plan.full_reads == []
    assert len(plan.packs) == 4 and all(p.dst_strides is None for p in plan.packs)
    assert [p.shape for p in plan.packs] == [(128, 256)] * 4
    assert plan.bytes_planned() == plan.exact_bytes == 512 * 256 * EL
    assert plan.exact_descriptor_count == 512
    assert plan.descriptor_count() == 4 and plan.descriptor_savings() == 508
    assert plan.max_descriptors_per_copy == 4
    kit.reconstruct(plan, {"p": param})
    assert torch.equal(param, full[:, :256])


def test_a_pack_into_a_strided_destination_scatters_after_the_single_read(kit: Any) -> None:
    full = kit.distinct((512, 512))
    param = torch.zeros(512, 512)
    dest = param[:, 1::2]  # every other column
    plan, copy, _ = _plan_one(
        kit, full, [((0, 0), (512, 512))], [("narrow", (1, 0, 256), ())], dest, 8
    )
    (pack,) = plan.packs
    assert pack.dst_strides == (512 * EL, 2 * EL, EL)
    want = torch.zeros_like(param)
    kit.eager(full, copy, want)
    kit.reconstruct(plan, {"p": param})
    assert torch.equal(param, want)


def test_a_pack_can_transpose_on_the_source_so_the_destination_lands_contiguous(kit: Any) -> None:
    full = kit.distinct((512, 512))
    param = torch.zeros(256, 512)
    plan, copy, _ = _plan_one(
        kit, full, [((0, 0), (512, 512))], [("narrow", (1, 0, 256), ())], param.t(), 8
    )
    (pack,) = plan.packs
    assert pack.dst_strides is None and pack.src_strides[:2] == (EL, 512 * EL)
    want = torch.zeros_like(param)
    kit.eager(full, copy, want)
    kit.reconstruct(plan, {"p": param})
    assert torch.equal(param, want)


def test_an_irregular_over_budget_copy_pulls_only_its_bounding_rows(kit: Any) -> None:
    full = kit.distinct((64, 64))
    param = torch.zeros(13)
    chain = [
        ("narrow", (0, 20, 8), ()),
        ("t", (), ()),
        ("reshape", (-1,), ()),
        ("narrow", (0, 3, 13), ()),
    ]
    plan, copy, _ = _plan_one(kit, full, kit.dim_blocks((64, 64), 0, 4), chain, param, 4)
    assert plan.choices["full"] == 1 and plan.packs == []
    (fr,) = plan.full_reads
    row = 64 * EL
    # Rows 20..27 of the shard holding rows 16..31: half the shard, not all of it.
    assert [(s.dst_byte, s.nbytes) for s in fr.reads] == [(20 * row, 8 * row)]
    assert plan.exact_bytes == 13 * EL
    assert plan.extra_wire_bytes() == 8 * row - 13 * EL
    kit.reconstruct(plan, {"p": param})
    want = torch.zeros_like(param)
    kit.eager(full, copy, want)
    assert torch.equal(param, want)


def test_a_small_over_budget_copy_prefers_the_full_read_when_packing_costs_more(kit: Any) -> None:
    full = kit.distinct((64, 64))
    param = torch.zeros(64, 32)
    plan, _, _ = _plan_one(
        kit, full, kit.dim_blocks((64, 64), 0, 4), [("narrow", (1, 0, 32), ())], param, 8
    )
    # 8 KiB of extra rows is cheaper than four pack set-ups at 16 KiB each.
    assert plan.choices["full"] == 1
    assert plan.extra_wire_bytes() == 64 * 32 * EL
    assert plan.descriptor_count() == 4  # one bounding-row read per shard
    kit.reconstruct(plan, {"p": param})
    assert torch.equal(param, full[:, :32])


def test_without_pack_specs_an_unbounded_over_budget_copy_stays_exact(kit: Any) -> None:
    full = kit.distinct((16, 16))
    param = torch.zeros(16, 4)
    plan, _, _ = _plan_one(
        kit,
        full,
        kit.dim_blocks((16, 16), 1, 2),
        [("narrow", (1, 2, 4), ())],
        param,
        2,
        pack_specs=False,
    )
    assert plan.unbounded_sources == ["w"] and plan.choices["exact"] == 1
    assert len(plan.reads) == 16


def test_shards_of_one_session_in_separate_buffers_pack_one_by_one(kit: Any) -> None:
    full = kit.distinct((512, 512))
    param = torch.zeros(512, 256)
    pub = kit.Published()
    # Uneven blocks, so no single progression can span both buffers.
    pub.add("w", full, [((0, 0), (200, 512)), ((200, 0), (312, 512))], sessions=["a", "a"])
    _ALIVE.append(pub)
    copy = kit.copy_record("w", [("narrow", (1, 0, 256), ())], "p", param)
    plan = plan_transfer(CaptureResult(copies=[copy]), pub.sources, 4)
    shapes = sorted(p.shape for p in plan.packs)
    assert shapes in ([(200, 256), (312, 256)], [(512, 256)])  # [(512, 256)]: buffers adjacent
    assert plan.bytes_planned() == plan.exact_bytes
    kit.reconstruct(plan, {"p": param})
    assert torch.equal(param, full[:, :256])
