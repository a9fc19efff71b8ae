"""The receiving side of a refit, as pure policy over the planner and a transport.

:class:`ReshardReceiver` holds one capture of the engine. Each refit it plans (or
replays a compiled plan) against the published sources and executes it through a
transport. It fails closed *before any byte moves*: a capture with unattributed
``copy_`` writes, or a plan with any ``fallback`` source, is refused with
:class:`~refitd.reshard.types.UnsupportedReshard` naming the grouped causes, so a
live parameter is never written from a partial plan. It also refuses, before any
byte moves, a capture that would leave a destination of ``dest_layout`` (every
parameter, plus the persistent buffers the caller includes, see
:func:`~refitd.reshard.coverage.destinations_of`) wholly or partly unwritten:
:class:`~refitd.reshard.types.IncompleteRefit` names every such destination. Names
in ``allow_unwritten`` are meant to keep their values and are not refused.

``strict=True`` follows the compiled-plan contract: the receiver replays only the
signature it was warmed on (:meth:`ReshardReceiver.warm`); a refit for anything else
is refused with an error telling the caller to re-plan.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from refitd.reshard.compile import (
    BoundPlan,
    CompiledPlan,
    DestLayout,
    SignatureMismatch,
    compile_plan,
    execute_bound,
)
from refitd.reshard.coverage import refuse_unwritten
from refitd.reshard.reads import ReadExecutor
from refitd.reshard.replay import replay_ops
from refitd.reshard.transfer_plan import SourceInfo, TransferPlan, plan_transfer
from refitd.reshard.types import CaptureResult, UnsupportedReshard, summarize_unsupported

__all__ = ["ReshardReceiver", "_replay_ops", "execute_bound", "refuse_unsafe"]

KEEP_PLANS = 4
"""Compiled plans a receiver keeps (the current one and the last three): a
double-buffered trainer's two sets of memory each replay their own plan."""

_replay_ops = replay_ops
"""Local replay of an op chain (ModelExpress's receiver exposes it under this name)."""


def refuse_unsafe(capture: CaptureResult, plan: TransferPlan | None = None) -> None:
    """Raise :class:`UnsupportedReshard` if ``capture``/``plan`` cannot be served whole:
    a write into memory no destination owns (named), or a source the capture (without ``plan``) or the plan
    (with it: also sources missing from the manifest) cannot serve exactly."""
    if capture.unattributed:
        shown = "; ".join(capture.unowned[:5])
        more = len(capture.unowned) - 5
        raise UnsupportedReshard(
            f"refit refused before any transfer: {capture.unattributed} copy_ write(s) landed "
            f"in memory that belongs to no parameter or persistent buffer of the model (a "
            f"temporary the loader copies on, or a tensor of its own), so refitd cannot tell "
            f"which destination they fill: {shown or 'not recorded'}"
            f"{f'; ... {more} more' if more > 0 else ''}"
        )
    if plan is None:
        fallback, reasons = capture.unsupported, capture.unsupported_reasons
    else:
        fallback, reasons = plan.fallback, plan.fallback_reasons
    if fallback:
        causes = "; ".join(
            f"{cause} ({count} source{'s' if count != 1 else ''})"
            for cause, count in summarize_unsupported(reasons)
        )
        raise UnsupportedReshard(
            f"refit refused before any transfer: {len(fallback)} source(s) cannot be "
            f"planned exactly ({fallback[:5]}...); causes: {causes or 'unknown'}"
        )


@dataclass
class ReshardReceiver:
    """Plan, compile and execute refits of one captured engine.

    ``max_reads_per_copy`` and ``pack_specs`` are passed to
    :func:`~refitd.reshard.transfer_plan.plan_transfer`. ``replans`` counts plans
    made (a warm refit with an unchanged signature makes none). It keeps its last
    ``keep_plans`` compiled plans and replays whichever one's signature the sources
    match, so a trainer publishing from two sets of memory in turn (double
    buffering: two sets of sessions) plans twice, not once a version. ``allow_unwritten``
    names destinations the capture may leave untouched (strict by default: none).
    """

    capture: CaptureResult
    max_reads_per_copy: int = 64
    pack_specs: bool = True
    strict: bool = False
    allow_unwritten: Collection[str] = ()
    compiled: CompiledPlan | None = None
    replans: int = 0
    keep_plans: int = KEEP_PLANS
    _options: tuple[object, ...] = field(default=(), init=False)
    #: plans compiled before ``compiled``, newest first (at most ``keep_plans - 1``)
    _earlier: list[CompiledPlan] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._options = (self.max_reads_per_copy, self.pack_specs)

    def prepare(self, sources: Mapping[str, SourceInfo]) -> TransferPlan:
        """Plan against ``sources``; refuse (before any transfer) if unsafe."""
        refuse_unsafe(self.capture)
        plan = plan_transfer(
            self.capture, sources, self.max_reads_per_copy, pack_specs=self.pack_specs
        )
        refuse_unsafe(self.capture, plan)
        return plan

    def warm(self, sources: Mapping[str, SourceInfo], dest_layout: DestLayout) -> CompiledPlan:
        """Plan and compile for exactly this signature; refuse (before any transfer)
        an unsafe capture (`refuse_unsafe`: the root cause comes first), then one that
        leaves a destination of ``dest_layout`` unwritten, then an unsafe plan."""
        refuse_unsafe(self.capture)
        refuse_unwritten(self.capture, dest_layout, self.allow_unwritten)
        plan = self.prepare(sources)
        self.replans += 1
        if self.compiled is not None:
            self._earlier.insert(0, self.compiled)
            del self._earlier[max(0, self.keep_plans - 1) :]
        self.compiled = compile_plan(plan, sources, dest_layout, self._options)
        return self.compiled

    def recall(self, sources: Mapping[str, SourceInfo], dest_layout: DestLayout) -> bool:
        """Make an earlier plan whose signature ``sources`` match the current one (True),
        the plan it replaces kept in its place: a trainer that double-buffers
        publishes from two sets of memory in turn, each its own sessions, and each
        keeps its plan."""
        for k, plan in enumerate(self._earlier):
            if plan.mismatch(sources, dest_layout) is None:
                assert self.compiled is not None
                self._earlier[k] = self.compiled
                self.compiled = plan
                return True
        return False

    def refit(
        self,
        sources: Mapping[str, SourceInfo],
        resolve_param_ptr: Callable[[str], int],
        transport: ReadExecutor,
        dest_layout: DestLayout,
    ) -> dict[str, Any]:
        """Move one version's bytes into the parameters (:meth:`bind`, then
        :func:`~refitd.reshard.compile.execute_bound` through ``transport``)."""
        bound = self.bind(sources, resolve_param_ptr, dest_layout)
        return execute_bound(bound, resolve_param_ptr, transport)

    def bind(
        self,
        sources: Mapping[str, SourceInfo],
        resolve_param_ptr: Callable[[str], int],
        dest_layout: DestLayout,
    ) -> BoundPlan:
        """The plan for ``sources`` bound to the parameters' addresses, nothing moved.

        Replays the compiled plan when the signature is unchanged; otherwise
        re-plans, or in strict mode raises :class:`SignatureMismatch`. A caller that
        moves the bytes itself (the daemon receiver) starts here.
        """
        why = (
            "no plan has been warmed"
            if self.compiled is None
            else self.compiled.mismatch(sources, dest_layout)
        )
        if why is not None and self.recall(sources, dest_layout):
            why = None
        if why is not None:
            if self.strict:
                raise SignatureMismatch(
                    f"strict receiver refused the refit: {why}. Re-plan: warm the exact "
                    f"signature first (call warm() with it)."
                )
            self.warm(sources, dest_layout)
        assert self.compiled is not None
        try:
            bound = self.compiled.bind(sources, resolve_param_ptr, dest_layout)
        except SignatureMismatch:
            if self.strict:
                raise
            bound = self.warm(sources, dest_layout).bind(sources, resolve_param_ptr, dest_layout)
        return bound
