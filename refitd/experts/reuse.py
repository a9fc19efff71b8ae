"""``ExpectedReusePolicy``: evict the expert whose next use is expected furthest ahead.

It learns, per expert, how often its layer routes it (a slow frequency average with a
routing-shift detector) and how sticky consecutive tokens are; the cache's default,
``refitd.experts.density.HitDensityPolicy``, learns the same and ranks differently.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from refitd.errors import PlanError
from refitd.experts.policy import EvictionPolicy, PoolView

__all__ = ["ExpectedReusePolicy"]


class ExpectedReusePolicy(EvictionPolicy):
    """Evict the expert whose next use is expected furthest ahead.

    The cache's default, ``HitDensityPolicy``, keeps this learning and ranks by hit
    density instead; this ranking stays available.

    Decode visits the MoE layers round-robin, so an expert of layer ``m`` can next be
    used at that layer's next visit, ``L`` steps after its last one; an expert that
    its layer routes with probability ``q`` per visit is expected back after
    ``L * (1/q - 1)`` further steps (a geometric wait). The policy evicts the expert
    maximising

        last visit of its layer + L / q

    which is Belady's rule with the unknown future replaced by that expectation.
    ``q`` has two parts, both learned from the routing the cache sees:

    - a routing frequency ``f``: an exponential moving average, per expert, of
      "routed at this visit of my layer" with weight ``alpha`` (kept for evicted
      experts too, so a popular expert that returns is valued at once). When the
      routing shifts — the share of routed experts the averages call rare
      (``f < 0.05``) jumps, over about a token, above 1.5x its long-run level plus
      0.03 — every layer averages with ``shift_alpha`` for the next 10 tokens, so
      the new content's experts are learned in a few tokens instead of tens;
    - stickiness: an expert routed at its layer's latest visit is likelier than its
      frequency says to be routed at the next one (consecutive tokens share experts),
      so ``q = (1 - stickiness) * f + stickiness`` for those and
      ``(1 - stickiness) * f`` for the rest.

    Frequency alone confuses "popular" with "just used" (a fast average) or forgets
    stickiness (a slow one); splitting them is what lets a slow, accurate average
    keep a layer's steady experts while a one-off expert, fetched for a miss, is the
    first to leave again.

    Cost: a warm step updates three list cells per routed expert, re-files the
    experts its layer routed last visit and did not route now (at most top-k heap
    pushes), and pushes one layer entry; a victim is O(log slots). ``f`` is stored
    with its layer's accumulated decay (the sum of ``log(1 - alpha)`` over the
    layer's visits) at its last update and decayed on read, so visits that skip an
    expert cost nothing. Each layer keeps a min-heap of its resident experts by
    ``q``; an entry whose expert was routed since is a lower bound and is refreshed
    when it reaches the top. A heap over layers holds upper bounds of each layer's furthest
    expected use, refreshed the same way when popped.
    """

    name = "expected-reuse"

    RARE = 0.05  # f below which a routed expert counts as a surprise
    SHIFT_TOKENS = 10  # tokens of fast averaging after a detected shift

    def __init__(
        self, alpha: float = 0.04, stickiness: float = 0.3, shift_alpha: float = 0.2
    ) -> None:
        for label, a in (("alpha", alpha), ("shift_alpha", shift_alpha)):
            if not 0.0 < a < 1.0:
                raise ValueError(f"{label} must be in (0, 1), got {a}")
        if shift_alpha < alpha:
            raise ValueError(
                f"shift_alpha {shift_alpha} is below alpha {alpha}: a shift would slow learning"
            )
        if not 0.0 <= stickiness < 1.0:
            raise ValueError(f"stickiness must be in [0, 1), got {stickiness}")
        self.alpha = alpha
        self.stickiness = stickiness
        self.shift_alpha = shift_alpha
        self._log_keep = math.log1p(-stickiness)
        # A visit's decay step, ``log(1 - alpha)``, for each averaging speed.
        self._log_stay = math.log1p(-alpha)
        self._log_stay_shift = math.log1p(-shift_alpha)
        self._layers = 0
        self._experts = 1
        self._f: list[float] = []
        self._fdecay: list[float] = []
        self._fvisit: list[int] = []
        self._visits: list[int] = []
        self._decay: list[float] = []
        self._step_alpha = alpha
        # Shift detector: fast and slow averages of the surprise share per step.
        self._fast = self._slow = 0.0
        self._seen = 0
        self._shift_left = 0
        self._unplaced = self._unplaced_surprised = 0
        self._last_visit: list[int] = []
        self._prev: list[list[tuple[int, int]]] = []
        # Entries: (heap key, slot, key, stamp); see ``_stamp``.
        self._heaps: list[list[tuple[float, int, int, int]]] = []
        self._entry_key: list[int] = []
        self._top: list[tuple[float, int]] = []
        self._current = 0
        self._settled = True
        self._bound_key = -math.inf
        self._step = 0
        self._resident: Sequence[int] = ()
        self._touched: Sequence[int] = ()

    def reset(self, pool: PoolView, slots: int) -> None:
        self._layers = pool.num_layers
        self._experts = pool.num_experts
        keys = self._layers * self._experts
        if len(self._f) != keys:
            # Estimates outlive a rebuild: they describe routing, not slots.
            self._f = [0.0] * keys
            self._fdecay = [0.0] * keys
            self._fvisit = [0] * keys
            self._visits = [0] * self._layers
            self._decay = [0.0] * self._layers
            self._fast = self._slow = 0.0
            self._seen = self._shift_left = 0
        self._last_visit = [0] * self._layers
        self._prev = [[] for _ in range(self._layers)]
        self._heaps = [[] for _ in range(self._layers)]
        self._entry_key = [-1] * slots
        self._top = []
        self._settled = True
        self._resident = pool.resident
        self._touched = pool.touched

    def q(self, layer: int, expert: int) -> float:
        """Current routing-frequency estimate ``f`` of ``(layer, expert)`` per visit
        of its layer, in [0, 1] (stickiness not included)."""
        key = layer * self._experts + expert
        return self._f[key] * math.exp(self._decay[layer] - self._fdecay[key])

    @property
    def shifting(self) -> bool:
        """Whether a routing shift was detected within the last ``SHIFT_TOKENS``."""
        return self._shift_left > 0

    def expected_next_use(self, layer: int, expert: int) -> float:
        """The step at which ``(layer, expert)`` is expected to be routed next: the
        value the policy evicts the largest of (``inf`` for an expert never seen)."""
        key = layer * self._experts + expert
        q = (1.0 - self.stickiness) * self.q(layer, expert)
        if self._fvisit[key] == self._visits[layer] and self._f[key] > 0.0:
            q += self.stickiness
        return self._last_visit[layer] + self._layers / q if q > 0.0 else math.inf

    # -- the ordering -----------------------------------------------------------

    def _stamp(self, key: int, layer: int) -> int:
        """Identifies the state an entry was keyed in: the visit that last routed
        ``key`` and whether that is still its layer's latest visit (sticky)."""
        fv = self._fvisit[key]
        return 2 * fv + (fv == self._visits[layer])

    def _heap_key(self, key: int, layer: int) -> float:
        """``log q`` minus the layer's accumulated decay: constant while visits skip
        the expert, so entries of one layer compare without decaying them all. A
        sticky entry is exact only during the visit that routed it, and is re-filed
        after."""
        f = self._f[key]
        if self._fvisit[key] == self._visits[layer]:
            base = math.log((1.0 - self.stickiness) * f + self.stickiness)
        else:
            base = (math.log(f) if f > 0.0 else -1e300) + self._log_keep
        return base - self._fdecay[key]

    def begin_step(self, step: int, layer: int) -> None:
        if self._shift_left > 0:
            self._step_alpha = self.shift_alpha
            self._decay[layer] += self._log_stay_shift
        else:
            self._step_alpha = self.alpha
            self._decay[layer] += self._log_stay
        self._visits[layer] += 1
        self._last_visit[layer] = step
        self._current = layer
        self._step = step
        self._settled = False

    def _settle(self, announce: bool) -> None:
        """Re-file last visit's experts that this step did not route (no longer
        sticky), and announce the layer if a victim is about to be chosen."""
        self._settled = True
        self._bound_key = -math.inf  # nothing announced for this visit yet
        layer = self._current
        resident, touched, entry_key = self._resident, self._touched, self._entry_key
        step = self._step
        fs, fdecay, fvisit = self._f, self._fdecay, self._fvisit
        heap, keep = self._heaps[layer], self._log_keep
        for s, key in self._prev[layer]:
            # Most of last visit's experts are routed again (sticky): test that first.
            if touched[s] != step and resident[s] == key and entry_key[s] == key:
                # Not routed since the last visit, so ``f`` is positive and unchanged.
                entry = (math.log(fs[key]) + keep - fdecay[key], s, key, 2 * fvisit[key])
                heapq.heappush(heap, entry)
        if announce:
            self._bound_key = self._push_layer(layer)

    def on_unplaced(self, step: int, keys: Sequence[int]) -> None:
        # The frequency and stickiness of an expert computed on the CPU move exactly as
        # for a placed one; it has no slot, so no heap entry (a later fill makes one).
        layer = self._current
        v, d = self._visits[layer], self._decay[layer]
        fs, fdecay, fvisit = self._f, self._fdecay, self._fvisit
        alpha = self._step_alpha
        surprised = 0
        for key in keys:
            f = fs[key] * math.exp(d - fdecay[key])
            if f < self.RARE:
                surprised += 1
            fs[key] = min(1.0, f + alpha)
            fdecay[key] = d
            fvisit[key] = v
        self._unplaced = len(keys)
        self._unplaced_surprised = surprised

    def on_step(self, step: int, slots: Sequence[int]) -> None:
        if not self._settled:
            self._settle(announce=False)
        unplaced = self._unplaced  # hybrid mode's CPU-computed routes, this step
        unplaced_surprised = 0
        if unplaced:
            unplaced_surprised = self._unplaced_surprised
            self._unplaced = 0
        if not len(slots):
            if unplaced:
                self._watch(unplaced_surprised / unplaced)
            # The visit moved the layer's experts a round further out even though it
            # placed nothing: announce the layer afresh.
            self._push_layer(self._current)
            return
        resident = self._resident
        layer = resident[slots[0]] // self._experts
        v = self._visits[layer]
        d = self._decay[layer]
        fs, fdecay, fvisit = self._f, self._fdecay, self._fvisit
        alpha, rare, exp = self._step_alpha, self.RARE, math.exp
        entry_key = self._entry_key
        routed: list[tuple[int, int]] = []
        heap = self._heaps[layer]
        stick = self.stickiness
        filled = False
        lowest = math.inf
        surprised = 0
        for s in slots:
            key = resident[s]
            routed.append((s, key))
            f = fs[key] * exp(d - fdecay[key])
            if f < rare:
                surprised += 1
            f += alpha
            if f > 1.0:
                f = 1.0
            fs[key] = f
            fdecay[key] = d
            fvisit[key] = v
            if entry_key[s] != key:
                # A fill needs an entry (sticky: routed at the latest visit); a hit's
                # old entry is a valid lower bound, since routing again only raises q.
                entry_key[s] = key
                filled = True
                hkey = math.log((1.0 - stick) * f + stick) - d
                if hkey < lowest:
                    lowest = hkey
                heapq.heappush(heap, (hkey, s, key, 2 * v + 1))
        self._prev[layer] = routed
        if filled and len(heap) > 4 * self._experts + 64:
            self._compact(layer)
        # The visit moved this layer's experts a round further out: announce it,
        # unless a victim search already did and no fill fell below that bound.
        if self._bound_key == -math.inf or lowest < self._bound_key:
            self._push_layer(layer)
        self._watch((surprised + unplaced_surprised) / (len(slots) + unplaced))

    def _watch(self, surprise: float) -> None:
        """Feed one step's surprise share to the shift detector.

        The fast average spans about a token (``1/L`` per step), the slow one about
        20 tokens; a shift is declared when the fast one exceeds 1.5x the slow one
        plus 0.03, at most once per ``SHIFT_TOKENS`` (and not in the first 4 tokens,
        while both averages are still filling).
        """
        n = self._layers
        self._fast += (surprise - self._fast) / n
        self._slow += (surprise - self._slow) / (20 * n)
        self._seen += 1
        if self._shift_left > 0:
            self._shift_left -= 1
        elif self._seen > 4 * n and self._fast > 1.5 * self._slow + 0.03:
            self._shift_left = self.SHIFT_TOKENS * n

    def _compact(self, layer: int) -> None:
        resident, entry_key = self._resident, self._entry_key
        live = {s for _, s, k, _ in self._heaps[layer] if resident[s] == k == entry_key[s]}
        heap = [
            (self._heap_key(resident[s], layer), s, resident[s], self._stamp(resident[s], layer))
            for s in live
        ]
        heapq.heapify(heap)
        self._heaps[layer] = heap

    def _layer_min(
        self, layer: int, step: int, take: bool = False
    ) -> tuple[float, int, int, int] | None:
        """The live, current, not-touched-this-step entry with the least ``q``;
        removed from the heap when ``take``."""
        heap = self._heaps[layer]
        resident, touched, fvisit = self._resident, self._touched, self._fvisit
        fs, fdecay, log = self._f, self._fdecay, math.log
        stick, keep = self.stickiness, self._log_keep
        entry_key = self._entry_key
        visits = self._visits[layer]
        kept: list[tuple[float, int, int, int]] = []
        found = None
        while heap:
            entry = heap[0]
            _, s, key, stamp = entry
            # Dead: the slot was emptied or refilled, or it left the books with its
            # expert still in it (the cache keeps it for a prediction).
            if resident[s] != key or entry_key[s] != key:
                heapq.heappop(heap)
                continue
            fv = fvisit[key]
            now = 2 * fv + (fv == visits)  # ``_stamp``, inlined on the hot path
            if stamp != now:
                # Re-keyed at ``_heap_key``, inlined.
                f = fs[key]
                if fv == visits:
                    hkey = log((1.0 - stick) * f + stick)
                else:
                    hkey = (log(f) if f > 0.0 else -1e300) + keep
                heapq.heapreplace(heap, (hkey - fdecay[key], s, key, now))
            elif touched[s] == step:
                kept.append(heapq.heappop(heap))
            else:
                found = entry
                if take:
                    heapq.heappop(heap)
                break
        for e in kept:
            heapq.heappush(heap, e)
        return found

    def _expected(self, layer: int, hkey: float) -> float:
        """Step at which an expert of ``layer`` with heap key ``hkey`` is expected
        to be routed next."""
        log_q = hkey + self._decay[layer]
        if log_q < -700.0:
            return math.inf
        return self._last_visit[layer] + self._layers / math.exp(log_q)

    def _push_layer(self, layer: int) -> float:
        """Announce an upper bound of the layer's furthest expected use.

        Every resident expert has an entry at or below its true key, so the top
        entry's key is at most the layer's least ``q`` and the value pushed never
        understates the layer; it stays an upper bound until the layer's next visit
        (removals only shrink it). The victim search recomputes the exact value
        before acting on it.
        """
        heap = self._heaps[layer]
        resident, entry_key = self._resident, self._entry_key
        # Dead entries off the top first (they are gone for good); a stale entry is
        # left, since re-keying every hit of a warm step would cost more than the
        # victim search's re-check of a loose bound.
        while heap and not resident[heap[0][1]] == heap[0][2] == entry_key[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            return math.inf
        top = self._top
        heapq.heappush(top, (-self._expected(layer, heap[0][0]), layer))
        if len(top) > 8 * self._layers + 64:
            best: dict[int, float] = {}
            for neg, m in top:
                best[m] = min(best.get(m, 0.0), neg)
            self._top = [(neg, m) for m, neg in best.items()]
            heapq.heapify(self._top)
        return heap[0][0]

    def choose_victim(self, step: int) -> int:
        if not self._settled:
            self._settle(announce=True)
        top = self._top
        dropped: list[int] = []
        while top:
            layer = top[0][1]
            found = self._layer_min(layer, step, take=True)
            if found is None:
                heapq.heappop(top)
                dropped.append(layer)
                continue
            true = -self._expected(layer, found[0])
            # In a binary heap the runner-up is one of the top's two children.
            n = len(top)
            runner_up = top[1][0] if n > 1 else math.inf
            if n > 2 and top[2][0] < runner_up:
                runner_up = top[2][0]
            # Re-filed at its exact value either way; after the victim leaves, the
            # layer's furthest expected use can only shrink, so it stays an upper bound.
            # Not so for the stepping layer: ``true`` leaves out the experts this step
            # routes, so its ``on_step`` must announce the layer afresh.
            heapq.heapreplace(top, (true, layer))
            if layer == self._current:
                self._bound_key = -math.inf
            if true > runner_up + 1e-9:
                # The stored value was stale and another layer may now lead.
                heapq.heappush(self._heaps[layer], found)
                continue
            slot = found[1]
            self._entry_key[slot] = -1
            for m in dropped:
                self._push_layer(m)
            return slot
        raise PlanError("eviction asked for a victim but no occupied slot is evictable")

    def on_remove(self, slot: int) -> None:
        # The heap entry dies lazily (the cache clears ``resident[slot]``); forgetting
        # which key it was for makes a refill of the same key push a fresh one.
        self._entry_key[slot] = -1
