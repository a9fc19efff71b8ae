"""Synthetic routing predictions of a chosen recall, for the prefetch benchmark.

A predictor in the papers below applies a layer's router (or a trained stand-in) to a
hidden state one layer early and takes its top-k: it names ``k`` experts, of which a
fraction ``recall`` are the ones the layer then routes. With top-k on both sides,
precision equals recall. ``with_predictions`` draws such predictions for a generated
trace:

- each routed expert is named with probability ``recall``, independently;
- the remaining names are plausible mistakes: experts drawn from the same routing
  distribution the token's layer was drawn from (its topic's popularity), never
  one the layer routes, so mistakes favour the experts a router would also rate
  highly;
- the names are listed in random order: this generator gives no confidence signal,
  so a prefetcher cannot skip its mistakes by rank (a recorded trace's order is
  used as given).

Draws are coupled across recalls (the same uniforms per routed expert, the same
ordered mistakes), so a higher recall names a superset of the correct experts of a
lower one, and the bench compares like with like. Prefill chunks and layer 0 get no
prediction. A separate random stream is used, so the routes are those of
``generate_trace(cfg)``.

``RECALLS`` is the sweep, with the published figure each value stands for.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import replace

from refitd.errors import ConfigError
from refitd.experts.traces import DECODE, RoutingModel, RoutingTrace, TokenRoute

__all__ = ["RECALLS", "with_predictions"]

#: The recall sweep and what each value stands for. The papers report end-to-end
#: figures, not always a recall; where the value is our reading, the text says so.
RECALLS: dict[float, str] = {
    1.0: "Pre-gated MoE (ISCA 2024): its fine-tuned pre-gate selects the next layer's "
    "experts itself, so what is prefetched is what runs; the ceiling",
    0.9: "SpecMD (2026): over 88% hit rate on OLMoE with 5% of VRAM (a cache hit rate "
    "with prefetch, read here as a predictor near 0.9)",
    0.8: "Speculating Experts (2026): the next layer's router on the current hidden "
    "state, unmodified model, 'reliably predicted' with up to 14% lower TPOT; 0.8 is "
    "our reading of an untrained predictor",
    0.6: "a weak predictor (previous-layer activations on a model they predict poorly); "
    "no published figure, the sweep's floor",
}


def with_predictions(model: RoutingModel, recall: float, seed: int = 0) -> RoutingTrace:
    """``model.trace`` with a prediction of each decode token's layers 1..L-1 (see the
    module docstring); deterministic per ``(model.config.seed, seed)``."""
    if not 0.0 <= recall <= 1.0:
        raise ConfigError(f"prediction recall must be in [0, 1], got {recall}")
    trace = model.trace
    shape = trace.shape
    n_exp, k = shape.num_experts, shape.top_k
    rng = random.Random(f"refitd-predictions-{model.config.seed}-{seed}")
    cums: dict[tuple[int, int], list[float]] = {}
    tokens: list[TokenRoute] = []
    for t, tok in enumerate(trace.tokens):
        if tok.phase != DECODE:
            tokens.append(tok)
            continue
        predicted: list[tuple[int, ...]] = [()]
        topic = model.token_topic[t]
        for layer in range(1, shape.num_layers):
            routed = tok.layers[layer]
            # Uniforms first, mistakes second, order keys last: fixed per token and
            # layer whatever the recall, which couples the sweep.
            keep = [rng.random() < recall for _ in routed]
            cum = cums.get((topic, layer))
            if cum is None:
                cum = list(itertools.accumulate(model.topics[topic][layer]))
                cums[(topic, layer)] = cum
            wrong = _mistakes(rng, cum, set(routed), k, n_exp)
            names = [e for e, kept in zip(routed, keep) if kept]
            names += wrong[: max(0, len(routed) - len(names))]
            keys = {e: rng.random() for e in itertools.chain(routed, wrong)}
            names.sort(key=lambda e: keys[e])
            predicted.append(tuple(names))
        tokens.append(replace(tok, predicted=tuple(predicted)))
    return RoutingTrace(shape, tuple(tokens))


def _mistakes(
    rng: random.Random, cum: list[float], routed: set[int], k: int, n_exp: int
) -> list[int]:
    """``k`` distinct experts outside ``routed`` (fewer if the layer has fewer), drawn
    from the cumulative distribution ``cum`` by rejection, then uniformly once the
    distribution is exhausted."""
    out: list[int] = []
    taken = set(routed)
    want = min(k, n_exp - len(taken))
    total = cum[-1]
    tries = 0
    while len(out) < want and tries < 20 * k:
        tries += 1
        e = min(bisect.bisect_right(cum, rng.random() * total), n_exp - 1)
        if e not in taken:
            taken.add(e)
            out.append(e)
    rest = [e for e in range(n_exp) if e not in taken]
    while len(out) < want:
        out.append(rest.pop(rng.randrange(len(rest))))
    return out
