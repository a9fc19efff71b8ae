"""plan_pull: one recorded copy → exact, coalesced reads.

Reads are executed with the reference transport into a zeroed destination and
compared with eager torch; the read lists themselves pin coalescing.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import refitd.reshard as reshard
from refitd.errors import PlanError
from refitd.reshard.reads import InMemoryReadExecutor, ReadDescriptor
from refitd.reshard.slice_plan import Read, Shard, plan_pull
from refitd.reshard.transfer_plan import plan_transfer
from refitd.reshard.types import CaptureResult, RecordedCopy, UnsupportedReshard

F32 = torch.float32


def op(name: str, *args: Any) -> tuple[str, tuple[Any, ...], tuple[()]]:
    return (name, args, ())


def run_reads(reads: list[Read], param: torch.Tensor) -> None:
    InMemoryReadExecutor().read(
        [
            ReadDescriptor(s.session, s.src_addr, param.data_ptr() + s.dst_byte, s.nbytes)
            for s in reads
        ]
    )


def pull(
    kit: Any,
    full: torch.Tensor,
    boxes: Any,
    chain: Any,
    param: torch.Tensor,
    dest: torch.Tensor,
    **kw: Any,
) -> list[Read]:
    """Publish ``full`` as ``boxes``, plan ``dest.copy_(chain(full))``, run it, check it."""
    pub = kit.Published()
    info = pub.add("w", full, boxes, **kw)
    copy = kit.copy_record("w", chain, "p", dest, full.dtype)
    reads = plan_pull(copy, info.global_shape, full.dtype, full.element_size(), info.shards)
    run_reads(reads, param)
    want = torch.zeros_like(param)
    kit.eager(full, copy, want)
    assert torch.equal(param, want)
    return reads


def test_the_public_names_are_exactly_the_reexports() -> None:
    public = {n for n in vars(reshard) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(reshard, n)).__name__ == "module"}
    assert set(reshard.__all__) == public - modules - {"annotations"}
    for name in reshard.__all__:
        assert getattr(reshard, name) is not None


def test_a_column_slice_is_one_read_per_row_and_nothing_more() -> None:
    copy = RecordedCopy("row", (op("narrow", 1, 0, 4),), "row", 0, (4, 4), (4, 1), F32)
    shard = Shard((0, 0), (4, 8), "s0", 0, 4)
    reads = plan_pull(copy, (4, 8), F32, 4, [shard])
    assert len(reads) == 4
    assert sum(s.nbytes for s in reads) == 16 * 4
    assert sorted(s.dst_byte for s in reads) == [0, 16, 32, 48]
    assert [s.src_addr for s in reads] == [0, 32, 64, 96]


def test_a_row_block_coalesces_across_rows_into_one_read(kit: Any) -> None:
    param = torch.zeros(3, 5)
    reads = pull(
        kit, kit.distinct((8, 5)), [((0, 0), (8, 5))], [op("narrow", 0, 2, 3)], param, param
    )
    assert [(s.dst_byte, s.nbytes) for s in reads] == [(0, 60)]


def test_a_dim1_shard_read_whole_coalesces_row_by_row_in_its_own_storage(kit: Any) -> None:
    # Megatron row-parallel shard (columns 4..8) feeding the engine's same split.
    param = torch.zeros(6, 4)
    reads = pull(
        kit,
        kit.distinct((6, 8)),
        kit.dim_blocks((6, 8), 1, 2),
        [op("narrow", 1, 4, 4)],
        param,
        param,
    )
    assert len(reads) == 1 and reads[0].nbytes == 6 * 4 * 4


def test_shards_back_to_back_in_one_buffer_are_one_read(kit: Any) -> None:
    param = torch.zeros(8, 3)
    boxes = kit.dim_blocks((8, 3), 0, 4)
    same = pull(kit, kit.distinct((8, 3)), boxes, [], param, param, sessions=["a"] * 4, packed=True)
    assert len(same) == 1
    param.zero_()
    split = pull(
        kit,
        kit.distinct((8, 3)),
        boxes,
        [],
        param,
        param,
        sessions=["a", "a", "b", "b"],
        packed=True,
    )
    assert [s.session for s in split] == ["a", "b"]


def test_copies_of_adjacent_sources_into_one_parameter_merge_across_copies(kit: Any) -> None:
    # q, k and v published back to back in one trainer buffer, fused into qkv.
    full = kit.distinct((8, 4))
    pub = kit.Published()
    pub.add("qkv_src", full, [((0, 0), (8, 4))], sessions=["t"])
    base = pub.sources["qkv_src"].shards[0].addr
    sources = {}
    for name, (row, rows) in {"q": (0, 4), "k": (4, 2), "v": (6, 2)}.items():
        sources[name] = reshard.SourceInfo(
            (rows, 4), F32, 4, [Shard((0, 0), (rows, 4), "t", base + row * 16, 4)]
        )
    qkv = torch.zeros(8, 4)
    copies = [
        kit.copy_record(name, (), "qkv", qkv.narrow(0, row, rows))
        for name, (row, rows) in {"q": (0, 4), "k": (4, 2), "v": (6, 2)}.items()
    ]
    plan = plan_transfer(CaptureResult(copies=copies), sources)
    assert len(plan.reads) == 1 and plan.exact_descriptor_count == 1
    kit.reconstruct(plan, {"qkv": qkv})
    assert torch.equal(qkv, full)


def test_overlapping_replicas_are_each_read_once(kit: Any) -> None:
    param = torch.zeros(8, 2)
    boxes = [((0, 0), (6, 2)), ((3, 0), (5, 2))]
    reads = pull(kit, kit.distinct((8, 2)), boxes, [], param, param)
    assert sum(s.nbytes for s in reads) == 8 * 2 * 4


@pytest.mark.parametrize(
    "chain",
    [
        [op("__getitem__", (slice(-3, None, 2), slice(None, None, 3)))],
        [op("select", -1, -2)],
        [op("transpose", 0, -1), op("narrow", 0, 1, 2)],
        [op("permute", 2, 0, 1), op("flatten", 1, 2)],
        [
            op("unsqueeze", 0),
            op("unbind", 0),
            op("__getitem__", 0),
            op("chunk", 2, 1),
            op("__getitem__", 1),
        ],
        [op("split", 2, 0), op("__getitem__", 1), op("squeeze", 0)],
        [op("reshape", 35, 3), op("view", 5, 7, 3)],
        [op("unflatten", 1, (7, 1)), op("squeeze", 2)],
    ],
    ids=[
        "step-slices",
        "negative-select",
        "transpose",
        "permute-flatten",
        "unbind-chunk",
        "split-squeeze",
        "merge-split",
        "unflatten",
    ],
)
def test_every_view_chain_plans_exactly(kit: Any, chain: list[Any]) -> None:
    full = kit.distinct((5, 7, 3))
    shape = reshard.replay_ops(full, tuple(chain)).shape
    param = torch.zeros(shape)
    boxes = [((0, 0, 0), (2, 7, 3)), ((2, 0, 0), (3, 4, 3)), ((2, 4, 0), (3, 3, 3))]
    pull(kit, full, boxes, chain, param, param)


def test_materializing_chains_plan_through_the_intermediate_index_space(kit: Any) -> None:
    # MLA-style: split every head, keep the first part of each, flatten (a copy).
    heads, a, b, r = 4, 3, 2, 5
    full = kit.distinct((heads * (a + b), r))
    chain = [op("view", heads, a + b, r), op("narrow", 1, 0, a), op("reshape", heads * a, r)]
    param = torch.zeros(heads * a, r)
    reads = pull(kit, full, [((0, 0), (heads * (a + b), r))], chain, param, param)
    assert len(reads) == heads  # one contiguous block per head, no element map


def test_a_transposed_copy_made_contiguous_lands_element_by_element(kit: Any) -> None:
    param = torch.zeros(12)
    chain = [op("t"), op("contiguous"), op("view", -1)]
    reads = pull(kit, kit.distinct((3, 4)), kit.dim_blocks((3, 4), 0, 3), chain, param, param)
    assert len(reads) == 12


def test_a_slice_after_a_materializing_reshape_composes_through_the_copy(kit: Any) -> None:
    param = torch.zeros(5)
    chain = [op("t"), op("reshape", -1), op("narrow", 0, 3, 5)]
    pull(kit, kit.distinct((3, 4)), [((0, 0), (3, 4))], chain, param, param)


def test_a_strided_destination_receives_each_element_in_place(kit: Any) -> None:
    param = torch.zeros(6, 10)
    dest = param[1:5:2, 2:8:2].t()  # (3, 2) view with strides (2, 20)
    pull(kit, kit.distinct((3, 2)), [((0, 0), (3, 2))], [], param, dest)
    assert int((param != 0).sum()) == 6


def test_a_broadcast_copy_fills_every_destination_row(kit: Any) -> None:
    param = torch.zeros(3, 4)
    pull(kit, kit.distinct((4,)), [((0,), (4,))], [op("unsqueeze", 0)], param, param)


def test_a_slice_after_a_materializing_reshape_reads_only_what_it_needs() -> None:
    # 64M elements; only the four the loader keeps are tabulated and read.
    n = 1 << 13
    chain = (op("t"), op("reshape", -1), op("narrow", 0, 1, 4))
    copy = RecordedCopy("w", chain, "p", 0, (4,), (1,), F32)
    reads = plan_pull(copy, (n, n), F32, 4, [Shard((0, 0), (n, n), "s", 0, 4)])
    assert [(s.src_addr, s.dst_byte, s.nbytes) for s in reads] == [
        (i * n * 4, (i - 1) * 4, 4) for i in range(1, 5)
    ]


def test_an_unfused_weight_reached_by_view_select_reshape_plans_as_blocks(kit: Any) -> None:
    # Megatron fc1 stores [gate_r; up_r] per TP rank; the convert takes gate apart
    # with view/select/reshape (a copy), then the engine narrows its rank's rows.
    tp, inter, hidden = 4, 3, 5
    full = kit.distinct((tp * 2 * inter, hidden))
    chain = [
        op("view", tp, 2, inter, hidden),
        op("select", 1, 0),
        op("reshape", tp * inter, hidden),
        op("narrow", 0, inter, 2 * inter),
    ]
    param = torch.zeros(2 * inter, hidden)
    reads = pull(kit, full, [((0, 0), (tp * 2 * inter, hidden))], chain, param, param)
    assert len(reads) == 2  # two ranks' gate blocks, each one contiguous read


def test_a_copy_needing_more_runs_than_the_limit_is_refused_before_enumerating() -> None:
    n = 1 << 13
    copy = RecordedCopy("w", (op("t"), op("reshape", -1)), "p", 0, (n * n,), (1,), F32)
    with pytest.raises(UnsupportedReshard, match="runs, above the"):
        plan_pull(copy, (n, n), F32, 4, [Shard((0, 0), (n, n), "s", 0, 4)])


def test_a_dtype_converting_copy_is_refused() -> None:
    copy = RecordedCopy("w", (), "p", 0, (4,), (1,), torch.bfloat16)
    with pytest.raises(UnsupportedReshard, match="converts dtype"):
        plan_pull(copy, (4,), F32, 4, [Shard((0,), (4,), "s", 0, 4)])


def test_a_region_no_shard_holds_is_a_plan_error() -> None:
    copy = RecordedCopy("w", (), "p", 0, (8,), (1,), F32)
    with pytest.raises(PlanError, match=re.escape("[4, 8)")):
        plan_pull(copy, (8,), F32, 4, [Shard((0,), (4,), "s", 0, 4)])


def test_a_shard_outside_its_tensor_is_a_plan_error() -> None:
    copy = RecordedCopy("w", (), "p", 0, (8,), (1,), F32)
    with pytest.raises(PlanError, match="outside the tensor"):
        plan_pull(copy, (8,), F32, 4, [Shard((6,), (4,), "s", 0, 4)])


def test_stacked_experts_reach_their_fused_slots_through_select_and_unbind(kit: Any) -> None:
    experts, inter, hidden = 3, 2, 4
    w1 = kit.distinct((experts, inter, hidden))
    w13 = torch.zeros(experts, 2, inter, hidden)
    pub = kit.Published()
    info = pub.add("w1", w1, kit.dim_blocks((experts, inter, hidden), 0, 2))
    for e in range(experts):
        # vLLM's per-expert path: select from the stack, then unsqueeze(0).unbind(0)[0].
        chain = (op("select", 0, e), op("unsqueeze", 0), op("unbind", 0), op("__getitem__", 0))
        copy = kit.copy_record("w1", chain, "w13", w13[e, 0])
        run_reads(plan_pull(copy, info.global_shape, F32, 4, info.shards), w13)
    assert torch.equal(w13[:, 0], w1)
    assert not w13[:, 1].any()


def test_replicated_dim1_blocks_are_read_whole_from_one_replica_each(kit: Any) -> None:
    # Data-parallel copies of a TP layout: each block comes from one replica, so
    # its rows still coalesce, and the two blocks go to different sessions.
    boxes = kit.dim_blocks((6, 8), 1, 2)
    param = torch.zeros(6, 8)
    reads = pull(
        kit,
        kit.distinct((6, 8)),
        boxes + boxes,
        [],
        param,
        param,
        sessions=["a0", "a1", "b0", "b1"],
    )
    assert len({s.session for s in reads}) == 2
    assert sum(s.nbytes for s in reads) == 6 * 8 * 4
