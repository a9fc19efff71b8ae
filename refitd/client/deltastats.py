"""What a :class:`~refitd.client.deltarefit.DeltaReceiver`'s refit reports: which
kind ran and why, its bytes, and where a delta's seconds went."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from refitd.client.receiver import RefitStats

__all__ = ["AUTO_SAME_HOST", "OVERLAPPED", "WHERE", "DeltaStats"]

AUTO_SAME_HOST = (
    "auto: the source is on this host (the last full refit read shared memory), "
    "where a full refit copies at memory speed and a delta is not faster"
)
"""The reason ``prefer="auto"`` gives for refitting in full on the source's host."""


@dataclass(frozen=True)
class DeltaStats:
    """How one refit went: ``kind`` says which ran, ``reason`` why a full one did;
    ``wire_bytes`` what it pulled, ``full_bytes`` what a full refit of it pulls;
    ``changed`` the units applied (``unit`` bytes each).

    A delta's seconds: ``check_s`` the engine's base check (its digest window, read
    while the request crosses), ``stage_s`` the source's seconds (waiting for its
    comparison, encoding every chunk), ``refit.pull_s`` the stream (its request until
    its last chunk came), ``apply_s`` its first chunk's arrival until the end;
    inside these, overlapping the stream: ``place_s`` decoding and placing each unit
    (writing and digesting too where every read lands whole in the engine),
    ``write_s`` the writes with their undo record and ``digest_s`` the engine
    digest's update (where the plan scatters); ``post_s`` ``after_apply``.

    ``where``: the wall time cut into parts that add up (:data:`WHERE`), and the
    parts spent inside them (:data:`OVERLAPPED`)."""

    refit: RefitStats
    kind: Literal["delta", "full"]
    reason: str
    wire_bytes: int
    full_bytes: int
    changed: int = 0
    unit: int = 0
    check_s: float = 0.0
    apply_s: float = 0.0
    undo_bytes: int = 0
    stage_s: float = 0.0
    place_s: float = 0.0
    write_s: float = 0.0
    digest_s: float = 0.0
    post_s: float = 0.0
    where: dict[str, float] = field(default_factory=dict)


WHERE = ("lease", "manifest", "plan", "check", "first", "stream", "tail", "post")
"""The keys of :attr:`DeltaStats.where` that add up to a delta's wall time, in order."""

OVERLAPPED = ("src_wait", "src_encode", "engine_check")
"""Keys of :attr:`DeltaStats.where` spent inside ``first`` and ``stream``: the
source's wait for its comparison and its encoding, and the engine's base check."""
