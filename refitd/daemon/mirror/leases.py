"""Leases on a host mirror's version: only for peer daemons, granted and renewed only
under a live lease on it at its source, and for no longer than that lease had left.

Who leases a mirror: a downstream relay, a daemon of the deployment, whose request
(``POST /v1/mirrors/leases``, a :class:`~refitd.wire.mirrors.MirrorLease`) is signed
with the deployment secret. A host's own tenants never lease the mirrored version
there (``POST /v1/leases`` refuses it, 403): they lease it at its source and pull
through their daemon, which serves the pull from the mirror under its own rules
(:meth:`refitd.daemon.mirror.mirrors.Mirrors.redirect`: the engine's lease at the source
checked at submit and after the last byte).

The source's readers rule travels with a mirror's bytes this way: whoever the source
lets read the version (it granted them a lease) may have its daemon lease this copy,
and nobody else, whatever this host's own tables say. A lease granted here is bound
to the source lease it was granted under: its TTL is capped by what the source lease
had left when granted or last renewed, and every renewal checks the source lease
again. (A peer daemon reading the copy through the data plane under such a lease is
not re-checked between renewals: a source lease it released early leaves it reading
until the capped TTL runs out; it is a daemon of the deployment.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from refitd.errors import AccessDenied, ConflictError, NotFoundError
from refitd.wire import LeaseInfo
from refitd.wire.mirrors import MIRROR_LEASE_FRESH_S, MirrorLease

if TYPE_CHECKING:
    from refitd.daemon.access.auth import Principal
    from refitd.daemon.access.owners import ModelOwners
    from refitd.daemon.mirror.chunks import Mirror
    from refitd.daemon.pull.sources import RemoteSource
    from refitd.daemon.state.registry import Registry

__all__ = ["OWNER", "READY_WAIT_S", "MirrorLeases"]

OWNER = "refitd-mirror"
"""Owner of a mirror's regions and of the leases it takes and grants."""

READY_WAIT_S = 10.0
"""How long a relay's lease request waits for the mirror's regions to exist, s."""


class MirrorLeases:
    """The lease rules of one daemon's mirrors, over its ``registry`` (the leases) and
    its model owners (``models``: which models it holds as mirrors, who reads them).
    ``find(model, version)`` is the mirror (NotFoundError otherwise), ``remote(url)``
    the trusted source daemon at ``url``."""

    def __init__(
        self,
        registry: Registry,
        models: ModelOwners,
        find: Callable[[str, int], Mirror],
        remote: Callable[[str], RemoteSource],
    ) -> None:
        self.registry = registry
        self.models = models
        self.find = find
        self.remote = remote
        #: local lease id -> (source URL, source lease id, model, version)
        self.bound: dict[str, tuple[str, str, str, int]] = {}
        #: nonces of the requests granted, until they could no longer be fresh
        self.nonces: dict[str, float] = {}

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

    async def grant(self, req: MirrorLease, secret: bytes) -> LeaseInfo:
        """A lease of the peer daemon ``req.node_id`` on this daemon's mirror of
        ``req.model`` ``req.version``: only with the deployment secret (403), under a
        live lease on it at the source (403), for no longer than that lease has left;
        bound to it for every renewal."""
        req.verify(secret)
        self._once(req)
        m = self.find(req.model, req.version)
        left = await self._left_at_source(m.source, req.source_lease, req.model, req.version)
        # A mirror joins its source's book while it makes its regions: a relay told to
        # read it may ask first, and waits for them (a failed one is refused below).
        try:
            async with asyncio.timeout(READY_WAIT_S):
                await m.ready.wait()
        except TimeoutError:
            raise ConflictError(
                f"{req._what()} refused: this daemon's mirror of it has not made its regions "
                f"after {READY_WAIT_S:g} s; read from another holder"
            ) from None
        grant = self.registry.acquire(
            req.model, req.version, min(req.ttl_s, left), f"relay {req.node_id}", owner=OWNER
        )
        if len(self.bound) >= 1024:
            for gone in [k for k in self.bound if not self.registry.is_live(k)]:
                del self.bound[gone]
        self.bound[grant.lease_id] = (m.source, req.source_lease, req.model, req.version)
        return grant

    def _once(self, req: MirrorLease) -> None:
        """Refuse (403) a request issued too long ago (or ahead of this clock), or one
        whose nonce was granted already: a signed request is good once, not again."""
        now = time.time()
        if not req.nonce or abs(now - req.issued_at) > MIRROR_LEASE_FRESH_S:
            raise AccessDenied(
                f"{req._what()} refused: issued at {req.issued_at:.0f}, not within "
                f"{MIRROR_LEASE_FRESH_S:.0f} s of this daemon's clock ({now:.0f}), or without "
                "a nonce: a request is made fresh for each lease (MirrorLease.fresh)"
            )
        for nonce in [n for n, until in self.nonces.items() if until < now]:
            del self.nonces[nonce]
        if req.nonce in self.nonces:
            raise AccessDenied(
                f"{req._what()} refused: its nonce was granted already (a replayed request)"
            )
        self.nonces[req.nonce] = req.issued_at + MIRROR_LEASE_FRESH_S

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
            if self.registry.is_live(lease_id):
                self.registry.release(lease_id)
            raise
        return min(ttl_s, left)

    async def renew(self, lease_id: str, ttl_s: float) -> LeaseInfo:
        """Renew ``lease_id`` here (:meth:`Registry.renew`) for ``ttl_s`` seconds, or
        for a mirror's lease as long as its source lease allows (:meth:`renewal`)."""
        return self.registry.renew(lease_id, await self.renewal(lease_id, ttl_s))

    def check_state_reader(self, who: Principal, model: str, version: int, lease_id: str) -> None:
        """Refuse (403) the state of the mirror of ``model`` ``version`` to a caller that
        may not read the model here and presents no live lease on that version here (a
        relay reading it does); checked before the mirror is looked up, so the refusal
        is the same whether or not there is one."""
        if lease_id:
            try:
                self.registry.check(lease_id, model, version)
                return
            except (ConflictError, NotFoundError):
                pass
        self.models.check_read(who, model, "see the mirror of")
