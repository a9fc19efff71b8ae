"""Compiled plans: lowered to arrays, bound to the signature they were warmed on.

A replay must do no planning, rebase addresses for a republished version, and
refuse — naming what changed — any manifest or destination it was not warmed on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refitd.errors import PlanError
from refitd.reshard.compile import SignatureMismatch, compile_plan, dest_layout_of
from refitd.reshard.reads import InMemoryReadExecutor
from refitd.reshard.transfer_plan import exact_descriptors, plan_transfer
from refitd.reshard.types import CaptureResult

EL = 4


def _setup(
    kit: Any, base: int = 1, packed: bool = False, sessions: Any = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Two sources: a 64x64 in four dim-0 blocks and a 64x8 in dim-1 halves."""
    pub = kit.Published()
    pub.add(
        "a",
        kit.distinct((64, 64), base=base),
        kit.dim_blocks((64, 64), 0, 4),
        sessions=sessions,
        packed=packed,
    )
    pub.add("b", kit.distinct((64, 8), base=base + 10_000), kit.dim_blocks((64, 8), 1, 2))
    return pub, {
        "a": kit.distinct((64, 64), base=base),
        "b": kit.distinct((64, 8), base=base + 10_000),
    }


def _capture(kit: Any, params: dict[str, torch.Tensor]) -> CaptureResult:
    return CaptureResult(
        copies=[
            kit.copy_record("a", (("narrow", (1, 0, 32), ()),), "pa", params["pa"]),
            kit.copy_record("b", (("t", (), ()),), "pb", params["pb"]),
        ]
    )


def _params() -> dict[str, torch.Tensor]:
    return {"pa": torch.zeros(64, 32), "pb": torch.zeros(8, 64)}


def test_binding_to_the_warm_manifest_reproduces_the_plans_descriptors(kit: Any) -> None:
    pub, _ = _setup(kit)
    params = _params()
    plan = plan_transfer(_capture(kit, params), pub.sources)
    compiled = compile_plan(plan, pub.sources, dest_layout_of(params))
    bound = compiled.bind(pub.sources, lambda n: params[n].data_ptr(), dest_layout_of(params))
    assert bound.descriptors() == exact_descriptors(plan, lambda n: params[n].data_ptr())


def test_a_republished_version_replays_rebased_and_bit_exact(kit: Any) -> None:
    pub1, _ = _setup(kit, base=1)
    params = _params()
    dest = dest_layout_of(params)
    plan = plan_transfer(_capture(kit, params), pub1.sources, 8)
    assert plan.packs or plan.full_reads  # the compiled form must carry both kinds
    compiled = compile_plan(plan, pub1.sources, dest)
    # Next version: same structure, new buffers elsewhere, new values.
    pub2, full2 = _setup(kit, base=500_000)
    stats = compiled.replay(
        pub2.sources, lambda n: params[n].data_ptr(), InMemoryReadExecutor(), dest
    )
    assert stats["bytes"] == plan.bytes_planned()
    assert torch.equal(params["pa"], full2["a"][:, :32])
    assert torch.equal(params["pb"], full2["b"].t())


def test_a_changed_shard_layout_is_refused_with_a_call_to_replan(kit: Any) -> None:
    pub, _ = _setup(kit)
    params = _params()
    compiled = compile_plan(
        plan_transfer(_capture(kit, params), pub.sources), pub.sources, dest_layout_of(params)
    )
    other = kit.Published()
    other.add("a", kit.distinct((64, 64)), kit.dim_blocks((64, 64), 0, 2))
    other.add("b", kit.distinct((64, 8)), kit.dim_blocks((64, 8), 1, 2))
    with pytest.raises(SignatureMismatch, match="warm the exact signature first") as info:
        compiled.bind(other.sources, lambda n: params[n].data_ptr())
    assert "shard boxes or sessions" in str(info.value)


def test_a_changed_destination_layout_is_refused(kit: Any) -> None:
    pub, _ = _setup(kit)
    params = _params()
    compiled = compile_plan(
        plan_transfer(_capture(kit, params), pub.sources), pub.sources, dest_layout_of(params)
    )
    moved = dict(params, pb=torch.zeros(64, 8).t())
    why = compiled.mismatch(pub.sources, dest_layout_of(moved))
    assert why is not None and "destination layout" in why


def test_an_added_source_changes_the_signature(kit: Any) -> None:
    pub, _ = _setup(kit)
    params = _params()
    compiled = compile_plan(
        plan_transfer(_capture(kit, params), pub.sources), pub.sources, dest_layout_of(params)
    )
    pub.add("c", kit.distinct((4,)), [((0,), (4,))])
    assert compiled.mismatch(pub.sources) is not None


def test_shards_that_moved_apart_within_a_session_are_refused(kit: Any) -> None:
    # Compiled while the four blocks sat back to back (reads merged across them) ...
    pub1, _ = _setup(kit, packed=True, sessions=["t"] * 4)
    params = {"pa": torch.zeros(64, 64), "pb": torch.zeros(8, 64)}
    cap = CaptureResult(copies=[kit.copy_record("a", (), "pa", params["pa"])])
    plan = plan_transfer(cap, pub1.sources)
    assert len(plan.reads) == 1
    compiled = compile_plan(plan, pub1.sources, dest_layout_of(params))
    # ... then republished with the same boxes and session, in separate buffers.
    pub2, _ = _setup(kit, packed=False, sessions=["t"] * 4)
    with pytest.raises(SignatureMismatch, match="moved relative to each other"):
        compiled.bind(pub2.sources, lambda n: params[n].data_ptr())


def test_a_plan_with_fallback_sources_is_never_compiled(kit: Any) -> None:
    pub, _ = _setup(kit)
    params = _params()
    cap = _capture(kit, params)
    del pub.sources["b"]
    plan = plan_transfer(cap, pub.sources)
    assert plan.fallback == ["b"]
    with pytest.raises(PlanError, match="fallback"):
        compile_plan(plan, pub.sources, dest_layout_of(params))
