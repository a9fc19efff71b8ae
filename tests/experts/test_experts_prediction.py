"""Predictions of the next layer's routing: the synthetic generator of a chosen recall,
and predictions recorded next to routes in a JSON-lines trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refitd.errors import ConfigError
from refitd.experts.prediction import RECALLS, with_predictions
from refitd.experts.tracefile import parse_trace_lines
from refitd.experts.traces import (
    DECODE,
    RoutingModel,
    preset_config,
    routing_model,
)


@pytest.fixture(scope="module")
def qwen_model() -> RoutingModel:
    return routing_model(preset_config("qwen3-30b-a3b", requests=2, decode_tokens=48))


def test_predictions_are_top_k_and_name_the_routed_experts_at_the_chosen_recall(
    qwen_model: RoutingModel,
) -> None:
    trace = with_predictions(qwen_model, 0.8)
    assert abs(trace.recall() - 0.8) < 0.02
    for tok, original in zip(trace.tokens, qwen_model.trace.tokens, strict=True):
        assert tok.layers == original.layers  # the routes are untouched
        if tok.phase != DECODE:
            assert not any(tok.predicted)
            continue
        assert tok.prediction(0) == ()  # nothing exists to predict layer 0 from
        for layer in range(1, len(tok.layers)):
            pred = tok.prediction(layer)
            assert len(pred) == len(set(pred)) == len(tok.layers[layer])  # precision = recall


def test_a_higher_recall_names_a_superset_of_the_correct_experts(
    qwen_model: RoutingModel,
) -> None:
    low, high = with_predictions(qwen_model, 0.6), with_predictions(qwen_model, 0.9)
    for a, b in zip(low.tokens, high.tokens, strict=True):
        for layer, routed in enumerate(a.layers):
            right_low = set(a.prediction(layer)) & set(routed)
            right_high = set(b.prediction(layer)) & set(routed)
            assert right_low <= right_high
    assert with_predictions(qwen_model, 1.0).recall() == 1.0
    assert with_predictions(qwen_model, 0.0).recall() == 0.0


def test_every_swept_recall_names_what_it_stands_for() -> None:
    assert sorted(RECALLS) == [0.6, 0.8, 0.9, 1.0]
    assert "Pre-gated MoE" in RECALLS[1.0]
    assert "Speculating Experts" in RECALLS[0.8]
    assert "SpecMD" in RECALLS[0.9]


def test_a_recall_outside_zero_and_one_is_refused(qwen_model: RoutingModel) -> None:
    with pytest.raises(ConfigError, match="recall"):
        with_predictions(qwen_model, 1.2)


def test_a_recorded_trace_carries_predictions_next_to_routes() -> None:
    lines = [
        json.dumps({"layers": [[0, 1], [2, 3]], "predicted": [[], [3, 1]]}),
        json.dumps([[1, 2], [0, 3]]),  # no prediction on this line
        json.dumps({"phase": "prefill", "layers": [[0], [1]]}),
    ]
    trace = parse_trace_lines(lines)
    assert trace.tokens[0].prediction(1) == (3, 1)
    assert trace.tokens[0].prediction(0) == ()
    assert trace.tokens[1].prediction(1) == ()
    assert trace.has_predictions()
    assert trace.recall() == pytest.approx(0.5)  # one of layer 1's two routes was named
    assert trace.shape.num_experts == 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"layers": [[0], [1]], "predicted": [[1]]}, "predicts 1 layers but routes 2"),
        ({"layers": [[0], [1]], "predicted": [[], [9]]}, "predicts expert 9"),
        ({"layers": [[0], [1]], "predicted": [[], ["x"]]}, "not a non-negative integer"),
        ({"layers": [[0], [1]], "predicted": 3}, "'predicted' that is not a list"),
    ],
)
def test_a_malformed_recorded_prediction_is_refused_naming_the_line(
    line: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match="line 1") as info:
        parse_trace_lines([json.dumps(line)], num_experts=4)
    assert message in str(info.value)


def test_predictions_round_trip_through_a_recorded_file(
    tmp_path: Path,
    qwen_model: RoutingModel,
) -> None:
    from refitd.experts.tracefile import read_trace_file

    trace = with_predictions(qwen_model, 0.9)
    path = tmp_path / "recorded.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for tok in trace.tokens:
            obj = {"phase": tok.phase, "layers": [list(x) for x in tok.layers]}
            if tok.predicted:
                obj["predicted"] = [list(x) for x in tok.predicted]
            f.write(json.dumps(obj) + "\n")
    back = read_trace_file(path, num_experts=128)
    assert back.tokens == trace.tokens
    assert back.recall() == trace.recall()
