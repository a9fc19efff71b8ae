"""Recorded routing traces: the JSON-lines format a real model's routing is written in,
parsed and read (:class:`~refitd.experts.traces.RoutingTrace` is what they make).

One token per line, either ``[[e, ...], [e, ...], ...]`` (one list per MoE layer, a
decode token) or ``{"layers": [[...], ...], "phase": "prefill" | "decode",
"predicted": [[...], ...]}``. ``predicted`` is optional: ``predicted[l]`` lists the
experts a predictor named for layer ``l`` of that token before the layer ran (for
example the layer's router applied to the hidden state one layer earlier), most
confident first; an empty list means no prediction for that layer.

:func:`read_trace_file` is the one function of :mod:`refitd.experts` that does I/O.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path

from refitd.errors import ConfigError
from refitd.experts.traces import DECODE, PREFILL, ModelShape, RoutingTrace, TokenRoute

__all__ = ["parse_trace_lines", "read_trace_file"]


def parse_trace_lines(
    lines: Iterable[str], *, num_experts: int | None = None, name: str = "recorded"
) -> RoutingTrace:
    """Parse a JSON-lines routing trace (format in the module docstring).

    Every line must list the same number of layers; expert ids must be integers in
    ``0..num_experts-1`` (when ``num_experts`` is not given it is inferred as the
    largest id + 1). Blank lines are skipped. ``top_k`` is the most experts any
    decode token routes in one layer. Refusals name the line.
    """
    tokens: list[TokenRoute] = []
    n_layers = -1
    top = 0
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"trace line {lineno} is not JSON: {e.msg}") from e
        phase = DECODE
        predicted_obj: object = None
        if isinstance(obj, dict):
            phase = obj.get("phase", DECODE)
            predicted_obj = obj.get("predicted")
            obj = obj.get("layers")
            if phase not in (PREFILL, DECODE):
                raise ConfigError(
                    f"trace line {lineno} has phase {phase!r}, not 'prefill' or 'decode'"
                )
        if not isinstance(obj, list) or not all(isinstance(x, list) for x in obj):
            raise ConfigError(
                f"trace line {lineno} is not a list of per-layer expert lists "
                '(or {"layers": [...]})'
            )
        if n_layers < 0:
            n_layers = len(obj)
            if n_layers == 0:
                raise ConfigError(f"trace line {lineno} lists no layers")
        elif len(obj) != n_layers:
            raise ConfigError(
                f"trace line {lineno} lists {len(obj)} layers but earlier lines list {n_layers}"
            )
        layers = _expert_lists(obj, lineno, num_experts, "routes")
        if phase == DECODE:
            top = max([top] + [len(set(ids)) for ids in layers])
        predicted: tuple[tuple[int, ...], ...] = ()
        if predicted_obj is not None:
            if not isinstance(predicted_obj, list) or not all(
                isinstance(x, list) for x in predicted_obj
            ):
                raise ConfigError(
                    f"trace line {lineno} has 'predicted' that is not a list of per-layer "
                    "expert lists"
                )
            if len(predicted_obj) != n_layers:
                raise ConfigError(
                    f"trace line {lineno} predicts {len(predicted_obj)} layers but routes "
                    f"{n_layers}: predicted[l] is the prediction for layer l"
                )
            predicted = _expert_lists(predicted_obj, lineno, num_experts, "predicts")
        tokens.append(TokenRoute(phase, layers, predicted))
    if not tokens:
        raise ConfigError("trace holds no tokens")
    if num_experts is None:
        num_experts = 1 + max(
            max(ex, default=0) for t in tokens for ex in itertools.chain(t.layers, t.predicted)
        )
    shape = ModelShape(name, n_layers, num_experts, max(top, 1))
    return RoutingTrace(shape, tuple(tokens))


def _expert_lists(
    obj: list[list[object]], lineno: int, num_experts: int | None, verb: str
) -> tuple[tuple[int, ...], ...]:
    """Validate one line's per-layer expert lists (routes or predictions)."""
    out: list[tuple[int, ...]] = []
    for layer, ids in enumerate(obj):
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise ConfigError(
                f"trace line {lineno} layer {layer} holds a value that is not a "
                "non-negative integer expert id"
            )
        checked = [e for e in ids if isinstance(e, int)]
        if num_experts is not None and any(e >= num_experts for e in checked):
            raise ConfigError(
                f"trace line {lineno} layer {layer} {verb} expert {max(checked)}, but the "
                f"model has {num_experts} experts"
            )
        out.append(tuple(checked))
    return tuple(out)


def read_trace_file(path: str | Path, *, num_experts: int | None = None) -> RoutingTrace:
    """Read a JSON-lines routing trace from ``path``; the package's only file I/O."""
    p = Path(path)
    with p.open(encoding="utf-8") as f:
        return parse_trace_lines(f, num_experts=num_experts, name=p.stem)
