"""Leases on a host mirror's version: granted and renewed only under a live lease on
it at its source, and for no longer than that lease had left.

The source's readers rule travels with a mirror's bytes this way: whoever the source
lets read the version (it granted them a lease) may lease this copy (a downstream
relay does), and nobody else, whatever this host's own tables say. A lease granted
here is bound to the source lease it was granted under: its TTL is capped by what
the source lease had left when granted or last renewed, every renewal checks the
source lease again, and a pull of this daemon's memory under it checks it at submit
and after its last byte (:meth:`refitd.daemon.mirrors.Mirrors.redirect`). (A peer
daemon reading the copy through the data plane under such a lease, a downstream
relay, is not re-checked between renewals: a source lease it released early leaves
it reading until the capped TTL runs out; it is a daemon of the deployment.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from refitd.errors import AccessDenied, ConflictError, NotFoundError
from refitd.wire import LeaseRequest

if TYPE_CHECKING:
    from refitd.daemon.auth import Principal
    from refitd.daemon.mirror import Mirror
    from refitd.daemon.node import Daemon
    from refitd.daemon.pulls import RemoteSource

__all__ = ["MirrorLeases"]


class MirrorLeases:
    """The lease rules of one daemon's mirrors. ``find(model, version)`` is the mirror
    (NotFoundError otherwise), ``remote(url)`` the trusted source daemon at ``url``."""

    def __init__(
        self,
        daemon: Daemon,
        find: Callable[[str, int], Mirror],
        remote: Callable[[str], RemoteSource],
    ) -> None:
        self.d = daemon
        self.find = find
        self.remote = remote
        #: local lease id -> (source URL, source lease id, model, version)
        self.bound: dict[str, tuple[str, str, str, int]] = {}

    async def _left_at_source(self, source: str, lease: str, model: str, version: int) -> float:
        """Seconds ``lease`` has left at ``source`` (AccessDenied when it is not live)."""
        refusal = (
            f"lease on {model!r} version {version} refused: this daemon holds it as a mirror "
            f"of {source}, and leases it only under a live lease on it there (source_lease)"
        )
        if not lease:
            raise AccessDenied(refusal)
        try:
            grant = await self.remote(source).client.check_lease(lease, model, version)
        except (ConflictError, NotFoundError):
            raise AccessDenied(f"{refusal}; {lease!r} is not one") from None
        return grant.expires_in_s

    async def admit(self, req: LeaseRequest) -> float | None:
        """The TTL a lease ``req`` may have, s: for a version held as a mirror, what
        ``req.source_lease`` has left at its source (403 when it is not live there);
        None for any other model (nothing to check here)."""
        if not self.d.models.held(req.model):
            return None
        m = self.find(req.model, req.version)
        left = await self._left_at_source(m.source, req.source_lease, req.model, req.version)
        return min(req.ttl_s, left)

    def bind(self, lease_id: str, req: LeaseRequest) -> None:
        """Remember that ``lease_id`` was granted under ``req.source_lease`` (held
        models only); forgets the bindings of leases no longer live."""
        if not self.d.models.held(req.model):
            return
        if len(self.bound) >= 1024:
            for gone in [k for k in self.bound if not self.d.registry.is_live(k)]:
                del self.bound[gone]
        m = self.find(req.model, req.version)
        self.bound[lease_id] = (m.source, req.source_lease, req.model, req.version)

    async def renewal(self, lease_id: str, ttl_s: float) -> float:
        """The TTL a renewal of ``lease_id`` may have, s: capped by its source lease's,
        checked live again (403 otherwise, and the local lease is released)."""
        b = self.bound.get(lease_id)
        if b is None:
            return ttl_s
        try:
            left = await self._left_at_source(*b)
        except AccessDenied:
            self.bound.pop(lease_id, None)
            if self.d.registry.is_live(lease_id):
                self.d.registry.release(lease_id)
            raise
        return min(ttl_s, left)

    def check_state_reader(self, who: Principal, m: Mirror, lease_id: str) -> None:
        """Refuse (403) the state of mirror ``m`` to a caller that may not read its model
        here and presents no live lease on its version here (a relay reading it does)."""
        if lease_id:
            try:
                self.d.registry.check(lease_id, m.model, m.version)
                return
            except (ConflictError, NotFoundError):
                pass
        self.d.models.check_read(who, m.model, "see the mirror of")
