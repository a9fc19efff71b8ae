"""A loader's write is the write of the destination whose memory it lands in.

vLLM's gpt-oss ``load_weights`` copies experts, their biases and the attention sinks
into ``param.data`` itself, outside every ``weight_loader``. Such a write is the
parameter's (or persistent buffer's) by its storage, whoever made it, and a refit
installs bit for bit what the loader run on the full tensors leaves. A write into
memory no destination owns is refused, naming it, before any byte moves.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from refitd.reshard.compile import dest_layout_of
from refitd.reshard.coverage import destinations_of, unwritten
from refitd.reshard.geometry import capture_geometry
from refitd.reshard.reads import InMemoryReadExecutor, PackedRead, ReadDescriptor
from refitd.reshard.receiver import ReshardReceiver
from refitd.reshard.slice_plan import Shard
from refitd.reshard.transfer_plan import SourceInfo
from refitd.reshard.types import UnsupportedReshard

BF16 = torch.bfloat16


class CountingTransport(InMemoryReadExecutor):
    """The reference transport, counting what it is asked to move."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self, descriptors: list[ReadDescriptor]) -> None:
        self.reads += len(descriptors)
        super().read(descriptors)

    def read_packed(self, reads: list[PackedRead]) -> None:
        self.reads += len(reads)
        super().read_packed(reads)


class SelfLoading(torch.nn.Module):
    """gpt-oss's shapes in miniature: stacked experts whose interleaved gate/up
    columns a TP rank takes a slice of and transposes, their biases, attention sinks
    split by head, a persistent buffer, and a down bias every rank but the first
    zeroes. No parameter has a ``weight_loader``: ``load_weights`` writes them all."""

    def __init__(self, experts: int, hidden: int, inter: int, heads: int, tp: int, rank: int):
        super().__init__()
        self.tp, self.rank, self.inter, self.heads = tp, rank, inter, heads
        per = inter // tp
        self.w13 = torch.nn.Parameter(torch.empty(experts, 2 * per, hidden, dtype=BF16))
        self.w13_bias = torch.nn.Parameter(torch.empty(experts, 2 * per, dtype=BF16))
        self.w2_bias = torch.nn.Parameter(torch.empty(experts, hidden, dtype=BF16))
        self.sinks = torch.nn.Parameter(torch.empty(heads // tp, dtype=BF16))
        self.register_buffer("scale", torch.empty(experts, dtype=BF16))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        per = self.inter // self.tp
        lo, hi = 2 * self.rank * per, 2 * (self.rank + 1) * per
        for name, w in weights:
            if name == "gate_up_proj":  # [E, H, 2I], gate and up interleaved
                self.w13.copy_(w[:, :, lo:hi].permute(0, 2, 1).contiguous())
            elif name == "gate_up_proj_bias":
                for e in range(w.shape[0]):  # one expert at a time, into a view
                    self.w13_bias.data[e].copy_(w[e, lo:hi])
            elif name == "down_proj_bias":
                if self.rank != 0:
                    w.zero_()  # only the first rank adds the bias
                self.w2_bias.copy_(w)
            elif name == "sinks":
                n = self.heads // self.tp
                self.sinks.data.copy_(w.narrow(0, self.rank * n, n))
            elif name == "scale":
                self.scale.copy_(w)


SHAPES = {
    "gate_up_proj": (4, 8, 12),
    "gate_up_proj_bias": (4, 12),
    "down_proj_bias": (4, 8),
    "sinks": (4,),
    "scale": (4,),
}


def _model(tp: int, rank: int, device: str = "cpu") -> SelfLoading:
    with torch.device(device):
        m = SelfLoading(4, 8, 6, 4, tp, rank)
    for t in [*m.parameters(), *m.buffers()]:
        t.data.fill_(-7)  # a value no load writes: an unwritten element shows
    return m


def _published(keep: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, SourceInfo]]:
    full, sources = {}, {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        g = torch.Generator().manual_seed(i)
        t = torch.randn(shape, generator=g).to(BF16)
        full[name] = t
        # two trainer ranks, each holding its dim-0 block in a buffer of its own
        cut = shape[0] // 2
        shards = []
        for a, b in itertools.pairwise([0, cut, shape[0]]):
            block = t[a:b].contiguous()
            keep.append(block)
            rest = (0,) * (len(shape) - 1)
            shards.append(Shard((a, *rest), tuple(block.shape), f"r{a}", block.data_ptr(), 2))
        sources[name] = SourceInfo(shape, BF16, 2, shards)
    return full, sources


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_writes_load_weights_makes_itself_are_refitted_bit_for_bit_as_a_fresh_load(
    tp: int, rank: int
) -> None:
    keep: list[torch.Tensor] = []
    full, sources = _published(keep)
    truth = _model(tp, rank)
    with torch.no_grad():
        truth.load_weights((n, t.clone()) for n, t in full.items())  # it zeroes one

    twin = _model(tp, rank, "meta")
    manifest = [(n, BF16, s) for n, s in SHAPES.items()]
    captured = capture_geometry(twin, manifest)
    assert captured.unattributed == 0 and captured.unsupported == []
    assert {c.param_name for c in captured.copies} == (
        {"w13", "w13_bias", "w2_bias", "sinks", "scale"} - ({"w2_bias"} if rank else set())
    )
    # the zeroed bias is a constant write, pulled from nowhere
    assert [f.param_name for f in captured.fills] == (["w2_bias"] if rank else [])
    assert unwritten(captured, destinations_of(twin)) == {}

    got = _model(tp, rank)
    dests = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    receiver = ReshardReceiver(captured)
    receiver.refit(
        sources, lambda n: dests[n].data_ptr(), InMemoryReadExecutor(), dest_layout_of(dests)
    )
    if rank:  # the fill needs no transfer: the engine holds the zeros from its load
        got.w2_bias.data.zero_()
    for name, want in [*truth.named_parameters(), *truth.named_buffers()]:
        assert torch.equal(dests[name].view(torch.int16), want.view(torch.int16)), name


class CopiesThroughATemporary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.empty(4, 3))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            tmp = torch.empty(4, 3, device=self.p.device)
            tmp.copy_(w)  # lands in memory no parameter owns
            self.p.data.copy_(tmp)


def test_a_write_into_memory_no_parameter_owns_is_refused_naming_it_before_any_byte_moves() -> None:
    with torch.device("meta"):
        twin = CopiesThroughATemporary()
    captured = capture_geometry(twin, [("w", torch.float32, (4, 3))])
    assert captured.copies == [] and captured.unattributed == 1
    assert captured.unowned == ["'w' into a (4, 3) torch.float32 tensor"]

    src = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    sources = {
        "w": SourceInfo((4, 3), torch.float32, 4, [Shard((0, 0), (4, 3), "r0", src.data_ptr(), 4)])
    }
    param = torch.zeros(4, 3)
    transport = CountingTransport()
    with pytest.raises(UnsupportedReshard, match="belongs to no parameter") as info:
        ReshardReceiver(captured).refit(
            sources, lambda n: param.data_ptr(), transport, dest_layout_of({"p": param})
        )
    assert "'w' into a (4, 3) torch.float32 tensor" in str(info.value)
    assert transport.reads == 0 and not param.any()


class SharedStorage(torch.nn.Module):
    """Two parameters that are views of one allocation (a fused weight split)."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.empty(10)
        self.a = torch.nn.Parameter(base[:4])
        self.b = torch.nn.Parameter(base[4:])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            getattr(self, name).data.copy_(w)


def test_destinations_sharing_one_allocation_are_told_apart_by_the_elements_written() -> None:
    with torch.device("meta"):
        twin = SharedStorage()
    captured = capture_geometry(twin, [("a", torch.float32, (4,)), ("b", torch.float32, (6,))])
    assert [(c.src_name, c.param_name, c.dest_offset) for c in captured.copies] == [
        ("a", "a", 0),
        ("b", "b", 4),
    ]


def test_zeroing_part_of_a_source_is_refused() -> None:
    class ZeroesAView(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.empty(4))

        def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
            for _, w in weights:
                w[:2].zero_()
                self.p.data.copy_(w)

    with torch.device("meta"):
        twin = ZeroesAView()
    captured = capture_geometry(twin, [("w", torch.float32, (4,))])
    assert captured.unsupported == ["w"]
    assert "zero_() of part of a source" in captured.unsupported_reasons["w"]
