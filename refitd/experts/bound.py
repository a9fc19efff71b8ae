"""Model-knowing oracles that bound what an online eviction policy can reach.

Benchmark and test use only — not for production: like ``refitd.experts.oracle``,
everything here reads the synthetic generator's hidden state
(``refitd.experts.traces.RoutingModel``: its topics, the topic in effect at every
token, the layer-coupling permutations), which no real model offers. The question it
answers for issue 3: how much of the LRU→Belady hit-rate gap can a policy close that
knows the generator *perfectly* and still does not know the draws?

Two kinds of oracle:

- ``SampledFuturePolicy`` — at a step that needs a victim, ``S`` futures of the next
  ``H`` tokens (``H·L`` steps) are drawn from the true generator, conditioned on every
  route revealed so far (the step being placed included: the cache knows what it is
  placing), on the stickiness history and on the layer coupling; each future gives
  every resident expert a next-use offset (``H·L + 1`` when beyond the horizon).
  Decision rules over those offsets (``RULES``):

  - ``vote``: each future's Belady victim gets a vote (split among ties); the most
    voted leaves;
  - ``beyond``: the largest share of futures with no use within ``within`` tokens
    (default: the whole horizon);
  - ``mean``: the largest mean (horizon-truncated) next-use offset.

  Ties go to the larger mean offset, then to the least exact hit density (below:
  mostly experts no future uses), then to the lowest slot.

  It knows *more* than an online policy with a perfect model: the topic in effect at
  every future token is the true one (topic switches are known in advance), which
  only makes it stronger. The futures are drawn by ``SampledFutures``, a vectorised
  re-implementation of the generator's decode loop (``traces._generate``): a pick is
  sticky with ``p_prev`` (uniform over last token's experts not yet chosen), else
  coupled with ``p_layer`` (the partner of a uniform expert of the layer below),
  else a fresh draw from the topic mixture, re-drawn until ``top_k`` are distinct. A
  prefill chunk's layer includes each expert independently with its exact marginal
  ``1 - (1 - pi_e) ** draws`` (the draws' slight negative correlation is dropped).
  ``p_recent > 0`` is refused (no preset uses it).

- ``ExactHitDensityPolicy`` — LHD-like, with the probabilities of the probability oracle
  (``oracle_tables``: exact inputs, successive-sampling inclusion): evict the least
  expected hits per slot-step, ``p / d`` with ``p`` the probability of a use at the
  layer's next visit and ``d`` the steps until it;
  ``visits > 1`` adds ``p_v / d_v`` for the following visits, where ``p_v`` (not
  knowable exactly without leaking the routes in between) is the fresh-draw
  inclusion ``1 - (1 - pi_e) ** top_k`` under that token's true topic.

Invariants kept as every policy does: a slot touched in the current step is never
returned (the cache checks); decisions are a pure function of the model, the steps
so far and the seed — every random number of a future is a hash of ``(trace seed,
step, sample, offset, attempt)`` (splitmix64), so it depends on nothing the
replay has not revealed, and on neither the pool size nor the other policies. The
replay must follow ``trace.steps()`` from a fresh cache, as for the other oracles.

Cost: the futures of ``chunk`` consecutive steps are drawn together and kept while
the replay is inside that chunk, so replay every cache of one trace in lockstep
(``compare``) to draw each chunk once. ``refitd bench experts --bound`` prints the
comparison.

None of this is a proof that no online policy does better: the sampled rules are
heuristics over a perfect model (per-future Belady votes are known to be
over-optimistic), not the optimal policy of that model, which is out of reach. What
they measured (seed 0, 2 requests of 128 decode tokens, 64 futures of 2 tokens) is
that knowing the whole generator adds nothing over knowing the next visit's
probability: every sampled rule lands at or below ``p / d``, which itself closes
about 0.46 of the gap on average (0.47 on the bench's full traces), short of 0.5
because the 1× pools stay below 0.2 for Qwen3 and DeepSeek-V3 under every rule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from refitd.errors import ConfigError, PlanError
from refitd.experts.oracle import OracleProbabilityPolicy, OracleTables, oracle_tables
from refitd.experts.policy import (
    BeladyPolicy,
    EvictionPolicy,
    LruPolicy,
    PoolView,
)
from refitd.experts.reuse import ExpectedReusePolicy
from refitd.experts.traces import DECODE, RoutingModel

__all__ = [
    "RULES",
    "ExactHitDensityPolicy",
    "SampledFuturePolicy",
    "SampledFutures",
    "compare",
]

RULES = ("vote", "beyond", "mean")

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_S32, _S11 = np.uint64(32), np.uint64(11)
_LOW32 = np.uint64(0xFFFFFFFF)


def _mix(x: U64) -> U64:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    out: U64 = x ^ (x >> _S31)
    return out


def _salt(h: U64, n: int) -> U64:
    return _mix(h ^ np.uint64((n * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF))


class SampledFutures:
    """Futures of the generator from every step of a trace: first use of each key.

    ``first_use(step)`` is an ``(samples, layers * experts)`` int16 array: per sampled
    future from just after ``step`` (1-based, as the cache numbers steps), the offset
    in steps (``1..horizon``) of each key's first route, ``horizon + 1`` if none.
    ``seconds`` accumulates the time spent drawing.
    """

    def __init__(
        self,
        model: RoutingModel,
        samples: int = 16,
        horizon_tokens: int = 4,
        chunk: int = 128,
    ) -> None:
        cfg = model.config
        if cfg.p_recent > 0.0:
            raise ConfigError("SampledFutures does not model p_recent > 0 (no preset uses it)")
        if samples < 1 or horizon_tokens < 1 or chunk < 1:
            raise ConfigError("samples, horizon_tokens and chunk must be positive")
        shape = model.trace.shape
        self.model = model
        self.samples = samples
        self.layers, self.experts, self.top_k = shape.num_layers, shape.num_experts, shape.top_k
        self.horizon = horizon_tokens * self.layers
        self.beyond = self.horizon + 1
        if self.beyond >= 2**15:
            raise ConfigError("horizon too long for int16 offsets")
        self.chunk = chunk
        self.seconds = 0.0
        tokens = model.trace.tokens
        self._n_tok = len(tokens)
        self._decode = np.array([t.phase == DECODE for t in tokens] + [False])
        self._start = np.array([*model.request_start, False])
        L, E, k = self.layers, self.experts, self.top_k
        routes = np.full((self._n_tok, L, k), -1, dtype=np.int64)
        for t, tok in enumerate(tokens):
            if tok.phase == DECODE:
                for m, ex in enumerate(tok.layers):
                    routes[t, m, : len(ex)] = ex[:k]
        self._routes = routes
        topics = np.asarray(model.topics, dtype=np.float64)  # (topics, L, E)
        self._topic_of = np.asarray([*model.token_topic, 0], dtype=np.int64)
        cum = np.cumsum(topics.reshape(-1, E), axis=1)
        self._last = cum[:, -1].copy()
        self._flat = (cum + np.arange(cum.shape[0])[:, None]).ravel()
        draws = model.prefill_draws()
        self._prefill_p = 1.0 - (1.0 - topics.reshape(-1, E)) ** draws
        self._partner = np.asarray(model.partner, dtype=np.int64).ravel()
        self._p_prev, self._p_layer = cfg.p_prev, cfg.p_layer
        self._seed = _mix(np.array([cfg.seed & (2**64 - 1)], dtype=np.uint64))[0]
        self._chunk_index = -1
        self._first = np.zeros((0, samples, L * E), dtype=np.int16)

    @property
    def total_steps(self) -> int:
        return self._n_tok * self.layers

    def first_use(self, step: int) -> npt.NDArray[np.int16]:
        if not 1 <= step <= self.total_steps:
            raise PlanError(f"step {step} is outside the trace's 1..{self.total_steps}")
        c = (step - 1) // self.chunk
        if c != self._chunk_index:
            t0 = time.perf_counter()
            self._first = self._draw(
                c * self.chunk + 1, min((c + 1) * self.chunk, self.total_steps)
            )
            self._chunk_index = c
            self.seconds += time.perf_counter() - t0
        out: npt.NDArray[np.int16] = self._first[step - 1 - c * self.chunk]
        return out

    def _fresh(self, row: I64, u: F64) -> I64:
        """Fresh draws: expert per cumulative row ``row`` (topic * L + layer) for ``u``."""
        E = self.experts
        idx = np.searchsorted(self._flat, row + u * self._last[row], side="right")
        out: I64 = np.clip(idx - row * E, 0, E - 1)
        return out

    def _draw(self, lo: int, hi: int) -> npt.NDArray[np.int16]:
        L, E, k, S = self.layers, self.experts, self.top_k, self.samples
        n_steps = hi - lo + 1
        B = n_steps * S
        step_of = np.repeat(np.arange(lo, hi + 1, dtype=np.int64), S)
        sample_of = np.tile(np.arange(S, dtype=np.int64), n_steps)
        t0, l0 = np.divmod(step_of - 1, L)
        base = _mix(
            self._seed
            ^ _mix(step_of.astype(np.uint64) * np.uint64(1 << 20) + sample_of.astype(np.uint64))
        )
        first = np.full((n_steps, S, L * E), self.beyond, dtype=np.int16)
        row_step = step_of - lo
        # The latest routes of each layer (prev) and of the layer below (below).
        routes = self._routes
        hist = np.where(
            (np.arange(L)[None, :] <= l0[:, None])[:, :, None],
            routes[t0],
            routes[np.maximum(t0 - 1, 0)] * (t0 > 0)[:, None, None] - (t0 == 0)[:, None, None],
        )
        below = routes[t0, l0].copy()
        n_tok = self._n_tok
        p_prev, p_layer = self._p_prev, self._p_layer
        rows_all = np.arange(B, dtype=np.int64)
        for j in range(1, self.horizon + 1):
            ahead, m = np.divmod(l0 + j, L)
            t = t0 + ahead
            valid = t < n_tok
            tc = np.minimum(t, n_tok)
            dec = valid & self._decode[tc]
            pre = valid & ~self._decode[tc]
            hj = _salt(base, j)
            cumrow = self._topic_of[tc] * L + m
            if pre.any():
                r = rows_all[pre]
                u = (
                    _mix(hj[r][:, None] ^ (np.arange(E, dtype=np.uint64) * _GOLD)[None, :]) >> _S11
                ).astype(np.float64) * 2.0**-53
                inc = u < self._prefill_p[cumrow[r]]
                rr, ee = np.nonzero(inc)
                rows = r[rr]
                keys = m[rows] * E + ee
                cur = first[row_step[rows], sample_of[rows], keys]
                first[row_step[rows], sample_of[rows], keys] = np.minimum(cur, j)
                below[r] = -1
                hist[r, m[r]] = -1
            if not dec.any():
                continue
            r = rows_all[dec]
            n = r.size
            mr = m[r]
            prev = hist[r, mr]
            prev[self._start[tc[r]]] = -1
            bel = below[r]
            bel[mr == 0] = -1
            nb = (bel >= 0).sum(axis=1)
            pvalid = prev >= 0
            prevc = np.where(pvalid, prev, 0)
            belc = np.maximum(bel, 0)
            crow = cumrow[r]
            chosen = np.full((n, k), -1, dtype=np.int64)
            count = np.zeros(n, dtype=np.int64)
            mask = np.zeros((n, E), dtype=bool)
            act = np.arange(n, dtype=np.int64)
            hr = hj[r]
            attempt = 0
            while act.size:
                ha = _salt(hr[act], 2 * attempt + 1)
                hb = _salt(hr[act], 2 * attempt + 2)
                attempt += 1
                u1 = (ha >> _S32).astype(np.float64) * 2.0**-32
                u2 = (ha & _LOW32).astype(np.float64) * 2.0**-32
                u4 = (hb >> _S11).astype(np.float64) * 2.0**-53
                pa = prevc[act]
                avail = pvalid[act] & ~mask[act[:, None], pa]
                nav = avail.sum(axis=1)
                sticky = (u1 < p_prev) & (nav > 0)
                pick = np.floor(u2 * nav)
                at = np.argmax(np.cumsum(avail, axis=1) > pick[:, None], axis=1)
                e = pa[np.arange(act.size), at]
                # Below p_prev with no sticky expert left, the generator draws afresh.
                w = np.where(
                    u1 < p_prev, u1 / max(p_prev, 1e-300), (u1 - p_prev) / max(1 - p_prev, 1e-300)
                )
                nba = nb[act]
                couple = ~sticky & (nba > 0) & (w < p_layer)
                bi = np.minimum(np.floor(u2 * nba).astype(np.int64), np.maximum(nba - 1, 0))
                e_cp = self._partner[mr[act] * E + belc[act, bi]]
                e_fr = self._fresh(crow[act], u4)
                e = np.where(sticky, e, np.where(couple, e_cp, e_fr))
                new = ~mask[act, e]
                a_new, e_new = act[new], e[new]
                chosen[a_new, count[a_new]] = e_new
                mask[a_new, e_new] = True
                count[a_new] += 1
                act = act[count[act] < k]
            hist[r, mr] = chosen
            below[r] = chosen
            rows = np.repeat(r, k)
            keys = np.repeat(mr * E, k) + chosen.ravel()
            cur = first[row_step[rows], sample_of[rows], keys]
            first[row_step[rows], sample_of[rows], keys] = np.minimum(cur, j)
        return first


class SampledFuturePolicy(EvictionPolicy):
    """Evict by ``rule`` (one of ``RULES``) over futures sampled from the true
    generator. An oracle for benchmarks, not for production (module docstring)."""

    def __init__(
        self,
        futures: SampledFutures,
        rule: str = "vote",
        within: float | None = None,
        tables: OracleTables | None = None,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.futures = futures
        self.rule = rule
        # ``beyond`` counts futures with no use within this many tokens (default: all).
        self.within = futures.horizon if within is None else round(within * futures.layers)
        if not 1 <= self.within <= futures.horizon:
            raise ValueError(f"within must lie in (0, {futures.horizon // futures.layers}] tokens")
        self.name = f"sampled-{rule}" + (f"@{within:g}" if within is not None else "")
        # Ties (experts no sampled future uses, mostly) go by the exact hit density.
        self._density = ExactHitDensityPolicy(futures.model, tables)
        self._experts = futures.experts
        self._layers = futures.layers
        self._key = np.full(0, -1, dtype=np.int64)
        self._touched: Sequence[int] = ()
        self._resident: Sequence[int] = ()
        self._step = -1
        self._nu: npt.NDArray[np.int16] | None = None

    def reset(self, pool: PoolView, slots: int) -> None:
        if (pool.num_layers, pool.num_experts) != (self._layers, self._experts):
            raise PlanError("sampled-future oracle given a pool of another model's shape")
        self._key = np.full(slots, -1, dtype=np.int64)
        self._touched = pool.touched
        self._resident = pool.resident
        self._nu = None
        self._density.reset(pool, slots)

    def begin_step(self, step: int, layer: int) -> None:
        self._step = step
        self._nu = None
        self._density.begin_step(step, layer)
        if (step - 1) % self._layers != layer:
            raise PlanError(
                f"sampled-future oracle replayed off its trace: step {step} is for layer {layer}"
            )

    def on_step(self, step: int, slots: Sequence[int]) -> None:
        resident, key = self._resident, self._key
        for s in slots:
            key[s] = resident[s]
        self._density.on_step(step, slots)

    def on_remove(self, slot: int) -> None:
        self._key[slot] = -1
        self._density.on_remove(slot)

    def choose_victim(self, step: int) -> int:
        if step != self._step:
            raise PlanError("victim asked for outside the step that began")
        if self._nu is None:
            self._nu = self.futures.first_use(step)
        touched = np.fromiter(self._touched, dtype=np.int64, count=len(self._key))
        cand = np.nonzero((self._key >= 0) & (touched != step))[0]
        if cand.size == 0:
            raise PlanError("eviction asked for a victim but no occupied slot is evictable")
        keys = self._key[cand]
        nu = self._nu[:, keys].astype(np.float64)  # (samples, candidates)
        mean = nu.mean(axis=0)
        if self.rule == "mean":
            primary = mean
        elif self.rule == "beyond":
            primary = (nu > self.within).mean(axis=0)
        else:
            top = nu == nu.max(axis=1, keepdims=True)
            primary = (top / top.sum(axis=1, keepdims=True)).sum(axis=0)
        # Lexicographic: primary, then mean offset, then the least exact hit density,
        # then the lowest slot (stable).
        best = np.flatnonzero(primary >= primary.max() - 1e-9)
        best = best[mean[best] >= mean[best].max() - 1e-9]
        if best.size > 1:
            sparse = -self._density.density(keys[best], step)
            best = best[sparse >= sparse.max()]
        slot = int(cand[best[0]])
        self._key[slot] = -1
        self._density.on_remove(slot)
        return slot


class ExactHitDensityPolicy(OracleProbabilityPolicy):
    """Evict the least expected hits per slot-step under the true probabilities
    (module docstring). ``visits`` counts the layer visits summed over."""

    def __init__(
        self, model: RoutingModel, tables: OracleTables | None = None, visits: int = 1
    ) -> None:
        super().__init__(model, tables)
        if visits < 1:
            raise ValueError(f"visits must be at least 1, got {visits}")
        self.visits = visits
        self.name = f"hit-density-{visits}"
        self._fresh_p: F64 | None = None
        if visits > 1:
            shape = model.trace.shape
            topics = np.asarray(model.topics, dtype=np.float64)
            topic_of = np.asarray(model.token_topic, dtype=np.int64)
            decode = np.array([t.phase == DECODE for t in model.trace.tokens])
            draws = np.where(decode, shape.top_k, model.prefill_draws())[:, None, None]
            self._fresh_p = 1.0 - (1.0 - topics[topic_of]) ** draws  # (tokens, L, E)

    def density(self, keys: I64, step: int) -> F64:
        """Expected hits per slot-step of global ``keys`` (≥ 0), as ranked in ``step``."""
        layer, expert = keys // self._experts, keys % self._experts
        nxt = self._next[layer]
        d = nxt - step
        dens: F64 = self._p[layer, expert] / d
        if self._fresh_p is not None:
            token = (nxt.astype(np.int64) - 1) // self._layers
            for v in range(1, self.visits):
                tv = token + v
                ok = tv < self._tokens
                pv = self._fresh_p[np.minimum(tv, self._tokens - 1), layer, expert]
                dens = dens + np.where(ok, pv, 0.0) / (d + v * self._layers)
        return dens

    def choose_victim(self, step: int) -> int:
        if self._score is None:
            live = self._key >= 0
            dens = self.density(np.where(live, self._key, 0), step)
            self._score = np.where(live, -dens, -np.inf)
        return super().choose_victim(step)


def compare(
    model: RoutingModel,
    sizes: Sequence[int],
    *,
    samples: int = 16,
    horizon_tokens: int = 4,
    rules: Sequence[tuple[str, float | None]] = (("vote", None), ("mean", None), ("beyond", None)),
    density_visits: Sequence[int] = (1, 4),
) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """Replay ``model.trace`` through one cache per (size, policy), all in lockstep.

    Returns hit rates ``{size: {policy name: hit rate}}`` and seconds per policy name
    (replay time, summed over sizes; ``"sampler"`` is the drawing of the futures,
    shared by every sampled policy).
    """
    from refitd.experts.cache import ExpertCache
    from refitd.experts.density import HitDensityPolicy

    trace = model.trace
    shape = trace.shape
    steps = trace.steps()
    tables = oracle_tables(model)
    futures = SampledFutures(model, samples, horizon_tokens)
    caches: list[tuple[int, str, ExpertCache]] = []
    for size in sizes:
        policies: list[EvictionPolicy] = [
            LruPolicy(),
            BeladyPolicy(steps, shape.num_experts),
            HitDensityPolicy(),
            ExpectedReusePolicy(),
            OracleProbabilityPolicy(model, tables),
        ]
        policies += [ExactHitDensityPolicy(model, tables, v) for v in density_visits]
        policies += [SampledFuturePolicy(futures, r, w, tables) for r, w in rules]
        for p in policies:
            caches.append(
                (size, p.name, ExpertCache(shape.num_layers, shape.num_experts, size, policy=p))
            )
    seconds: dict[str, float] = {}
    for layer, routed in steps:
        for _, name, cache in caches:
            drawn = futures.seconds
            t0 = time.perf_counter()
            cache.ensure(layer, routed)
            spent = time.perf_counter() - t0 - (futures.seconds - drawn)
            seconds[name] = seconds.get(name, 0.0) + spent
    seconds["sampler"] = futures.seconds
    hits: dict[int, dict[str, float]] = {}
    for size, name, cache in caches:
        hits.setdefault(size, {})[name] = cache.stats().hit_rate
    return hits, seconds


def gap_closed(hit: float, lru: float, belady: float) -> float:
    """(hit − LRU) / (Belady − LRU); NaN where the gap is under half a point."""
    span = belady - lru
    return (hit - lru) / span if span > 0.005 else math.nan
