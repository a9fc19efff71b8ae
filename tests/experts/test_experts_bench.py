"""`refitd bench experts` runs end to end on a small configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refitd.bench.prefetch import Timeline, replay
from refitd.cli import main
from refitd.experts.traces import ModelShape, RoutingTrace, TokenRoute


def last_line_pairs(text: str, *required: str) -> dict[str, str]:
    """The ``key=value`` pairs of the last line printed; each ``required`` key must be
    among them."""
    last = text.strip().splitlines()[-1]
    pairs = dict(pair.split("=", 1) for pair in last.split())
    missing = [key for key in required if key not in pairs]
    assert not missing, f"the last line lacks {missing}: {last}"
    return pairs


def bench_one_small_preset(capsys: pytest.CaptureFixture[str], *mode: str) -> str:
    """``refitd bench experts`` (with ``mode``'s flags) on one short Mixtral-8x7B
    trace; asserts it exits 0 and returns what it printed."""
    args = ["--presets", "mixtral-8x7b", "--tokens", "24", "--requests", "1", "--prefill", "8"]
    code = main(["bench", "experts", *mode, *args, "--calls", "200"])
    out = capsys.readouterr().out
    assert code == 0
    return out


def test_the_bench_prints_every_policy_and_ends_in_key_value_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = bench_one_small_preset(capsys)
    assert "mixtral-8x7b" in out and "Belady" in out and "oracle gap" in out
    assert "an oracle with perfect knowledge of the true routing probabilities" in out
    pairs = last_line_pairs(
        out,
        "gap_closed",
        "oracle_gap_closed",
        "ensure_warm_us",
        "ensure_2miss_us",
        "warm_step_bytes",
    )
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


# -- --prefetch ------------------------------------------------------------------------


def one_token_trace(predicted: bool) -> RoutingTrace:
    """One decode token routing expert 0 in both of two layers; layer 1 predicted."""
    shape = ModelShape("two-layers", 2, 4, 1)
    pred = ((), (0,)) if predicted else ()
    return RoutingTrace(shape, (TokenRoute("decode", ((0,), (0,)), pred),))


@pytest.mark.parametrize(("compute", "stall"), [(4.0, 16.0), (20.0, 10.0)])
def test_a_prefetch_hides_at_most_the_compute_of_the_layer_it_overlaps(
    compute: float, stall: float
) -> None:
    # One expert's copy takes 10 s. Layer 0 misses (10 s); layer 1's expert, prefetched
    # behind that copy, lands at 20 s while layer 1 may start at 10 s + compute: it
    # waits 6 s when layer 0 computes 4 s, nothing when it computes 20 s. On demand,
    # both layers wait 10 s.
    link = Timeline("test", "test", link_bps=1.0, compute_bps=1.0, source="")
    run = replay(one_token_trace(True), 4, None, True, 10, [compute], [link])
    assert run.stall == (stall,)
    assert (run.critical, run.copies, run.prefetched) == (1, 1, 1)
    demand = replay(one_token_trace(False), 4, None, False, 10, [compute], [link])
    assert demand.stall == (20.0,)
    assert (demand.critical, demand.copies) == (2, 2)


def test_the_prefetch_bench_compares_four_policies_and_ends_in_key_value_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = bench_one_small_preset(capsys, "--prefetch")
    assert "Speculating Experts" in out and "PCIe Gen5" in out and "hybrid" in out
    assert "ours+pf" in out
    pairs = last_line_pairs(
        out,
        "critical_vs_belady",
        "prefetch_bytes_ratio",
        "stall_vs_belady_linkbound",
        "stall_vs_belady_hybrid",
        "ensure_warm_us",
        "prefetch_us",
    )
    assert 0.0 < float(pairs["critical_vs_belady"]) < 1.0  # prefetch at 0.8 beats Belady
    assert float(pairs["prefetch_bytes_ratio"]) >= 1.0
    assert pairs["warm_step_bytes"] == "0"


def test_the_prefetch_bench_reads_recorded_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "recorded.jsonl"
    rows = []
    for t in range(60):
        layers = [[t % 4, (t + 1) % 4], [(t * 3) % 4, 3]]
        rows.append({"layers": layers, "predicted": [[], [(t * 3) % 4, (t + 2) % 4]]})
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    args = ["bench", "experts", "--prefetch", "--trace", str(path), "--calls", "200"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recorded: 2 MoE layers × 4 experts, top-2" in out
    assert "critical_vs_belady=" in out.strip().splitlines()[-1]
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps([[0], [1]]), encoding="utf-8")
    assert main(["bench", "experts", "--prefetch", "--trace", str(bare)]) == 2
    assert "carries no predictions" in capsys.readouterr().out


def test_an_unknown_preset_is_refused_in_one_line_naming_it_and_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "experts", "--presets", "mixtral-8x7b,nope"])
    assert exited.value.code == 2  # argparse's exit status for a refused argument
    err = capsys.readouterr().err
    refusal = err.strip().splitlines()[-1]
    assert "--presets" in refusal and "'nope'" in refusal
    assert all(known in refusal for known in ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b"))
