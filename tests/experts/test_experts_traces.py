"""Routing traces: the calibrated generator and the JSON-lines loader."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from refitd.errors import ConfigError
from refitd.experts.tracefile import parse_trace_lines, read_trace_file
from refitd.experts.traces import (
    PRESETS,
    ModelShape,
    TraceConfig,
    generate_trace,
    preset_config,
    routing_model,
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


# sha256 of repr(trace.tokens) before routing_model() existed: recording the generator's
# hidden state must not change a single draw.
_TRACE_HASHES = {
    ("mixtral-8x7b", 0): "bad07450b698983a0c385a65136b16a6bfe5546ce738c01f3e2a1d54aab22f8e",
    ("mixtral-8x7b", 3): "e88b73a651b06c8a8d86c4b61b7fa98a8230413b81bccf7ebbfcd49a39b38fc4",
    ("qwen3-30b-a3b", 0): "7bca16cdf22ab8bdfe0459ccb6877102cdfb17500cd451b01ca593add66e2794",
    ("qwen3-30b-a3b", 3): "73a4b8353bd18ae0aa33eb17587a741b79f001f5e3401b177ba439bb206396bc",
    ("deepseek-v3", 0): "dfdcb76f37690dd0b58fc2978605693246d388d533b6c6486e8a314dd6a7da8c",
    ("deepseek-v3", 3): "035ab521dc6a435b5494e57047601a8ed931c799f945d95878489e8da29dd875",
}


@pytest.mark.parametrize(("name", "seed"), sorted(_TRACE_HASHES))
def test_traces_stay_byte_identical_and_routing_model_regenerates_the_same_trace(
    name: str, seed: int
) -> None:
    cfg = preset_config(name, requests=2, decode_tokens=40, prefill_tokens=16, seed=seed)
    trace = generate_trace(cfg)
    assert hashlib.sha256(repr(trace.tokens).encode()).hexdigest() == _TRACE_HASHES[name, seed]
    model = routing_model(cfg)
    assert model.trace == trace
    assert len(model.token_topic) == len(trace.tokens)


def test_a_first_pick_follows_the_distribution_the_model_reports() -> None:
    # Top-1: each decode token's route IS one first pick, so the model's probabilities
    # must predict how often the route repeats the previous token's expert (stickiness)
    # and follows the layer below's partner (coupling), and its likelihood must beat
    # the topic mixture's alone.
    shape = ModelShape("top1", 4, 16, 1)
    cfg = TraceConfig(shape, requests=3, prefill_tokens=4, decode_tokens=400, p_prev=0.3, seed=7)
    model = routing_model(cfg)
    predicted_sticky = observed_sticky = 0.0
    loglik_model = loglik_topic = 0.0
    for t, tok in enumerate(model.trace.tokens):
        if tok.phase != "decode":
            continue
        for layer, routed in enumerate(tok.layers):
            pick = model.pick_distribution(t, layer)
            assert math.isclose(sum(pick), 1.0, rel_tol=1e-9)
            prev, _ = model.history(t, layer)
            predicted_sticky += sum(pick[e] for e in prev)
            observed_sticky += routed[0] in prev
            loglik_model += math.log(pick[routed[0]])
            loglik_topic += math.log(model.topics[model.token_topic[t]][layer][routed[0]])
    assert observed_sticky == pytest.approx(predicted_sticky, rel=0.08)
    assert loglik_model > loglik_topic
