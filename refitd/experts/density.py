"""``HitDensityPolicy``: evict the resident expert with the least expected hits per
slot-step. The expert cache's default policy.

It learns exactly what ``ExpectedReusePolicy`` learns and ranks differently; see the
class docstring.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import numpy.typing as npt

from refitd.errors import PlanError
from refitd.experts.policy import PoolView
from refitd.experts.reuse import ExpectedReusePolicy

__all__ = ["HitDensityPolicy"]

F64 = npt.NDArray[np.float64]


class HitDensityPolicy(ExpectedReusePolicy):
    """Evict the expert with the least hit density ``q / d``. Ours, the default.

    ``q`` is ``ExpectedReusePolicy``'s learned probability that the expert is routed
    at its layer's next visit: ``(1 - stickiness) * f + stickiness`` if its layer
    routed it at its latest visit, ``(1 - stickiness) * f`` otherwise, ``f`` the
    per-expert routing-frequency average (``alpha``, with the shift detector's
    ``shift_alpha`` re-learning; ``stickiness`` defaults to 0.2 here, which suits this
    rule better than 0.3); ``d`` is the number of steps until that visit. Decode
    visits the ``L`` MoE layers in order, so while layer ``l`` is placed, layer ``m``
    is next visited ``d = (m - l - 1) mod L + 1`` steps ahead: ``1`` for the layer
    above, ``L`` for layer ``l`` itself. ``q / d`` is the expected hits per slot-step
    the expert's slot earns until then (LHD's rule); an expert with ``q = 0`` goes
    first. Where ``ExpectedReusePolicy`` ranks by the expected step of the next use
    (``last visit + L / q``), this rule also weighs how soon that chance comes: an
    expert with ``q = 0.13`` whose layer runs next outranks one with ``q = 0.35``
    whose layer just ran (``0.13 / 1 > 0.35 / L``), where expected next use keeps the
    latter.

    ``d`` assumes that order: a cache driven in another order gets victims ranked by
    the layer distance decode would have, not by the real next visit (still within the
    invariants every policy keeps).

    Cost: a warm step is ``ExpectedReusePolicy``'s plus one array cell (the layer's
    least ``log q``). All experts of a layer share ``d``, so the victim is the layer
    minimising ``log q_min - log d`` (one numpy ``argmin`` over ``L`` values) and that
    layer's least-``q`` expert (its heap top, O(log slots)). The per-layer values are
    lower bounds (a hit leaves its old, lower heap entry in place); the chosen layer's
    is re-checked against its heap and the ``argmin`` repeated if it rose.
    """

    name = "hit-density"

    def __init__(
        self, alpha: float = 0.04, stickiness: float = 0.2, shift_alpha: float = 0.2
    ) -> None:
        super().__init__(alpha=alpha, stickiness=stickiness, shift_alpha=shift_alpha)
        self._low: F64 = np.zeros(0)
        #: ``-log d`` of the layer ``k + 1`` visits after the current one, ``k`` in
        #: ``range(L)``: any layer's row is this vector rotated (one ``L``-vector,
        #: where a table of every row took ``8 L**2`` bytes and an ``L``-step loop)
        self._neg_log_step: F64 = np.zeros(0)
        # ``low + -log d`` for the step in progress, kept between victim searches of
        # one step (a step's misses, then a prefetch) and dropped when ``low`` moves.
        self._score: F64 | None = None

    def reset(self, pool: PoolView, slots: int) -> None:
        super().reset(pool, slots)
        n = self._layers
        self._low = np.full(n, math.inf)
        self._neg_log_step = -np.log(np.arange(1, n + 1, dtype=np.float64))
        self._score = None

    def begin_step(self, step: int, layer: int) -> None:
        super().begin_step(step, layer)
        self._score = None

    def distance(self, layer: int) -> int:
        """Steps from the current step to ``layer``'s next visit, in decode order."""
        return (layer - self._current - 1) % self._layers + 1

    def density(self, layer: int, expert: int) -> float:
        """Expected hits per slot-step of ``(layer, expert)`` as the policy ranks it
        now: ``q / d`` (the least is evicted first)."""
        key = layer * self._experts + expert
        q = (1.0 - self.stickiness) * self.q(layer, expert)
        if self._fvisit[key] == self._visits[layer] and self._f[key] > 0.0:
            q += self.stickiness
        return q / self.distance(layer)

    def _push_layer(self, layer: int) -> float:
        """Record a lower bound of the layer's least ``log q``: its heap's top, which is
        at or below every resident expert's key. It stays a lower bound until the
        layer's next visit lowers every ``q`` (its decay), and that visit records
        it again. Drops the step's cached scores; every ``on_step`` ends here (the
        victim search below leaves no announced bound), so it needs no override."""
        self._score = None
        heap = self._heaps[layer]
        resident, entry_key = self._resident, self._entry_key
        while heap and not resident[heap[0][1]] == heap[0][2] == entry_key[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            self._low[layer] = math.inf
            return math.inf
        self._low[layer] = heap[0][0] + self._decay[layer]
        return heap[0][0]

    def choose_victim(self, step: int) -> int:
        if not self._settled:
            self._settle(announce=True)
        # The stepping layer's value leaves out what this step routes, so its
        # ``on_step`` must record the layer afresh.
        self._bound_key = -math.inf
        low, decay = self._low, self._decay
        score = self._score
        if score is None:
            # -log d of every layer m while layer c is placed: d = (m - c - 1) % L + 1.
            score = self._score = low + np.roll(self._neg_log_step, self._current + 1)
        heaps = self._heaps
        # Each layer's least entry, taken off its heap when the layer's loose bound was
        # tightened. Nothing a search reads changes until it returns, so a layer that
        # leads again needs no second heap search; the rest go back on return.
        held: dict[int, tuple[float, int, int, int]] = {}
        found: tuple[float, int, int, int] | None
        while True:
            layer = int(score.argmin())
            if layer in held:
                found = held.pop(layer)
                break
            if score[layer] == math.inf:
                found = None
                break
            found = self._layer_min(layer, step, take=True)
            if found is None and heaps[layer]:
                # Only slots this step touched are left in the layer. They become
                # candidates once the step is over (a prefetch may ask for victims
                # between steps), so the layer keeps a bound, the least of them, and is
                # passed over for this search only.
                low[layer] = heaps[layer][0][0] + decay[layer]
                score[layer] = math.inf
                continue
            exact = found[0] + decay[layer] if found is not None else math.inf
            if exact > low[layer]:
                # The bound was loose: tighten it and look again.
                if found is not None:
                    held[layer] = found
                low[layer] = exact
                base = self._neg_log_step
                score[layer] = exact + base[(layer - self._current - 1) % len(base)]
                continue
            break
        for m, entry in held.items():
            heapq.heappush(heaps[m], entry)
        if found is None:
            raise PlanError("eviction asked for a victim but no occupied slot is evictable")
        slot = found[1]
        self._entry_key[slot] = -1
        # Removing the layer's least expert leaves ``low`` a lower bound.
        return slot
