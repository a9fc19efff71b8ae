"""The daemon's data planes as one set: the same-host ``shm`` transport and the rest.

Every region is registered with every data plane the daemon runs, once (its whole
segment), and deregistered from each when it goes: :class:`TransportSet` is the one
object the region store tells. Which schemes start, and which one reads each peer,
is decided in :mod:`refitd.daemon.pull.paths`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from transports.interface import Capabilities, LeaseScope, MappedMemory, Scope, Transport
from transports.shm import ShmTransport
from transports.tcp.held import Completion

__all__ = ["HoldsReads", "TransportSet"]


@runtime_checkable
class HoldsReads(Protocol):
    """A transport whose data server can hold a read until its bytes are complete."""

    def hold_reads(self, completion: Completion | None) -> None: ...


class TransportSet:
    """The same-host ``shm`` transport (in every mode: pulls from this daemon itself
    and from peers proven to share this host's memory) and the transports started by
    scheme, the first one the primary (what ``/v1/node`` advertises)."""

    def __init__(self, shm: ShmTransport) -> None:
        self.shm = shm
        #: every transport started, by scheme, in start order (the first: the primary)
        self.by_scheme: dict[str, Transport] = {}

    @property
    def primary(self) -> Transport | None:
        return next(iter(self.by_scheme.values()), None)

    def on(self, path: str) -> Transport | None:
        """The transport a pull's ``path`` (its scheme, as ``/v1/pulls`` shows it)
        reads through: the same-host one or one started; None for none."""
        if path == self.shm.scheme:
            return self.shm
        return self.by_scheme.get(path)

    def caps(self, path: str) -> Capabilities:
        """What the transport of ``path`` can do (a path without one: the defaults)."""
        t = self.on(path)
        return t.capabilities if t is not None else Capabilities()

    def add(self, scheme: str, transport: Transport) -> None:
        """A started transport joins the set."""
        self.by_scheme[scheme] = transport

    async def register(self, region_id: int, segment: MappedMemory) -> None:
        """Make a region readable through every data plane that registers its kind
        of memory (its whole allocation): host memory through all of them, device
        memory through the same-host one only (`Transport.registers`)."""
        for t in self.by_scheme.values():
            if t.registers(segment):
                await t.register(region_id, segment)
        await self.shm.register(region_id, segment)

    async def deregister(self, region_id: int) -> None:
        for t in self.by_scheme.values():
            if region_id in t.regions:
                await t.deregister(region_id)
        await self.shm.deregister(region_id)

    def grants(self, lease_id: str, scope: Scope, held: Scope) -> dict[str, bytes]:
        """Each transport's credential for a reader under ``lease_id``, encoded, by
        scheme: made and signed here, at the source (:meth:`Transport.grant`), over
        the regions it serves of ``scope``; of ``held`` for a transport whose data
        server holds a read of bytes still filling until they are complete
        (its capabilities say it holds reads)."""
        out = {}
        for s, t in self.by_scheme.items():
            extents = held if t.capabilities.holds_reads else scope
            ranges = {rid: list(r) for rid, r in extents.items() if rid in t.regions}
            out[s] = t.grant(LeaseScope(lease_id, ranges)).encode()
        return out

    async def close(self) -> None:
        """Close every transport, then the ``shm`` one; the set is empty after."""
        for t in self.by_scheme.values():
            await t.close()
        self.by_scheme.clear()
        await self.shm.close()
