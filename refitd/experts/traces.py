"""Routing traces: which experts each token routes to, per MoE layer.

A trace is a sequence of *tokens*; each token names, for every MoE layer, the experts
its router chose. A prefill token stands for a whole prompt chunk processed at once:
its per-layer lists are the union over the chunk. Replaying a trace against a cache
calls ``ensure(layer, experts)`` for each token's layers in order (``steps()``).

Two sources:

- ``generate_trace`` — a synthetic generator calibrated to published routing
  statistics (see ``TraceConfig``), with presets for Mixtral-8x7B, Qwen3-30B-A3B and
  DeepSeek-V3;
- traces recorded from a real model as JSON lines, one token per line
  (:mod:`refitd.experts.tracefile`: the format, ``parse_trace_lines`` and
  ``read_trace_file``).

Predictions: a token's ``TokenRoute.predicted[l]`` is the prediction for its layer
``l``, issued while layer ``l - 1`` runs (so layer 0 has none: the token's hidden
state does not exist before it). ``with_predictions`` adds synthetic ones of a chosen
recall to a generated trace.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from refitd.errors import ConfigError

__all__ = [
    "PRESETS",
    "ModelShape",
    "RoutingModel",
    "RoutingTrace",
    "TokenRoute",
    "TraceConfig",
    "generate_trace",
    "preset_config",
    "routing_model",
]

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True)
class ModelShape:
    """The MoE part of a model: layers with routed experts, experts per layer, top-k."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int

    @property
    def active(self) -> int:
        """Experts one decode token activates across all MoE layers."""
        return self.num_layers * self.top_k


@dataclass(frozen=True)
class TokenRoute:
    """One token (or one prefill chunk): ``layers[l]`` are the experts of layer ``l``;
    ``predicted[l]`` (when not empty) the experts predicted for layer ``l`` one layer
    ahead, most confident first."""

    phase: str
    layers: tuple[tuple[int, ...], ...]
    # Out of ``repr`` so a trace's recorded hash (repr of its tokens) stays the same.
    predicted: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def prediction(self, layer: int) -> tuple[int, ...]:
        """The prediction for ``layer``, empty when there is none."""
        return self.predicted[layer] if layer < len(self.predicted) else ()


@dataclass(frozen=True)
class RoutingTrace:
    shape: ModelShape
    tokens: tuple[TokenRoute, ...]

    def steps(self) -> list[tuple[int, tuple[int, ...]]]:
        """``(layer, experts)`` in replay order: token by token, layer by layer."""
        return [(layer, ex) for tok in self.tokens for layer, ex in enumerate(tok.layers)]

    def decode_tokens(self) -> int:
        return sum(t.phase == DECODE for t in self.tokens)

    def has_predictions(self) -> bool:
        return any(any(p) for t in self.tokens for p in t.predicted)

    def recall(self) -> float:
        """Fraction of routed decode experts (layers with a prediction) that their
        prediction named; 0.0 without predictions."""
        named = total = 0
        for tok in self.tokens:
            if tok.phase != DECODE:
                continue
            for layer, routed in enumerate(tok.layers):
                pred = tok.prediction(layer)
                if pred:
                    named += len(set(routed) & set(pred))
                    total += len(set(routed))
        return named / total if total else 0.0

    def reuse(self, window: int) -> float:
        """Fraction of a decode token's experts routed again, same layer, within the
        next ``window`` decode tokens of the same run (runs end at a prefill)."""
        reused = total = 0
        runs: list[list[TokenRoute]] = [[]]
        for tok in self.tokens:
            if tok.phase == PREFILL:
                runs.append([])
            else:
                runs[-1].append(tok)
        for run in runs:
            for i in range(len(run) - window):
                for layer, experts in enumerate(run[i].layers):
                    ahead: set[int] = set()
                    for j in range(i + 1, i + 1 + window):
                        ahead.update(run[j].layers[layer])
                    reused += sum(e in ahead for e in experts)
                    total += len(experts)
        return reused / total if total else 0.0


@dataclass(frozen=True)
class TraceConfig:
    """Knobs of the synthetic generator.

    Popularity: each layer has a base popularity (Zipf with exponent ``base_skew``
    over a random order of its experts, mild because load balancing flattens it) and
    each *topic* a sharper one (``topic_skew``); a token draws from the mixture with
    weight ``topic_weight`` on the topic. A request starts a new topic and each decode
    token switches topic with probability ``1 / topic_tokens`` (drift).

    Temporal reuse, per pick: with probability ``p_prev`` an expert the same layer
    used at the previous token, else with ``p_recent`` one it used within the last
    ``recent_window`` tokens, else a fresh draw. Calibrated (see ``PRESETS``) so that
    ≈45% of a token's experts recur at the next token and ≈80% within 8 tokens, the
    figures measured for Qwen3-30B-A3B; ``RoutingTrace.reuse`` reports the result.

    Layer correlation: a fresh draw follows, with probability ``p_layer``, a fixed
    partner of one of the previous layer's experts at the same token.
    """

    shape: ModelShape
    requests: int = 4
    prefill_tokens: int = 128
    decode_tokens: int = 256
    base_skew: float = 0.6
    topic_skew: float = 1.0
    topic_weight: float = 0.9
    topic_tokens: int = 128
    topic_span: float = 2.0
    p_prev: float = 0.17
    p_recent: float = 0.0
    recent_window: int = 8
    p_layer: float = 0.25
    seed: int = 0


PRESETS: dict[str, ModelShape] = {
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 8, 2),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 128, 8),
    "deepseek-v3": ModelShape("deepseek-v3", 58, 256, 8),
}

# Per-preset reuse knobs from calibration runs of this generator (seed 0): each pair
# lands next-token reuse near 45% and 8-token reuse near 80% where the expert count
# allows. Mixtral has 8 experts and top-2, so popularity alone already recurs within 8
# tokens more than 80% of the time; only the next-token figure is matched there.
_CALIBRATED: dict[str, tuple[float, float]] = {
    "mixtral-8x7b": (0.05, 0.0),
    "qwen3-30b-a3b": (0.17, 0.0),
    "deepseek-v3": (0.17, 0.0),
}


def preset_config(name: str, **overrides: object) -> TraceConfig:
    """The calibrated generator configuration for a preset, with overrides."""
    try:
        shape = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown trace preset {name!r}; known: {sorted(PRESETS)}") from None
    p_prev, p_recent = _CALIBRATED[name]
    cfg = TraceConfig(shape, p_prev=p_prev, p_recent=p_recent)
    return replace(cfg, **overrides)  # type: ignore[arg-type]


@dataclass
class _Popularity:
    """Cumulative weights per layer for the current topic."""

    base: list[list[float]]
    cum: list[list[float]] = field(default_factory=list)


def _zipf(order: Sequence[int], skew: float, n: int) -> list[float]:
    """Zipf weights over the experts in ``order`` (rank = position); 0 for the rest."""
    w = [0.0] * n
    for rank, e in enumerate(order):
        w[e] = 1.0 / (rank + 1) ** skew
    total = sum(w)
    return [x / total for x in w]


def generate_trace(cfg: TraceConfig) -> RoutingTrace:
    """A deterministic (per ``cfg.seed``) synthetic trace; see ``TraceConfig``."""
    return _generate(cfg, None)


@dataclass(frozen=True)
class RoutingModel:
    """The generator's hidden state behind one trace: what each token was drawn from.

    ``routing_model(cfg)`` regenerates it from the seed alongside the very trace
    ``generate_trace(cfg)`` returns. It exists for oracles and tests that ask how much
    of a policy's shortfall is the routing's own randomness; a real model has no such
    side channel.

    ``topics[i][layer][e]`` is the probability that a fresh draw of ``layer`` picks
    expert ``e`` under topic ``i`` (base and topic popularity mixed, sums to 1);
    ``token_topic[t]`` is the topic in effect at token ``t``; ``partner[layer][b]`` is
    the expert of ``layer`` that layer coupling picks for expert ``b`` of the layer
    below (a permutation). ``request_start[t]`` says whether token ``t`` is the first
    decode token of its request (its layers have no previous token to stick to).
    """

    config: TraceConfig
    trace: RoutingTrace
    topics: tuple[tuple[tuple[float, ...], ...], ...]
    token_topic: tuple[int, ...]
    partner: tuple[tuple[int, ...], ...]
    request_start: tuple[bool, ...]

    def prefill_draws(self) -> int:
        """Independent draws (with repetition) a prefill chunk's layer is the union of."""
        return self.config.prefill_tokens * self.config.shape.top_k

    def history(self, token: int, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(prev, recent)`` for a decode token: the experts ``layer`` routed at the
        previous decode token of the same request, and those it routed within the
        ``recent_window`` tokens before that but not at the previous one (ascending)."""
        tokens = self.trace.tokens
        if tokens[token].phase != DECODE or self.request_start[token]:
            return (), ()
        window: list[tuple[int, ...]] = []
        t = token - 1
        while t >= 0 and len(window) < self.config.recent_window:
            window.append(tokens[t].layers[layer])
            if self.request_start[t]:
                break
            t -= 1
        prev = window[0]
        recent = tuple(sorted({e for h in window[1:] for e in h} - set(prev)))
        return prev, recent

    def pick_distribution(self, token: int, layer: int) -> tuple[float, ...]:
        """Probability, per expert, that the *first* pick of ``(token, layer)`` lands on
        it, given every route drawn before it (exact under the generator's model).

        A decode pick is sticky with ``p_prev`` (uniform over ``prev``), recent with
        ``p_recent`` (uniform over ``recent``), else coupled with ``p_layer`` (the
        partner of a uniform expert of the layer below at the same token), else a
        fresh draw from the topic; an empty pool passes its share on, as the
        generator does. Later picks repeat this, re-drawing experts already chosen.
        A prefill chunk's layer is ``prefill_draws()`` fresh draws from the topic.
        """
        cfg = self.config
        mix = self.topics[self.token_topic[token]][layer]
        if self.trace.tokens[token].phase != DECODE:
            return mix
        prev, recent = self.history(token, layer)
        below = self.trace.tokens[token].layers[layer - 1] if layer > 0 else ()
        out = [0.0] * len(mix)
        rest = 1.0
        for pool, share in ((prev, cfg.p_prev), (recent, cfg.p_recent)):
            if pool and share > 0.0:
                for e in pool:
                    out[e] += share / len(pool)
                rest -= share
        if below:
            partner = self.partner[layer]
            for b in below:
                out[partner[b]] += rest * cfg.p_layer / len(below)
            rest *= 1.0 - cfg.p_layer
        return tuple(o + rest * m for o, m in zip(out, mix))


def routing_model(cfg: TraceConfig) -> RoutingModel:
    """Regenerate ``generate_trace(cfg)`` together with the state it was drawn from."""
    record = _Record()
    trace = _generate(cfg, record)
    return RoutingModel(
        cfg,
        trace,
        tuple(record.topics),
        tuple(record.token_topic),
        record.partner,
        tuple(record.request_start),
    )


@dataclass
class _Record:
    """What ``_generate`` saw, for ``routing_model``; never consulted by the draws."""

    topics: list[tuple[tuple[float, ...], ...]] = field(default_factory=list)
    token_topic: list[int] = field(default_factory=list)
    partner: tuple[tuple[int, ...], ...] = ()
    request_start: list[bool] = field(default_factory=list)


def _generate(cfg: TraceConfig, record: _Record | None) -> RoutingTrace:
    # Recording must not touch ``rng``: the trace for a seed is fixed (tested by hash).
    shape = cfg.shape
    n_layers, n_exp, k = shape.num_layers, shape.num_experts, shape.top_k
    if not 0 < k <= n_exp:
        raise ConfigError(f"top_k {k} must be in 1..{n_exp} for {shape.name}")
    rng = random.Random(cfg.seed)
    experts = list(range(n_exp))

    def shuffled() -> list[int]:
        order = experts[:]
        rng.shuffle(order)
        return order

    base = [_zipf(shuffled(), cfg.base_skew, n_exp) for _ in range(n_layers)]
    partner = [shuffled() for _ in range(n_layers)]
    tw = cfg.topic_weight
    if record is not None:
        record.partner = tuple(tuple(p) for p in partner)

    def new_topic() -> list[list[float]]:
        cums = []
        for layer in range(n_layers):
            span = max(k, min(n_exp, round(cfg.topic_span * k)))
            topic = _zipf(shuffled()[:span], cfg.topic_skew, n_exp)
            mix = [(1 - tw) * b + tw * t for b, t in zip(base[layer], topic)]
            cums.append(list(itertools.accumulate(mix)))
        if record is not None:
            # ``draw`` scales by the last cumulative weight, so that is the total.
            record.topics.append(
                tuple(
                    tuple((c - (cum[i - 1] if i else 0.0)) / cum[-1] for i, c in enumerate(cum))
                    for cum in cums
                )
            )
        return cums

    def draw(cum: list[float]) -> int:
        return min(bisect.bisect_right(cum, rng.random() * cum[-1]), n_exp - 1)

    def note(start: bool) -> None:
        if record is not None:
            record.token_topic.append(len(record.topics) - 1)
            record.request_start.append(start)

    tokens: list[TokenRoute] = []
    for _ in range(cfg.requests):
        cum = new_topic()
        if cfg.prefill_tokens > 0:
            draws = cfg.prefill_tokens * k
            chunk = tuple(
                tuple(sorted({draw(cum[layer]) for _ in range(draws)})) for layer in range(n_layers)
            )
            tokens.append(TokenRoute(PREFILL, chunk))
            note(False)
        history: list[list[tuple[int, ...]]] = [[] for _ in range(n_layers)]
        for i in range(cfg.decode_tokens):
            if rng.random() < 1.0 / cfg.topic_tokens:
                cum = new_topic()
            note(i == 0)
            layers: list[tuple[int, ...]] = []
            below: tuple[int, ...] = ()
            for layer in range(n_layers):
                hist = history[layer]
                prev = hist[-1] if hist else ()
                recent = sorted({e for h in hist[:-1] for e in h} - set(prev))
                chosen: list[int] = []
                while len(chosen) < k:
                    r = rng.random()
                    pool: Sequence[int] = ()
                    if r < cfg.p_prev:
                        pool = prev
                    elif r < cfg.p_prev + cfg.p_recent:
                        pool = recent
                    pool = [e for e in pool if e not in chosen]
                    if pool:
                        e = pool[rng.randrange(len(pool))]
                    elif below and rng.random() < cfg.p_layer:
                        e = partner[layer][below[rng.randrange(len(below))]]
                    else:
                        e = draw(cum[layer])
                    if e not in chosen:
                        chosen.append(e)
                routed = tuple(chosen)
                hist.append(routed)
                if len(hist) > cfg.recent_window:
                    del hist[0]
                layers.append(routed)
                below = routed
            tokens.append(TokenRoute(DECODE, tuple(layers)))
    return RoutingTrace(shape, tuple(tokens))
