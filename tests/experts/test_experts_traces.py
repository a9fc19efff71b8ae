"""Routing traces: the calibrated generator and the JSON-lines loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refitd.errors import ConfigError
from refitd.experts.traces import (
    PRESETS,
    generate_trace,
    parse_trace_lines,
    preset_config,
    read_trace_file,
)


def test_presets_carry_the_published_model_shapes() -> None:
    shapes = {n: (s.num_layers, s.num_experts, s.top_k) for n, s in PRESETS.items()}
    assert shapes == {
        "mixtral-8x7b": (32, 8, 2),
        "qwen3-30b-a3b": (48, 128, 8),
        "deepseek-v3": (58, 256, 8),
    }
    assert PRESETS["qwen3-30b-a3b"].active == 384


def test_an_unknown_preset_is_refused_with_the_known_names() -> None:
    with pytest.raises(ConfigError, match="deepseek-v3"):
        preset_config("gpt-oss")


def test_the_generator_is_deterministic_per_seed() -> None:
    cfg = preset_config("qwen3-30b-a3b", requests=1, decode_tokens=8, prefill_tokens=4)
    assert generate_trace(cfg) == generate_trace(cfg)
    other = generate_trace(preset_config("qwen3-30b-a3b", requests=1, decode_tokens=8, seed=1))
    assert other != generate_trace(cfg)


def test_each_decode_token_routes_top_k_distinct_experts_in_every_layer() -> None:
    trace = generate_trace(preset_config("deepseek-v3", requests=2, decode_tokens=6))
    shape = trace.shape
    assert [t.phase for t in trace.tokens].count("prefill") == 2
    assert trace.decode_tokens() == 12
    for tok in trace.tokens:
        assert len(tok.layers) == shape.num_layers
        for experts in tok.layers:
            assert all(0 <= e < shape.num_experts for e in experts)
            assert len(set(experts)) == len(experts)
            if tok.phase == "decode":
                assert len(experts) == shape.top_k
            else:
                assert len(experts) > shape.top_k, "a prefill chunk is a union of tokens"
    assert len(trace.steps()) == len(trace.tokens) * shape.num_layers


def test_qwen_traces_reuse_experts_at_the_published_rates() -> None:
    trace = generate_trace(preset_config("qwen3-30b-a3b", requests=2, decode_tokens=96))
    assert trace.reuse(1) == pytest.approx(0.45, abs=0.05)
    assert trace.reuse(8) == pytest.approx(0.80, abs=0.07)


def test_a_recorded_trace_reads_from_bare_lists_and_from_objects(tmp_path: Path) -> None:
    path = tmp_path / "qwen-sample.jsonl"
    lines = [
        json.dumps({"phase": "prefill", "layers": [[0, 1, 2, 3], [1, 2, 5]]}),
        "",
        json.dumps([[0, 1], [2, 5]]),
        json.dumps({"layers": [[1, 3], [5, 4]]}),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    trace = read_trace_file(path, num_experts=6)
    assert trace.shape.name == "qwen-sample"
    assert (trace.shape.num_layers, trace.shape.num_experts, trace.shape.top_k) == (2, 6, 2)
    assert [t.phase for t in trace.tokens] == ["prefill", "decode", "decode"]
    assert trace.tokens[2].layers == ((1, 3), (5, 4))
    assert trace.steps()[:3] == [(0, (0, 1, 2, 3)), (1, (1, 2, 5)), (0, (0, 1))]


def test_the_expert_count_of_a_recorded_trace_defaults_to_the_largest_id() -> None:
    trace = parse_trace_lines(["[[0, 7]]", "[[3, 2]]"])
    assert trace.shape.num_experts == 8


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["not json"], "line 1 is not JSON"),
        (["[[0], [1]]", "[[0]]"], "line 2 lists 1 layers but earlier lines list 2"),
        (['{"layers": [[0]], "phase": "warmup"}'], "phase 'warmup'"),
        (["[[0, -1]]"], "non-negative integer"),
        (["[[0, 1.5]]"], "non-negative integer"),
        (["[0, 1]"], "per-layer expert lists"),
        (["[[0, 9]]"], "routes expert 9, but the model has 8"),
        (["", "  "], "no tokens"),
        (["[]"], "lists no layers"),
    ],
)
def test_a_malformed_recorded_trace_is_refused_naming_the_line(
    lines: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_trace_lines(lines, num_experts=8)
