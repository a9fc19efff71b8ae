"""The running-pulls cap remembers only pulls still running, whoever owns them."""

from __future__ import annotations

from dataclasses import dataclass

from refitd.daemon.access.caps import Caps
from refitd.daemon.pull.listeners import PullCap


@dataclass
class _Job:
    owner: str
    pull_id: str


def test_the_pull_cap_forgets_ended_pulls_of_an_owner_that_is_never_admitted() -> None:
    """A host mirror's fills are pulls of the daemon itself (``refitd-mirror``), told to
    the listeners but never admitted: the cap must not keep every one it ever saw."""
    caps = Caps(leases=8, regions=8, pulls=8)
    running: set[str] = set()
    cap = PullCap(caps, running.__contains__)
    for i in range(10_000):
        running.add(f"p{i}")
        cap.started(_Job("refitd-mirror", f"p{i}"))  # type: ignore[arg-type]
        running.discard(f"p{i}")  # it ended
    assert len(caps.pulls._held["refitd-mirror"]) <= 2  # what it keeps, before any sweep
    assert caps.pulls.held("refitd-mirror", running.__contains__) == 0
