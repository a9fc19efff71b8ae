"""Geometry capture on small engine-shaped models: what is recorded, what is refused.

A toy engine holds parameters at their sharded shapes (as a real inference rank
does) and loads them the way column-, row-parallel, fused-qkv and replicated
layers do. Capture runs it on the meta device with placeholders; the recorded
copies are then checked field by field, and replayed onto real buffers to check
that they reproduce what the same loaders do with real tensors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from refitd.reshard.geometry import (
    LazyWeight,
    build_lazy_weights,
    capture_geometry,
    capture_weights,
    convert_source_weights,
)
from refitd.reshard.replay import replay_ops
from refitd.reshard.types import RecordedCopy, UnsupportedReshard, summarize_unsupported

F32 = torch.float32
RANK = 1  # not rank 0, so a forgotten offset cannot pass by accident
FUSED_ROWS = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}  # destination row offset, rows


class TinyEngine(torch.nn.Module):
    """Parameters at one TP rank's shapes; loaders narrow the full source."""

    def __init__(self, *, with_multiply: bool = False) -> None:
        super().__init__()
        self.col = torch.nn.Parameter(torch.empty(4, 4))  # column-parallel: rows of [8, 4]
        self.col.weight_loader = self._load_col  # type: ignore[attr-defined]
        self.row = torch.nn.Parameter(torch.empty(4, 4))  # row-parallel: columns of [4, 8]
        self.row.weight_loader = self._load_row  # type: ignore[attr-defined]
        self.qkv = torch.nn.Parameter(torch.empty(8, 4))  # fused q | k | v rows
        self.qkv.weight_loader = self._load_fused  # type: ignore[attr-defined]
        self.norm = torch.nn.Parameter(torch.empty(4))  # replicated
        self.norm.weight_loader = lambda param, w: param.data.copy_(w)  # type: ignore[attr-defined]
        if with_multiply:
            self.scaled = torch.nn.Parameter(torch.empty(4, 4))
            self.scaled.weight_loader = self._load_scaled  # type: ignore[attr-defined]

    def _load_col(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w.narrow(0, RANK * param.shape[0], param.shape[0]))

    def _load_row(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w.narrow(1, RANK * param.shape[1], param.shape[1]))

    def _load_fused(self, param: torch.Tensor, w: torch.Tensor, shard_id: str) -> None:
        offset, rows = FUSED_ROWS[shard_id]
        param.data.narrow(0, offset, rows).copy_(w)

    def _load_scaled(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w * 2)  # arithmetic: cannot be planned as a pull

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            if name in FUSED_ROWS:
                self.qkv.weight_loader(self.qkv, w, name)  # type: ignore[operator]
            else:
                params[name].weight_loader(params[name], w)  # type: ignore[operator]


def manifest(*, with_multiply: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    m = [
        ("col", F32, (8, 4)),
        ("row", F32, (4, 8)),
        ("q", F32, (4, 4)),
        ("k", F32, (2, 4)),
        ("v", F32, (2, 4)),
        ("norm", F32, (4,)),
    ]
    if with_multiply:
        m.append(("scaled", F32, (4, 4)))
    return m


def meta_engine(factory: Callable[[], torch.nn.Module] = TinyEngine) -> Any:
    with torch.device("meta"):
        return factory()


def loaders_of(model: torch.nn.Module) -> dict[str, Any]:
    return {name: p.weight_loader for name, p in model.named_parameters()}  # type: ignore[attr-defined]


def real_sources(
    entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
) -> dict[str, torch.Tensor]:
    out, base = {}, 0
    for name, dtype, shape in entries:
        n = 1
        for s in shape:
            n *= s
        out[name] = (torch.arange(n, dtype=torch.float64) + base).to(dtype).reshape(shape)
        base += n
    return out


def rebuild(
    copies: list[RecordedCopy], sources: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Apply every recorded copy to zeroed parameter buffers, replaying its chain."""
    out = {name: torch.zeros_like(p, device="cpu") for name, p in params.items()}
    for c in copies:
        dest = out[c.param_name].view(-1).as_strided(c.dest_shape, c.dest_stride, c.dest_offset)
        dest.copy_(replay_ops(sources[c.src_name], c.op_chain))
    return out


# -- what capture records ---------------------------------------------------------


def test_capture_records_each_loaders_view_and_where_it_lands() -> None:
    result = capture_geometry(meta_engine(), manifest())
    by_source = {c.src_name: c for c in result.copies}

    assert by_source["col"].op_chain == (("narrow", (0, 4, 4), ()),)
    assert (by_source["col"].dest_offset, by_source["col"].dest_shape) == (0, (4, 4))
    assert by_source["row"].op_chain == (("narrow", (1, 4, 4), ()),)
    assert by_source["row"].dest_stride == (4, 1)
    # fused: whole sources, each at its own row offset of one parameter
    assert [by_source[s].dest_offset for s in "qkv"] == [0, 16, 24]
    assert {by_source[s].param_name for s in "qkv"} == {"qkv"}
    assert all(by_source[s].op_chain == () for s in "qkv")
    assert by_source["norm"].op_chain == () and by_source["norm"].dest_shape == (4,)
    assert by_source["norm"].dest_dtype == F32
    assert result.unsupported == [] and result.unattributed == 0


def test_recorded_copies_reproduce_the_loaders_on_real_tensors() -> None:
    sources = real_sources(manifest())
    real = TinyEngine()
    with torch.no_grad():
        real.load_weights(sources.items())
    params = dict(real.named_parameters())

    rebuilt = rebuild(capture_geometry(meta_engine(), manifest()).copies, sources, params)

    for name, p in params.items():
        assert torch.equal(rebuilt[name], p.detach()), name


def test_placeholders_hold_no_storage_and_report_the_source_shape() -> None:
    (lazy,) = build_lazy_weights([("w", torch.bfloat16, (3, 5))]).values()
    assert isinstance(lazy, LazyWeight)
    assert lazy.shape == (3, 5) and lazy.dtype == torch.bfloat16 and lazy.is_meta
    assert lazy._name == "w" and lazy._ops == ()
    view = lazy.t()
    assert view.stride() == (1, 5) and not view.is_contiguous()  # loaders may ask


# -- refusals are per source ------------------------------------------------------


def test_an_unsupported_op_refuses_only_its_own_source() -> None:
    result = capture_geometry(
        meta_engine(lambda: TinyEngine(with_multiply=True)), manifest(with_multiply=True)
    )
    by_source = {c.src_name: c for c in result.copies}

    assert result.unsupported == ["scaled"]
    assert "scaled" not in by_source
    assert set(by_source) == {"col", "row", "q", "k", "v", "norm"}
    assert by_source["col"].op_chain == (("narrow", (0, 4, 4), ()),)


def test_the_refusal_reason_names_the_aten_op_the_source_and_its_chain() -> None:
    result = capture_geometry(
        meta_engine(lambda: TinyEngine(with_multiply=True)), manifest(with_multiply=True)
    )

    assert set(result.unsupported_reasons) == {"scaled"}
    reason = result.unsupported_reasons["scaled"]
    assert "unsupported op" in reason and "aten.mul" in reason
    assert "'scaled'" in reason and "chain=()" in reason


# -- bulk first, per-source retry --------------------------------------------------


class CountingEngine(TinyEngine):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        super().load_weights(weights)


def test_a_clean_capture_calls_load_weights_once_and_restores_every_loader() -> None:
    model = meta_engine(CountingEngine)
    before = loaders_of(model)

    result = capture_geometry(model, manifest())

    assert model.calls == 1
    assert len(result.copies) == len(manifest())
    assert result.unsupported == [] and result.unattributed == 0
    after = loaders_of(model)
    assert all(after[name] is before[name] for name in before)


class EarlyWritesThenFails(TinyEngine):
    """The refused weight first writes twice (into a parameter, then into a temporary
    no parameter owns), then fails."""

    def __init__(self) -> None:
        super().__init__(with_multiply=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "scaled":
                self.norm.weight_loader(self.norm, w[0])  # type: ignore[operator]
                torch.empty_like(self.norm).copy_(w[1])  # unowned memory: unattributed
            super().load_weights([(name, w)])


@pytest.mark.parametrize("position", [0, 3, 6])
def test_a_refused_bulk_pass_keeps_only_the_per_source_records(position: int) -> None:
    lazies = build_lazy_weights(manifest(with_multiply=True))
    order = [(n, w) for n, w in lazies.items() if n != "scaled"]
    order.insert(position, ("scaled", lazies["scaled"]))

    result = capture_weights(meta_engine(EarlyWritesThenFails), dict(order))

    assert result.unsupported == ["scaled"]
    assert result.unattributed == 1  # the bulk pass's unattributed write is not counted twice
    assert [c.src_name for c in result.copies].count("scaled") == 1
    assert len(result.copies) == len(manifest()) + 1
    assert {c.src_name for c in result.copies} == set(lazies)


@pytest.mark.parametrize("error", [RuntimeError, ValueError, KeyError])
def test_an_unexpected_engine_error_propagates_and_loaders_are_restored(
    error: type[Exception],
) -> None:
    class Broken(TinyEngine):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(weights)
            raise error("engine exploded")

    model = meta_engine(Broken)
    before = loaders_of(model)
    with pytest.raises(error, match="engine exploded"):
        capture_geometry(model, manifest())
    after = loaders_of(model)
    assert all(after[name] is before[name] for name in before)


def test_a_failure_only_in_bulk_order_is_logged_even_when_every_retry_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class RejectsBulk(TinyEngine):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            weights = list(weights)
            if len(weights) > 1:
                raise UnsupportedReshard("expert map cannot take these together")
            super().load_weights(weights)

    model = meta_engine(RejectsBulk)
    before = loaders_of(model)
    with caplog.at_level(logging.WARNING, logger="refitd.reshard.geometry"):
        result = capture_geometry(model, manifest())

    assert result.unsupported == [] and result.unattributed == 0
    assert sorted(c.src_name for c in result.copies) == sorted(n for n, _, _ in manifest())
    assert "expert map cannot take these together" in caplog.text
    after = loaders_of(model)
    assert all(after[name] is before[name] for name in before)


def test_a_refused_converted_weight_is_reported_under_its_source_name() -> None:
    lazies = build_lazy_weights([("native.experts", F32, (2, 4, 4))])
    stacked = lazies["native.experts"]

    result = capture_weights(
        meta_engine(lambda: TinyEngine(with_multiply=True)),
        {"scaled": stacked.select(0, 0), "q": stacked.select(0, 1)},
    )

    assert result.unsupported == ["native.experts"]
    assert set(result.unsupported_reasons) == {"native.experts"}
    (copy,) = result.copies
    assert (copy.src_name, copy.param_name) == ("native.experts", "qkv")
    assert copy.op_chain == (("select", (0, 1), ()),)


def test_many_sources_failing_for_one_cause_are_logged_as_one_grouped_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class AllScaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.empty(2))
            self.p.weight_loader = lambda p, w: p.data.copy_(w + 1)  # type: ignore[attr-defined]

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, w in weights:
                self.p.weight_loader(self.p, w)  # type: ignore[operator]

    entries = [(f"layers.{i}.bias", F32, (2,)) for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="refitd.reshard.geometry"):
        result = capture_geometry(meta_engine(AllScaled), entries)

    assert len(result.unsupported) == 40
    grouped = [r.getMessage() for r in caplog.records if "source(s) unsupported" in r.getMessage()]
    assert len(grouped) == 1 and "40 source(s)" in grouped[0] and "aten.add" in grouped[0]


def test_summarize_unsupported_groups_messages_that_differ_only_in_the_source() -> None:
    reasons = {
        f"experts.{i}.w1": f"unsupported op aten.index_copy_ on lazy 'experts.{i}.w1' (chain=())"
        for i in range(50)
    }
    reasons["lone"] = "unsupported op aten.mul.Tensor on lazy 'lone' (chain=())"
    assert summarize_unsupported(reasons) == [
        ("unsupported op aten.index_copy_", 50),
        ("unsupported op aten.mul.Tensor", 1),
    ]


def test_summarize_unsupported_without_a_limit_returns_every_cause_in_first_seen_order() -> None:
    reasons = {f"s{i}": f"cause {i} on lazy 's{i}'" for i in range(7)}
    assert summarize_unsupported(reasons, limit=None) == [(f"cause {i}", 1) for i in range(7)]
    assert len(summarize_unsupported(reasons)) == 5


# -- attribution -------------------------------------------------------------------


def plain_loader(param: torch.Tensor, w: torch.Tensor) -> None:
    param.data.copy_(w)


class NoLoaderEngine(torch.nn.Module):
    """A parameter without ``weight_loader``: the engine falls back to a default."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.empty(4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            getattr(params[name], "weight_loader", plain_loader)(params[name], w)


def test_a_parameter_loaded_without_a_weight_loader_is_attributed_by_its_memory() -> None:
    entries = [("norm", F32, (4,))]

    found = capture_geometry(meta_engine(NoLoaderEngine), entries)
    assert [(c.src_name, c.param_name, c.op_chain) for c in found.copies] == [("norm", "norm", ())]
    assert found.unattributed == 0

    model = meta_engine(NoLoaderEngine)
    got = capture_geometry(model, entries, default_weight_loader=plain_loader)
    assert [(c.src_name, c.param_name, c.op_chain) for c in got.copies] == [("norm", "norm", ())]
    assert got.unattributed == 0
    assert not hasattr(model.norm, "weight_loader")  # the temporary stamp is gone


def test_stamped_loaders_accept_every_argument_by_keyword() -> None:
    class KeywordEngine(TinyEngine):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, w in weights:
                self.qkv.weight_loader(param=self.qkv, w=w, shard_id=name)  # type: ignore[operator]

    result = capture_geometry(meta_engine(KeywordEngine), [("k", F32, (2, 4))])
    assert [(c.param_name, c.dest_offset) for c in result.copies] == [("qkv", 16)]


def test_a_read_only_weight_loader_property_is_stamped_through_its_slot_and_restored() -> None:
    class SlotParameter(torch.nn.Parameter):
        # vLLM's v2 parameters expose weight_loader as a read-only property
        @property
        def weight_loader(self) -> Any:
            return self._weight_loader

    class SlotEngine(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = SlotParameter(torch.empty(2, 3))
            self.w._weight_loader = plain_loader

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, w in weights:
                self.w.weight_loader(self.w, w)

    model = meta_engine(SlotEngine)
    result = capture_geometry(model, [("w", F32, (2, 3))])
    assert [c.param_name for c in result.copies] == ["w"]
    assert model.w._weight_loader is plain_loader


# -- pre-built and converted weights -----------------------------------------------


def test_capture_weights_names_the_source_not_the_loader_key() -> None:
    lazies = build_lazy_weights([("trainer.col", F32, (8, 4)), ("trainer.norm", F32, (4,))])
    result = capture_weights(
        meta_engine(), {"col": lazies["trainer.col"], "norm": lazies["trainer.norm"]}
    )
    by_source = {c.src_name: c for c in result.copies}

    assert set(by_source) == {"trainer.col", "trainer.norm"}
    assert by_source["trainer.col"].op_chain == (("narrow", (0, 4, 4), ()),)
    assert by_source["trainer.col"].param_name == "col"


def test_capture_weights_refuses_placeholders_from_two_builds() -> None:
    a = build_lazy_weights([("col", F32, (8, 4))])
    b = build_lazy_weights([("norm", F32, (4,))])
    with pytest.raises(ValueError, match="share one recorder"):
        capture_weights(meta_engine(), {"col": a["col"], "norm": b["norm"]})


def test_capture_weights_refuses_a_real_tensor_among_the_weights() -> None:
    with pytest.raises(ValueError, match="'norm' is a Tensor, not a placeholder"):
        capture_weights(meta_engine(), {"norm": torch.zeros(4)})


def test_a_select_in_the_conversion_prefixes_the_loaders_own_ops() -> None:
    lazies = build_lazy_weights([("trainer.stack", F32, (3, 8, 4))])
    result = capture_weights(meta_engine(), {"col": lazies["trainer.stack"].select(0, 2)})

    (copy,) = result.copies
    assert copy.src_name == "trainer.stack"
    assert copy.op_chain == (("select", (0, 2), ()), ("narrow", (0, 4, 4), ()))


def test_placeholders_can_serve_a_second_capture_with_the_same_result() -> None:
    lazies = build_lazy_weights(manifest())
    first = capture_weights(meta_engine(), lazies)
    second = capture_weights(meta_engine(), lazies)
    assert first.copies == second.copies and len(first.copies) == len(manifest())


# -- MoE: per-expert and stacked trainer layouts into a fused w13 ------------------

E, INTER, H = 3, 2, 4  # experts, intermediate, hidden


class FusedMoEEngine(torch.nn.Module):
    """A router copied whole and experts stacked as ``w13[expert, gate|up]``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.empty(E, H))
        self.gate.weight_loader = plain_loader  # type: ignore[attr-defined]
        self.w13 = torch.nn.Parameter(torch.empty(E, 2, INTER, H))
        self.w13.weight_loader = self._load_expert  # type: ignore[attr-defined]

    def _load_expert(self, param: torch.Tensor, w: torch.Tensor, expert_id: int, half: int) -> None:
        param.data[expert_id, half].copy_(w)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "gate.weight":
                self.gate.weight_loader(self.gate, w)  # type: ignore[operator]
                continue
            m = re.fullmatch(r"experts\.(\d+)\.(gate|up)_proj\.weight", name)
            assert m is not None, name
            self.w13.weight_loader(  # type: ignore[operator]
                self.w13, w, expert_id=int(m[1]), half=0 if m[2] == "gate" else 1
            )


def _check_moe(copies: list[RecordedCopy], sources: dict[str, torch.Tensor], convert: Any) -> None:
    real = FusedMoEEngine()
    with torch.no_grad():
        real.load_weights(convert(sources).items())
    params = dict(real.named_parameters())
    rebuilt = rebuild(copies, sources, params)
    assert torch.equal(rebuilt["gate"], params["gate"].detach())
    assert torch.equal(rebuilt["w13"], params["w13"].detach())


def test_per_expert_sources_renamed_by_a_conversion_land_in_their_fused_slots() -> None:
    entries = [("router", F32, (E, H))]
    for e in range(E):
        entries += [(f"experts.{e}.w1", F32, (INTER, H)), (f"experts.{e}.w3", F32, (INTER, H))]

    def convert(sd: dict[str, Any]) -> dict[str, Any]:
        out = {"gate.weight": sd["router"]}
        for e in range(E):
            out[f"experts.{e}.gate_proj.weight"] = sd[f"experts.{e}.w1"]
            out[f"experts.{e}.up_proj.weight"] = sd[f"experts.{e}.w3"]
        return out

    copies = capture_weights(
        meta_engine(FusedMoEEngine), convert_source_weights(convert, entries)
    ).copies
    assert {c.src_name for c in copies} == {n for n, _, _ in entries}
    _check_moe(copies, real_sources(entries), convert)


def test_stacked_expert_sources_unstacked_by_select_land_in_their_fused_slots() -> None:
    entries = [
        ("router", F32, (E, H)),
        ("experts.w1", F32, (E, INTER, H)),
        ("experts.w3", F32, (E, INTER, H)),
    ]

    def convert(sd: dict[str, Any]) -> dict[str, Any]:
        out = {"gate.weight": sd["router"]}
        for e in range(E):
            out[f"experts.{e}.gate_proj.weight"] = sd["experts.w1"].select(0, e)
            out[f"experts.{e}.up_proj.weight"] = sd["experts.w3"].select(0, e)
        return out

    copies = capture_weights(
        meta_engine(FusedMoEEngine), convert_source_weights(convert, entries)
    ).copies
    assert len(copies) == 1 + 2 * E
    assert {c.op_chain for c in copies if c.src_name == "experts.w1"} == {
        (("select", (0, e), ()),) for e in range(E)
    }
    _check_moe(copies, real_sources(entries), convert)


# -- composition with the slice planner ---------------------------------------------


def test_a_captured_row_parallel_copy_plans_as_one_exact_run_per_row() -> None:
    slice_plan = pytest.importorskip("refitd.reshard.slice_plan")
    result = capture_geometry(meta_engine(), manifest())
    row = next(c for c in result.copies if c.src_name == "row")
    shard = slice_plan.Shard(shard_offset=(0, 0), shape=(4, 8), session="s0", addr=0, elsize=4)

    reads = slice_plan.plan_pull(row, global_shape=(4, 8), src_dtype=F32, elsize=4, shards=[shard])

    assert sum(s.nbytes for s in reads) == 16 * 4  # the needed half of each row only
    assert sorted(s.src_addr for s in reads) == [16, 48, 80, 112]  # columns 4..7 of rank 1
    assert sorted(s.dst_byte for s in reads) == [0, 16, 32, 48]


def test_the_capture_modules_export_exactly_names_they_define() -> None:
    import refitd.reshard.geometry as geometry
    import refitd.reshard.lazy as lazy
    import refitd.reshard.lazy_concat as lazy_concat
    import refitd.reshard.lazy_weight as lazy_weight
    import refitd.reshard.replay as replay

    for module in (geometry, lazy, lazy_concat, lazy_weight, replay):
        assert sorted(module.__all__) == sorted(set(module.__all__))
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
