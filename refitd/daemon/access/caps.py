"""Per-principal caps: how many leases, regions and pulls one principal holds at once.

Without them one tenant (one token, or every unauthenticated client together as
``loopback``) can grow the daemon's tables and memory until every tenant suffers.
Each cap is a setting of ``[limits]`` (:class:`refitd.config.LimitsConfig`); past
it the request is refused with :class:`~refitd.errors.QuotaExceeded` (429) naming
the cap and its setting, and nothing is done.

The caps count ids per principal. An id stops counting once its object is gone
(released or expired lease, deleted region, ended pull); those are swept only when
a principal reaches its cap, so each admission costs O(1) amortised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from refitd.errors import QuotaExceeded

__all__ = ["ByteCap", "Cap", "Caps", "Charges"]


@dataclass
class Cap:
    """One cap: at most ``limit`` live ids per principal; ``what`` names the objects,
    ``key`` the setting."""

    what: str
    key: str
    limit: int
    _held: dict[str, dict[str, None]] = field(default_factory=dict)

    def admit(self, principal: str, alive: Callable[[str], bool], n: int = 1) -> None:
        """Refuse (429) unless ``principal`` may hold ``n`` more: it holds at most
        ``limit - n`` ids that are ``alive``; ids no longer alive are forgotten first."""
        held = self._held.get(principal)
        if held is None or len(held) + n <= self.limit:
            return
        for gone in [i for i in held if not alive(i)]:
            del held[gone]
        if len(held) + n > self.limit:
            raise QuotaExceeded(
                f"{self.what} refused: principal {principal!r} already holds {len(held)} "
                f"{self.what}s, its cap (limits.{self.key} = {self.limit}) leaves no room "
                f"for {n} more; release some first"
            )

    def add(self, principal: str, object_id: str) -> None:
        """Count ``object_id`` against ``principal`` (after :meth:`admit` let it in)."""
        self._held.setdefault(principal, {})[object_id] = None

    def discard(self, principal: str, object_id: str) -> None:
        """Stop counting ``object_id`` (a place held while its object was made)."""
        self._held.get(principal, {}).pop(object_id, None)

    def held(self, principal: str, alive: Callable[[str], bool]) -> int:
        """How many live ids ``principal`` holds (sweeps the dead ones)."""
        held = self._held.get(principal, {})
        for gone in [i for i in held if not alive(i)]:
            del held[gone]
        return len(held)


@dataclass
class ByteCap:
    """Bytes of memory the daemon made for one principal (its regions, the staging
    packed for its leases, its pools), at most ``limit`` (0: no cap but /dev/shm)."""

    key: str
    limit: int
    _held: dict[str, dict[str, int]] = field(default_factory=dict)

    def admit(self, principal: str, alive: Callable[[str], bool], nbytes: int) -> None:
        """Refuse (429) unless ``principal`` may hold ``nbytes`` more bytes."""
        if self.limit <= 0:
            return
        held = self._held.setdefault(principal, {})
        if sum(held.values()) + nbytes <= self.limit:
            return
        for gone in [i for i in held if not alive(i)]:
            del held[gone]
        total = sum(held.values())
        if total + nbytes > self.limit:
            raise QuotaExceeded(
                f"{nbytes} bytes of memory refused: principal {principal!r} holds {total} "
                f"bytes the daemon made for it, its cap (limits.{self.key} = {self.limit}) "
                "leaves no room; free some first"
            )

    def add(self, principal: str, object_id: str, nbytes: int) -> None:
        if self.limit > 0:
            self._held.setdefault(principal, {})[object_id] = nbytes

    def discard(self, principal: str, object_id: str) -> None:
        self._held.get(principal, {}).pop(object_id, None)


@dataclass
class Charges:
    """Bytes of daemon memory charged to each principal for objects that live a while
    (``what`` names them), at most ``limit`` (setting ``key``) each: admitted and
    added at once, before the work starts (429 past it), given back when they end."""

    what: str
    key: str
    limit: int
    _held: dict[str, int] = field(default_factory=dict)

    def take(self, principal: str, nbytes: int, asked: str) -> None:
        """Charge ``nbytes`` to ``principal`` for ``asked`` (the refusal names it)."""
        held = self._held.get(principal, 0)
        if held + nbytes > self.limit:
            raise QuotaExceeded(
                f"{asked} refused: it keeps {nbytes} bytes of the daemon's memory, and "
                f"{principal}'s {self.what} keep {held}, past its cap (limits.{self.key} = "
                f"{self.limit})"
            )
        self._held[principal] = held + nbytes

    def give_back(self, principal: str, nbytes: int) -> None:
        left = self._held.get(principal, 0) - nbytes
        if left > 0:
            self._held[principal] = left
        else:
            self._held.pop(principal, None)

    def held(self, principal: str) -> int:
        return self._held.get(principal, 0)


class Caps:
    """The daemon's caps, from ``[limits]``."""

    def __init__(self, leases: int, regions: int, pulls: int, region_bytes: int = 0) -> None:
        self.leases = Cap("lease", "max_leases_per_principal", leases)
        self.regions = Cap("region", "max_regions_per_principal", regions)
        self.pulls = Cap("pull", "max_pulls_per_principal", pulls)
        self.bytes = ByteCap("max_region_bytes_per_principal", region_bytes)
