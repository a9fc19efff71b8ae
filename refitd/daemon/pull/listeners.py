"""What listens to a daemon's pulls, and the two rules that do: writes and the pull cap.

A pull is submitted to :class:`~refitd.daemon.pull.pulls.PullManager` by a
:class:`Caller`; every :class:`PullListener` of the manager is told, in the order
they were added: ``admit`` before anything is checked or moves (a listener refuses
by raising), ``started`` once the pull is accepted and its task made (no await in
between), ``ended`` once it ended (its state, bytes and end time final), before
its waiters are woken. Listeners do not await: what they do is bookkeeping.

The daemon's listeners: :class:`WriteRule` and :class:`PullCap` (here), the
metrics (:class:`refitd.daemon.app.metrics.PullMetrics`) and the expert pools, whose
experts a pull rewrites leave their slots
(:class:`refitd.daemon.experts.pools.ExpertPools`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from refitd.daemon.access.caps import Caps
from refitd.daemon.access.trust import check_writes
from refitd.daemon.pull.core import dst_ids
from refitd.daemon.state.records import RegionTable
from refitd.daemon.state.registry import Registry
from refitd.daemon.state.staging import StagingPool
from refitd.wire import PullRequest, PullState

__all__ = ["Caller", "Job", "PullCap", "PullListener", "WriteRule", "anyone"]


class Job(Protocol):
    """What a listener reads of a pull (:class:`refitd.daemon.pull.pulls.PullJob` is one):
    its id and owner, its request, and once it ended its state, bytes moved, the path
    it took and its start and end (``time.perf_counter``, s)."""

    @property
    def pull_id(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def req(self) -> PullRequest: ...
    @property
    def state(self) -> PullState: ...
    @property
    def bytes_done(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def started(self) -> float: ...
    @property
    def ended(self) -> float | None: ...


def _anyone_owns(owner: str, action: str, what: str) -> None:
    """Without authentication every object is the caller's."""


@dataclass(frozen=True)
class Caller:
    """Who submits a pull: their principal's ``name`` ("" without authentication),
    and ``check_owner(owner, action, what)``, which refuses (403) when an object of
    ``owner`` is not theirs to act on (see :func:`refitd.daemon.access.auth.check_owner`)."""

    name: str = ""
    check_owner: Callable[[str, str, str], None] = _anyone_owns


anyone = Caller()
"""A caller without authentication: may act on every object."""


class PullListener(Protocol):
    """Told of every pull of one daemon (see the module docstring); each method
    does nothing unless a listener overrides it."""

    def admit(self, req: PullRequest, caller: Caller) -> None:
        """Refuse ``req`` (raise) before anything is checked or moves."""
        return None

    def started(self, job: Job) -> None:
        """``job`` was accepted; its task runs from the next loop turn."""
        return None

    def ended(self, job: Job) -> None:
        """``job`` ended: its state, ``bytes_done`` and ``ended`` are final."""
        return None


class WriteRule(PullListener):
    """Refuse a pull whose destinations include another principal's region (403), a
    staging region (403) or a region a READY, pending or leased version publishes from
    (409): the write rule of :mod:`refitd.daemon.access.trust`. The pull checks it again
    after its awaits, when its destinations are pinned."""

    def __init__(self, regions: RegionTable, registry: Registry, staging: StagingPool) -> None:
        self.regions = regions
        self.registry = registry
        self.staging = staging

    def admit(self, req: PullRequest, caller: Caller) -> None:
        known = self.regions.sizes()
        dst = dst_ids(req.descriptors.rows(), req.pack_specs)
        for rid in sorted(dst & known.keys()):  # unknown ids are refused by validation
            caller.check_owner(self.regions.get(rid).owner, "write", f"region {rid}")
        check_writes(dst, self.registry.protected_regions(), self.staging.ids)


class PullCap(PullListener):
    """``limits.max_pulls_per_principal``: running pulls per principal (429 past it)."""

    def __init__(self, caps: Caps, running: Callable[[str], bool]) -> None:
        self.caps = caps
        self.running = running  # whether the pull of that id is still running

    def admit(self, req: PullRequest, caller: Caller) -> None:
        self.caps.pulls.admit(caller.name, self.running)

    def started(self, job: Job) -> None:
        # Ended pulls are forgotten here too, not only when their owner is admitted
        # again: the daemon's own (a host mirror's fills) are never admitted.
        self.caps.pulls.held(job.owner, self.running)
        self.caps.pulls.add(job.owner, job.pull_id)
