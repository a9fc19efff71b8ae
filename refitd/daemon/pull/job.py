"""A pull's record: what it reads, how far it got, how it ended and what it holds
while it runs (its pins, its staging connection, its plan charge). The
:class:`~refitd.daemon.pull.pulls.PullManager` makes and runs them; ``/v1/pulls`` shows their
:meth:`PullJob.snapshot`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from refitd.daemon.pull import core as pullcore
from refitd.daemon.pull.devstaging import StagedPeer
from refitd.daemon.pull.machine import Event, Fail, Pull, step
from refitd.wire import ErrorBody, PullProgress, PullRequest, PullState
from transports.interface import Capabilities, Peer

__all__ = ["PullJob"]

log = logging.getLogger("refitd.pulls")


@dataclass
class PullJob:
    pull_id: str
    req: PullRequest
    bytes_total: int
    descriptors_total: int
    state: PullState = PullState.PENDING
    bytes_done: int = 0
    descriptors_done: int = 0
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    error: ErrorBody | None = None
    suspect: list[tuple[int, int, int]] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    path: str = ""  # "shm" or the transport's scheme: decided at submit
    #: what the transport of its path can do (how its reads are cut and batched)
    caps: Capabilities = field(default_factory=Capabilities)
    #: the same-host connection chosen at submit (None: the transport's, made later)
    conn: Peer | None = None
    cancel_reason: str = ""
    fail_reason: str = ""  # set when the source left the registry: FAILED, not CANCELLED
    #: regions of this daemon the pull reads or writes, kept from deletion until it ends
    pins: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    #: the principal that submitted it: only they see, wait for and cancel it
    owner: str = ""
    #: the device kinds of memory its regions here are made of ("cuda"; "" for host
    #: memory only): its bytes go through those kinds' copy engines, and it says so
    devices: str = ""
    #: bytes of its principal's plan charge it gives back when it ends
    plan_bytes: int = 0
    #: over a host-memory data plane, the connection staging its device-bound reads
    #: (:mod:`refitd.daemon.pull.devstaging`); its staging region is given back when the pull ends
    device_staging: StagedPeer | None = None

    def progress(self, n_desc: int, n_bytes: int) -> None:
        self.descriptors_done += n_desc
        self.bytes_done += n_bytes

    def step(self, pull: Pull, ev: Event, rows: np.ndarray | None = None) -> Pull:
        """``pull`` after ``ev`` (:func:`refitd.daemon.pull.machine.step`), done to this
        job: its state, and as it ends its error and (``rows``: what it read) its
        suspect ranges."""
        pull, todo = step(pull, ev)
        self.state = pull.state
        for end in todo:
            self.error = end.error
            self.suspect = pullcore.suspect(rows) if end.suspect and rows is not None else []
            if not end.expected and isinstance(ev, Fail):
                log.error("pull %s failed unexpectedly", self.pull_id, exc_info=ev.error)
        return pull

    def snapshot(self) -> PullProgress:
        end = self.ended if self.ended is not None else time.perf_counter()
        secs = end - self.started
        rate = self.bytes_done / secs / 1e9 if secs > 0 else 0.0
        return PullProgress(
            self.pull_id,
            self.state,
            self.bytes_total,
            self.bytes_done,
            self.descriptors_total,
            self.descriptors_done,
            secs,
            rate,
            self.error,
            self.suspect,
            f"{self.path}+{self.devices}" if self.devices else self.path,
        )
