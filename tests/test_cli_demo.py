"""``refitd demo`` runs a whole in-process refit and reports it verified."""

from __future__ import annotations

import pytest

from refitd.cli import main


def _last_line_pairs(text: str) -> dict[str, str]:
    last = text.strip().splitlines()[-1]
    return dict(pair.split("=", 1) for pair in last.split())


def test_demo_refits_every_engine_rank_bit_exact_and_exits_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["demo", "--in-process", "--size", "small"])
    out = capsys.readouterr().out
    pairs = _last_line_pairs(out)
    assert code == 0, out
    assert pairs["verified"] == "1"
    assert pairs["ranks"] == "4"
    assert int(pairs["wire_bytes"]) >= int(pairs["exact_bytes"]) > 0
    assert "bit-exact" in out
    assert pairs["plans"] == "4"  # one cold plan per rank; version 2 replayed it


def test_demo_accepts_another_engine_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--in-process", "--size", "small", "--engine-tp", "2", "--engine-ep", "1"])
    pairs = _last_line_pairs(capsys.readouterr().out)
    assert code == 0
    assert pairs["ranks"] == "2" and pairs["verified"] == "1"


def test_bench_plan_smoke_run_prints_every_key_for_both_layouts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Four layers: three dense, one MoE with DeepSeek-V3's real expert shapes, on meta.
    code = main(["bench", "plan", "--layers", "4"])
    pairs = _last_line_pairs(capsys.readouterr().out)
    assert code == 0
    for layout in ("fsdp", "megatron"):
        for key in ("capture_s", "plan_s", "replay_s", "exact_bytes", "wire_bytes",
                    "wire_exact", "descriptors", "max_desc_per_copy"):  # fmt: skip
            assert f"{layout}.{key}" in pairs
        assert int(pairs[f"{layout}.wire_bytes"]) >= int(pairs[f"{layout}.exact_bytes"]) > 0
        assert pairs[f"{layout}.unsupported"] == "0"
        # Plan quality (not speed): the wire and descriptor targets.
        assert float(pairs[f"{layout}.wire_exact"]) <= 1.02
        assert int(pairs[f"{layout}.max_desc_per_copy"]) <= 64
    # Both trainers publish the same model to the same engine rank: same useful bytes.
    assert pairs["fsdp.exact_bytes"] == pairs["megatron.exact_bytes"]


def test_demo_refuses_a_layout_that_cannot_exist_and_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["demo", "--in-process", "--size", "small", "--engine-tp", "4", "--engine-ep", "3"])
    out = capsys.readouterr().out
    assert code == 2
    assert "ep_size 3 does not divide tp_size 4" in out


def test_bench_plan_unfuses_megatron_fc1_by_view_at_deepseek_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # view → select → reshape → narrow on a 264M-element fc1: too big for an element
    # map, so this plans only if the chain resolves to strided regions.
    argv = ["bench", "plan", "--layers", "4", "--layout", "megatron", "--unfuse", "view"]
    code = main(argv)
    pairs = _last_line_pairs(capsys.readouterr().out)
    assert code == 0
    assert pairs["megatron.unsupported"] == "0"
    assert float(pairs["megatron.wire_exact"]) <= 1.02
