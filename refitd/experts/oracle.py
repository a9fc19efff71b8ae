"""An oracle eviction policy told the trace generator's true routing probabilities.

Benchmark and test use only — not for production: it reads the synthetic
generator's hidden state (``refitd.experts.traces.RoutingModel``), which no real
model offers. It answers one question for ``refitd bench experts``: how much of
the LRU→Belady gap does ``ExpectedReusePolicy``'s expected-next-use rule close when
it knows the routing probabilities exactly instead of estimating them? What it still
loses to Belady is the random draws themselves, which no online policy can know.

What it knows at step ``(token t, layer l)``, for each layer ``m``'s next visit
``(t', m)`` (``t' = t`` if ``m > l``, else ``t + 1``):

- the topic in effect at ``t'`` (the true mixture, including a switch at ``t'``);
- every route drawn before the current step ends: the previous tokens (stickiness)
  and, for layer ``l + 1``, the current step's routes (layer coupling, exact);
- for a layer whose layer below is not yet drawn at ``t'``, the coupling term is
  averaged over that layer's draws, using its inclusion probabilities (computed the
  same way, down the layers).

From the per-pick distribution ``pi`` the probability that ``(t', m)`` routes expert
``e`` is exact for a prefill chunk (``1 - (1 - pi_e) ** draws``) and, for a decode
token's ``k`` distinct picks, the successive-sampling approximation
``1 - exp(-lam * pi_e)`` with ``lam`` solved so the ``k`` probabilities sum to ``k``.

The victim is the resident expert maximising ``next visit of its layer + L·(1/p − 1)``
— ``ExpectedReusePolicy``'s rule with ``p`` known instead of learned — with ``p = 0``
(never routed again) ranking infinite and ties going to the lowest slot. The exact
expectation under the generator's model (stickiness fades after one visit, so
``next visit + L·(1 − p1)/p_inf``) was tried and closed far less of the gap: the mean
of a long-tailed wait is the wrong thing to rank by when the pool holds a few tokens'
worth of experts. So this bounds policies that rank by this rule; it is no proof about
every conceivable policy (the bench shows cells where ours beats it).

Invariants kept as every policy does: decisions are a pure function of the model
and the steps (no clock, no random source); a slot touched in the current step is
never returned; forgotten slots are taken by the cache before any victim is asked
for. The replay must follow ``trace.steps()`` from a fresh cache; a step for another
layer (including ``materialize_layer``) is refused, since the answers would no longer
describe the step being placed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from refitd.errors import PlanError
from refitd.experts.policy import EvictionPolicy, PoolView
from refitd.experts.traces import DECODE, RoutingModel

__all__ = ["OracleProbabilityPolicy", "OracleTables", "oracle_tables"]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


class OracleTables:
    """Per layer, per token: probability each expert is routed at ``(token, layer)``.

    ``revealed[m][t]`` conditions on the layer below's routes at token ``t``;
    ``unseen[m][t]`` averages over them. Rows are float32 (one token × experts each),
    built once per trace and shared by every pool size replayed over it.
    """

    def __init__(self, unseen: list[F32], revealed: list[F32]) -> None:
        self.unseen = unseen
        self.revealed = revealed


def _inclusion(pi: F64, k: int) -> F64:
    """Rows of per-pick probabilities → probabilities of being among ``k`` distinct
    picks: ``1 - exp(-lam * pi)`` with ``lam`` per row such that each row sums to ``k``.

    Newton from ``lam = k`` (where the sum is at most ``k``); the sum is concave in
    ``lam``, so the iterates rise monotonically to the root.
    """
    lam = np.full((pi.shape[0], 1), float(k))
    for _ in range(60):
        ex = np.exp(-lam * pi)
        f = (1.0 - ex).sum(axis=1, keepdims=True) - k
        if float(np.abs(f).max()) < 1e-7:
            break
        slope = (pi * ex).sum(axis=1, keepdims=True)
        lam = lam - f / np.maximum(slope, 1e-300)
    out: F64 = 1.0 - np.exp(-lam * pi)
    return out


def _coords(rows: list[int], cols: list[int]) -> tuple[npt.NDArray[np.int64], ...]:
    return np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)


def oracle_tables(model: RoutingModel) -> OracleTables:
    """Compute ``OracleTables`` for the trace of ``model`` (see the module docstring)."""
    cfg, trace = model.config, model.trace
    shape = trace.shape
    n_tok, n_layers, n_exp, k = len(trace.tokens), shape.num_layers, shape.num_experts, shape.top_k
    topics = np.asarray(model.topics, dtype=np.float64)  # (topics, layers, experts)
    topic_of = np.asarray(model.token_topic, dtype=np.int64)
    decode = np.array([t.phase == DECODE for t in trace.tokens])
    draws = model.prefill_draws()
    tables = OracleTables([], [])
    below_unseen: F64 | None = None
    for m in range(n_layers):
        mix: F64 = topics[topic_of, m, :]
        history = np.zeros((n_tok, n_exp))
        rest = np.ones(n_tok)
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for t in range(n_tok):
            if decode[t]:
                prev, recent = model.history(t, m)
                for pool, share in ((prev, cfg.p_prev), (recent, cfg.p_recent)):
                    if pool and share > 0.0:
                        for e in pool:
                            rows.append(t)
                            cols.append(e)
                            vals.append(share / len(pool))
                        rest[t] -= share
        np.add.at(history, _coords(rows, cols), vals)
        prefill = 1.0 - (1.0 - mix[~decode]) ** draws
        couplings: list[F64] = []
        if m > 0:
            assert below_unseen is not None
            partner = np.asarray(model.partner[m], dtype=np.int64)
            inverse = np.empty_like(partner)
            inverse[partner] = np.arange(n_exp)
            coupled = np.zeros((n_tok, n_exp))
            brows: list[int] = []
            bcols: list[int] = []
            bvals: list[float] = []
            for t in range(n_tok):
                if decode[t]:
                    below = trace.tokens[t].layers[m - 1]
                    for e in below:
                        brows.append(t)
                        bcols.append(int(partner[e]))
                        bvals.append(1.0 / len(below))
            np.add.at(coupled, _coords(brows, bcols), bvals)
            couplings = [below_unseen[:, inverse] / k, coupled]
            fresh = (rest * (1.0 - cfg.p_layer))[:, None] * mix
            link = (rest * cfg.p_layer)[:, None]
        else:
            fresh = rest[:, None] * mix
        results: list[F64] = []
        for coupling in couplings or [np.zeros((n_tok, n_exp))]:
            pi = history + fresh + (link * coupling if m > 0 else 0.0)
            incl = np.empty_like(pi)
            incl[decode] = _inclusion(pi[decode], k)
            incl[~decode] = prefill
            results.append(incl)
        below_unseen = results[0]
        tables.unseen.append(results[0].astype(np.float32))
        tables.revealed.append(results[-1].astype(np.float32))
    return tables


class OracleProbabilityPolicy(EvictionPolicy):
    """Evict the expert whose next use is expected furthest ahead under the generator's
    TRUE routing probabilities. An oracle for benchmarks, not for production.

    ``tables`` comes from ``oracle_tables(model)`` for the trace being replayed (pass
    it to share one computation across pool sizes). A victim costs one vectorised
    pass over the pool per step, then O(pool) per further victim in the same step.
    """

    name = "oracle-probability"

    def __init__(self, model: RoutingModel, tables: OracleTables | None = None) -> None:
        self._model = model
        self._tables = tables if tables is not None else oracle_tables(model)
        shape = model.trace.shape
        self._layers = shape.num_layers
        self._experts = shape.num_experts
        self._tokens = len(model.trace.tokens)
        self._p = np.zeros((self._layers, self._experts))
        self._next = np.zeros(self._layers)
        self._key = np.full(0, -1, dtype=np.int64)
        self._score: F64 | None = None
        self._resident: Sequence[int] = ()
        self._touched: Sequence[int] = ()

    def reset(self, pool: PoolView, slots: int) -> None:
        if (pool.num_layers, pool.num_experts) != (self._layers, self._experts):
            raise PlanError(
                f"oracle built for {self._layers} layers × {self._experts} experts was given "
                f"a pool of {pool.num_layers} × {pool.num_experts}"
            )
        self._key = np.full(slots, -1, dtype=np.int64)
        self._resident = pool.resident
        self._touched = pool.touched
        self._score = None
        # Before the first step every layer's next visit is token 0; coupling unseen.
        for m in range(self._layers):
            self._set_row(m, 0, revealed=False)

    def _set_row(self, layer: int, token: int, revealed: bool) -> None:
        if token >= self._tokens:
            self._p[layer] = 0.0  # never routed again within the trace
        else:
            table = self._tables.revealed if revealed else self._tables.unseen
            self._p[layer] = table[layer][token]
        self._next[layer] = token * self._layers + layer + 1

    def begin_step(self, step: int, layer: int) -> None:
        token, expected = divmod(step - 1, self._layers)
        if layer != expected or token >= self._tokens:
            raise PlanError(
                f"probability oracle replayed off its trace: step {step} is for layer "
                f"{layer}, but the trace's step {step} is token {token}, layer {expected}"
            )
        self._score = None
        # This layer's next visit is the next token, drawn after its layer below.
        self._set_row(layer, token + 1, revealed=False)
        if layer + 1 < self._layers:
            # The layer above is next visited at this token, below it now drawn.
            self._set_row(layer + 1, token, revealed=True)

    def on_step(self, step: int, slots: Sequence[int]) -> None:
        resident, key = self._resident, self._key
        for s in slots:
            key[s] = resident[s]

    def choose_victim(self, step: int) -> int:
        score = self._score
        if score is None:
            key = self._key
            live = key >= 0
            safe = np.where(live, key, 0)
            layer, expert = safe // self._experts, safe % self._experts
            p = self._p[layer, expert]
            with np.errstate(divide="ignore"):
                wait = np.where(p > 0.0, self._layers * (1.0 / p - 1.0), np.inf)
            score = np.where(live, self._next[layer] + wait, -np.inf)
            self._score = score
        touched = self._touched
        while True:
            slot = int(np.argmax(score))
            if score[slot] == -np.inf:
                raise PlanError("eviction asked for a victim but no occupied slot is evictable")
            score[slot] = -np.inf
            if touched[slot] != step:
                self._key[slot] = -1
                return slot

    def on_remove(self, slot: int) -> None:
        self._key[slot] = -1
        if self._score is not None:
            self._score[slot] = -np.inf
