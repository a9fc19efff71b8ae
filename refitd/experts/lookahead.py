"""The lookahead side of the expert cache: predictions, and the slots they hold.

``ExpertCache`` mixes this in; it is split out only to keep the cache's own module
short. Three kinds of slot sit outside the eviction policy's books (``_owned``):
slots *held* by a still-valid prediction (filled by a prefetch, or resident experts
the policy offered as victims while a prediction needed them) and *unused* slots,
prefetched copies whose layer ran without routing them, queued oldest first. Resident
experts a prediction needs but the policy has not offered stay in the books,
*pinned*. ``_take_slot`` is the one place a fill finds room: free slots, then unused
ones, then the policy's victims.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from refitd.errors import ConfigError, PlanError
from refitd.experts.plans import CopyPlan, PrefetchPlan
from refitd.experts.policy import EvictionPolicy

__all__ = ["Lookahead"]

_NONE = -1
_EMPTY = CopyPlan()


class Lookahead:
    """Prefetch for ``ExpertCache`` (state is the cache's; see its ``__init__``)."""

    _layers: int
    _experts: int
    _size: int
    _step: int
    _policy: EvictionPolicy
    _slot_of: list[int]
    _resident: list[int]
    _touched: list[int]
    _free: list[int]
    _is_free: list[bool]
    _n_free: int
    _owned: list[bool]
    _held_by: list[int]
    _pinned: list[bool]
    _fresh: list[bool]
    _n_owned: int
    _unused: list[tuple[int, int]]
    _unused_seq: list[int]
    _seq: int
    _predicted: list[list[tuple[int, int]]]
    _pred_order: list[int]
    _step_in_books: int
    _evictions: int
    _prefetched: int
    _prefetch_used: int
    _prefetch_wasted: int

    def _check_layer(self, layer: int) -> None:
        raise NotImplementedError

    def predicted(self, layer: int) -> tuple[int, ...]:
        """Slots the still-valid prediction for ``layer`` needs (held or pinned),
        ascending; empty when there is none. Nothing evicts them but a step that
        needs room and finds no other slot (which cancels the prediction)."""
        self._check_layer(layer)
        return tuple(sorted({s for s, key in self._predicted[layer] if self._needs(s, key, layer)}))

    def unused(self) -> tuple[int, ...]:
        """Prefetched slots whose layer ran without routing them, in the order the
        next misses take them (oldest first, then lowest slot)."""
        seq = self._unused_seq
        return tuple(s for q, s in sorted(self._unused) if seq[s] == q)

    def _take_slot(self, step: int, protected: int) -> int:
        """An empty slot for a fill, or -1. Free slots first (lowest), then unused
        prefetched copies (oldest), then the policy's victim while the books hold a
        slot that is not among the ``protected`` ones this step already uses. A
        victim a prediction needs (pinned) is held for it instead, and the policy is
        asked again."""
        free = self._free
        is_free = self._is_free
        while free:
            s = heapq.heappop(free)
            if is_free[s]:
                is_free[s] = False
                self._n_free -= 1
                return s
        unused = self._unused
        useq = self._unused_seq
        while unused:
            q, s = heapq.heappop(unused)
            if useq[s] == q:
                useq[s] = _NONE
                self._evict_owned(s)
                return s
        policy = self._policy
        resident, touched, pinned = self._resident, self._touched, self._pinned
        while self._size - self._n_free - self._n_owned - protected > 0:
            slot = policy.choose_victim(step)
            if touched[slot] == step or resident[slot] < 0 or self._owned[slot]:
                raise PlanError(
                    f"policy {policy.name!r} chose slot {slot}, which this step "
                    "already uses, which holds nothing, or which it does not own: "
                    "evicting it would break a placement or a prediction"
                )
            if pinned[slot]:
                # Out of the books now; kept for the prediction that needs it.
                pinned[slot] = False
                self._owned[slot] = True
                self._n_owned += 1
                self._held_by[slot] = resident[slot] // self._experts
                continue
            self._slot_of[resident[slot]] = _NONE
            self._evictions += 1
            return slot
        return _NONE

    def _evict_owned(self, slot: int) -> None:
        """Empty an owned (unused) slot for an immediate refill."""
        self._slot_of[self._resident[slot]] = _NONE
        self._owned[slot] = False
        self._n_owned -= 1
        if self._fresh[slot]:
            self._fresh[slot] = False
            self._prefetch_wasted += 1
        self._evictions += 1

    def _adopt(self, slots: Sequence[int]) -> None:
        """Owned slots a step routes join the policy's books (``on_step`` names them)."""
        owned, useq, fresh = self._owned, self._unused_seq, self._fresh
        for s in slots:
            if owned[s]:
                owned[s] = False
                self._n_owned -= 1
                self._held_by[s] = _NONE
                useq[s] = _NONE
                if fresh[s]:
                    fresh[s] = False
                    self._prefetch_used += 1

    def _needs(self, slot: int, key: int, layer: int) -> bool:
        """Whether prediction entry ``(slot, key)`` of ``layer`` still holds its slot."""
        if self._resident[slot] != key:
            return False
        return self._pinned[slot] or self._held_by[slot] == layer

    def _end_prediction(self, layer: int, cancel: bool = False) -> list[int]:
        """End ``layer``'s prediction: unpin its resident experts and return the slots
        it held (still owned, no longer held). When ``cancel``, those become unused at
        once; otherwise the calling step adopts the ones it routes and retires the
        rest."""
        entries = self._predicted[layer]
        self._predicted[layer] = []
        self._pred_order.remove(layer)
        pinned, held_by, resident = self._pinned, self._held_by, self._resident
        released: list[int] = []
        for s, key in entries:
            if resident[s] != key:
                continue
            if pinned[s]:
                pinned[s] = False
            elif held_by[s] == layer:
                held_by[s] = _NONE
                released.append(s)
        if cancel:
            self._retire(released)
            return []
        return released

    def _retire(self, slots: list[int]) -> None:
        """Released slots no step adopted become unused: first to leave, in slot order."""
        owned, useq = self._owned, self._unused_seq
        for s in sorted(slots):
            if owned[s] and useq[s] < 0:
                self._seq += 1
                useq[s] = self._seq
                heapq.heappush(self._unused, (self._seq, s))

    # -- prefetch ------------------------------------------------------------------

    def prefetch(
        self,
        layer: int,
        predicted: Sequence[int] | Mapping[int, float] | np.ndarray,
        budget: int | None = None,
        *,
        min_score: float | None = None,
    ) -> PrefetchPlan:
        """Bring the experts predicted for ``layer``'s next step in ahead of it.

        ``predicted`` is expert ids, most confident first; or scores: a mapping
        ``{expert: score}`` or a float array of one score per expert (for example the
        next layer's router applied to the current hidden state), taken highest first,
        ties to the lower id, skipping scores below ``min_score``. At most ``budget``
        copies are planned (``None``: one per prediction).

        The prediction stays valid until ``layer``'s next ``ensure``; until then
        nothing evicts what it needs (resident predicted experts and the copies
        planned here), except a step with no other slot left, which drops the oldest
        prediction. A prefetch never evicts a slot the current step (the last
        ``ensure``) uses, nor anything an earlier still-valid prediction needs; when
        only such slots are left it plans fewer copies. Copies take free slots, then
        unused prefetched copies, then the policy's victims. The policy is not told
        about a prefetched copy until a step routes it; copies the layer's step does
        not route are the first to leave afterwards. Not a step: the step counter
        and routing statistics do not move. Repeated calls for one layer add to its
        prediction.
        """
        self._check_layer(layer)
        experts = self._experts
        order = self._order_prediction(layer, predicted, min_score)
        limit = len(order) if budget is None else budget
        if limit < 0:
            raise ConfigError(f"prefetch budget must be non-negative or None, got {budget}")
        base = layer * experts
        slot_of, resident = self._slot_of, self._resident
        owned, held_by, pinned = self._owned, self._held_by, self._pinned
        entries = self._predicted[layer]
        if not entries:
            self._pred_order.append(layer)
        step = self._step
        dst: list[int] = []
        rows: list[int] = []
        missing: list[int] = []
        skipped = 0
        full = False
        # Every predicted expert already resident is held first: a copy for a miss
        # must not take the slot of one named later in the same prediction (it would
        # evict it, then copy it back into another slot).
        for e in order:
            key = base + e
            s = slot_of[key]
            if s < 0:
                missing.append(e)
            elif owned[s]:
                if held_by[s] != layer:
                    # An unused copy (its layer's own prediction has ended): held again.
                    held_by[s] = layer
                    self._unused_seq[s] = _NONE
                    entries.append((s, key))
            elif not pinned[s]:
                pinned[s] = True
                entries.append((s, key))
        present = len(order) - len(missing)
        for e in missing:
            key = base + e
            if full or len(dst) >= limit:
                skipped += 1
                continue
            s = self._take_slot(step, self._step_in_books)
            if s < 0:
                full = True
                skipped += 1
                continue
            resident[s] = key
            slot_of[key] = s
            owned[s] = True
            self._n_owned += 1
            held_by[s] = layer
            self._fresh[s] = True
            entries.append((s, key))
            dst.append(s)
            rows.append(e)
        if not entries:
            self._pred_order.remove(layer)
        self._prefetched += len(dst)
        copy = CopyPlan(tuple(dst), tuple(rows)) if dst else _EMPTY
        return PrefetchPlan(layer, copy, present, skipped)

    def _order_prediction(
        self,
        layer: int,
        predicted: Sequence[int] | Mapping[int, float] | np.ndarray,
        min_score: float | None,
    ) -> list[int]:
        """Distinct expert ids, most confident first, validated."""
        experts = self._experts
        if isinstance(predicted, Mapping):
            items = [(e, float(v)) for e, v in predicted.items()]
            if min_score is not None:
                items = [(e, v) for e, v in items if v >= min_score]
            items.sort(key=lambda ev: (-ev[1], ev[0]))
            order = [e for e, _ in items]
        elif isinstance(predicted, np.ndarray) and predicted.dtype.kind == "f":
            if predicted.shape != (experts,):
                raise PlanError(
                    f"layer {layer} prediction scores have shape {predicted.shape}, not "
                    f"({experts},): one score per expert"
                )
            # Stable sort of negated scores: highest first, ties to the lower id.
            idx = np.argsort(-predicted, kind="stable")
            if min_score is not None:
                idx = idx[predicted[idx] >= min_score]
            return [int(e) for e in idx]
        else:
            order = list(dict.fromkeys(predicted))
            if order and type(order[0]) is not int:
                order = list(dict.fromkeys(int(e) for e in order))
        if order and (min(order) < 0 or max(order) >= experts):
            bad = min(order) if min(order) < 0 else max(order)
            raise PlanError(
                f"layer {layer} prediction names expert {bad}, outside 0..{experts - 1}: "
                "the predictor and the cache disagree on the expert count"
            )
        return order
