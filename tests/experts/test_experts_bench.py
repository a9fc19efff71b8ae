"""`refitd bench experts` runs end to end on a small configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refitd.cli import main


def last_line_pairs(text: str) -> dict[str, str]:
    last = text.strip().splitlines()[-1]
    return dict(pair.split("=", 1) for pair in last.split())


def test_the_bench_prints_every_policy_and_ends_in_key_value_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "bench",
            "experts",
            "--presets",
            "mixtral-8x7b",
            "--tokens",
            "24",
            "--requests",
            "1",
            "--prefill",
            "8",
            "--calls",
            "200",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "mixtral-8x7b" in out and "Belady" in out and "oracle gap" in out
    assert "an oracle with perfect knowledge of the true routing probabilities" in out
    pairs = last_line_pairs(out)
    for key in (
        "gap_closed",
        "oracle_gap_closed",
        "ensure_warm_us",
        "ensure_2miss_us",
        "warm_step_bytes",
    ):
        assert key in pairs
    assert 0.0 < float(pairs["oracle_gap_closed"]) <= 1.0
    assert pairs["warm_step_bytes"] == "0"
    assert float(pairs["ensure_warm_us"]) > 0


def test_the_bench_evaluates_a_recorded_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "recorded.jsonl"
    rows = [[[t % 4, (t + 1) % 4], [(t * 3) % 4, 3]] for t in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    code = main(["bench", "experts", "--trace", str(path), "--experts", "4", "--calls", "200"])
    out = capsys.readouterr().out
    assert code == 0
    assert "recorded: 2 MoE layers × 4 experts, top-2" in out
    assert "gap_closed=" in out.strip().splitlines()[-1]
    assert "oracle column not available" in out
    assert last_line_pairs(out)["oracle_gap_closed"] == "nan"
