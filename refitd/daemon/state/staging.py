"""Staging regions: source-side packing of strided blocks for a reader's lease.

A pull with pack specs asks its source daemon to gather each spec's strided block
into one staging region the source owns (:meth:`StagingPool.pack`), then reads it
back with one descriptor per spec. A staging region is held for the lease it was
packed for: released by that lease's reader (it returns to a small pool, pages
already faulted in) or reclaimed once the lease is gone (deleted, never reused: a
reader whose lease ended may still be reading it). A lease reads only the bytes
packed for it (:meth:`StagingPool.packed_for`), never the rest of a reused region.

A pooled region is reused only for the lease it was last packed for. The records a
lease was answered with name the region (its tcp registration, its shm segment)
and stay valid while the lease lives, so a region handed to another lease would be
readable through them: the bytes packed for another tenant, through a grant kept
past its release. Once its lease ends, a pooled region is deleted.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.daemon.access.trust import check_pack_reads
from refitd.daemon.pull.plancheck import validate_plan
from refitd.daemon.state.registry import Lease, Registry
from refitd.daemon.state.store import RegionStore
from refitd.errors import AccessDenied, ConflictError, ProtocolError, TransportError
from refitd.wire import PackSpec, RegionCreate, RegionInfo, StagedPack
from transports.interface import Scope
from transports.local import CopyFault, Gather, LocalTransport, copy_view

OFF_LOOP_SPECS = 16_384
"""A pack of more specs than this is checked in a worker thread (``pulls.OFF_LOOP_ROWS``)."""

__all__ = ["STAGING_POOL", "StagingPool"]

STAGING_POOL = 4
"""Free staging regions kept for reuse by later pack specs."""


class StagingPool:
    """The staging regions of one daemon, made in ``store``, held for leases of
    ``registry``, packed by the transport ``packer``."""

    def __init__(self, store: RegionStore, registry: Registry, packer: LocalTransport) -> None:
        self.store = store
        self.registry = registry
        #: the data plane that gathers the blocks (every region is registered with it)
        self.packer = packer
        #: ids of the staging regions this daemon made: a client may label its own
        #: region "staging", so the label alone must not admit it to the pool
        self._ids: set[int] = set()
        #: the free staging regions, oldest first, each -> the lease it was last packed
        #: for, the only lease it is reused for (that lease's records name it); each
        #: holds memory for nobody (no principal's cap counts it), which :meth:`_park`
        #: tells the store
        self._free: dict[int, str] = {}
        #: staging regions handed to a reader -> (the lease it packed under, bytes packed
        #: at its start); a reader that never releases one cannot keep it past its lease
        #: (see _reclaim), and the lease reads only the bytes packed for it
        self._held: dict[int, tuple[str, int]] = {}

    @property
    def ids(self) -> frozenset[int]:
        """Every staging region of this daemon (held or free)."""
        return frozenset(self._ids)

    def __contains__(self, region_id: object) -> bool:
        return region_id in self._ids

    def is_held(self, region_id: int) -> bool:
        """Whether staging region ``region_id`` is held for a lease now (not free)."""
        return region_id in self._held

    def packed_for(self, lease_id: str) -> Scope:
        """The staging regions packed for ``lease_id``, each with the bytes packed for
        it (not the rest of a reused region)."""
        regions = self.store.regions
        return {
            rid: [(0, packed)] if packed else []
            for rid, (held, packed) in self._held.items()
            if held == lease_id and rid in regions
        }

    async def pack(
        self,
        specs: list[PackSpec],
        lease: Lease,
        scope: Scope,
        principal: str | None = None,
    ) -> StagedPack:
        """Gather each spec's strided block into one new daemon-owned staging region.

        Only the source fields of each spec are used here; the destination fields are
        the reader's. Refused (nothing packed) if there is no spec, any spec leaves
        its source region, or any spec reads bytes outside ``scope``: what ``lease``
        (live, checked by the caller) may read of its version's regions now, which for
        a mirror still filling is only its complete chunks. The region is held for that lease: released
        by its holder (:meth:`release`) or reclaimed once the lease is gone.

        With ``principal`` (the caller) the region is memory the lease's principal
        (else the caller) holds: admitted by its region and byte caps (429 past them,
        so packing again and again cannot fill /dev/shm) and counted against it.
        """
        if not specs:
            raise ProtocolError("pack refused: the request names no pack spec, nothing to pack")
        store = self.store
        sizes = store.regions.sizes()
        what = f"{lease.model!r} version {lease.version} (lease {lease.lease_id!r})"

        def checked() -> tuple[list[int], int, list[Gather]]:
            offsets: list[int] = []
            total = 0
            for p in specs:
                offsets.append(total)
                total += p.nbytes
            staging_sizes = {p.dst_region: total for p in specs}
            placed = [
                msgspec.structs.replace(p, dst_offset=o)
                for p, o in zip(specs, offsets, strict=True)
            ]
            validate_plan(np.zeros((0, 5), dtype=np.int64), placed, sizes, staging_sizes)
            check_pack_reads(specs, scope, what)
            gathers = [
                Gather(p.src_region, p.src_offset, p.shape, p.strides, p.itemsize) for p in specs
            ]
            return offsets, total, gathers

        # A Python step a spec (a pull of a peer's GPU memory sends one a read): many
        # are checked in a worker thread, off the loop.
        offsets, total, blocks = (
            await asyncio.to_thread(checked) if len(specs) > OFF_LOOP_SPECS else checked()
        )
        if principal is None:
            region = await self._take(total, lease)
        else:
            region = await self.take_for(lease.owner or principal, total, lease)
        self._held[region.region_id] = (lease.lease_id, total)
        try:
            # A reused region still holds what it was packed with for another lease:
            # what this pack does not overwrite is zeroed, so no byte of it survives.
            # Guarded like every copy here: a staging file shrunk by the principal
            # that sees its name faults here, not in the daemon.
            await self.packer.pack(blocks, region.region_id, offsets, total)
        except CopyFault as exc:
            if exc.side == "destination":
                # The staging region itself was shrunk: never handed out again.
                await self._discard(region.region_id)
                raise TransportError(
                    f"pack refused: staging region {region.region_id} faulted under the "
                    "pack: its segment was shrunk; it is discarded"
                ) from exc
            spec = next((p for p in specs if store.covers(p.src_region, exc.address)), specs[0])
            raise TransportError(
                f"pack refused: source region {spec.src_region} faulted under the gather: "
                "its segment was shrunk by its owner"
            ) from exc
        return StagedPack(region, offsets)

    async def stage(
        self, payload: npt.NDArray[np.uint8], lease: Lease, principal: str | None = None
    ) -> RegionInfo:
        """A staging region holding ``payload`` (bytes the daemon computed for
        ``lease``, a delta), held for that lease as :meth:`pack`'s regions are: the
        lease reads exactly ``len(payload)`` bytes of it. With ``principal``, memory it
        holds (:meth:`take_for`)."""
        n = len(payload)
        if not n:
            raise ProtocolError("stage refused: nothing to stage")
        if principal is None:
            region = await self._take(n, lease)
        else:
            region = await self.take_for(principal, n, lease)
        self._held[region.region_id] = (lease.lease_id, n)
        try:
            await asyncio.to_thread(copy_view, self.store.view(region.region_id)[:n], payload.data)
        except CopyFault as exc:
            await self._discard(region.region_id)
            raise TransportError(
                f"stage refused: staging region {region.region_id} faulted under the copy: "
                "its segment was shrunk; it is discarded"
            ) from exc
        return region

    async def take_for(self, principal: str, nbytes: int, lease: Lease) -> RegionInfo:
        """:meth:`_take`, as memory ``principal`` holds: admitted by its region and byte
        caps (429), its place held under them while the region is made
        (:meth:`RegionStore.holding`). Else many at once would all pass the caps before
        any was counted."""
        with self.store.holding(principal, 1, nbytes):
            return self.store.charge(principal, await self._take(nbytes, lease))

    async def _discard(self, region_id: int) -> None:
        """Forget a staging region whose memory can no longer be trusted (shrunk)."""
        self._held.pop(region_id, None)
        if region_id in self._free:
            self._unpark(region_id)
        self._ids.discard(region_id)
        regions = self.store.regions
        if region_id in regions and not self.store.busy(region_id):
            await self.store.drop(region_id, regions.get(region_id))

    async def _take(self, nbytes: int, lease: Lease) -> RegionInfo:
        """A staging region of at least ``nbytes`` bytes for ``lease``, owned by its
        principal: a free one from the pool last packed for this very lease (its pages
        are already faulted in, here and in the reader that mapped it), else a new one."""
        await self._reclaim()
        owner = lease.owner
        regions = self.store.regions
        fits = [
            r
            for r in self._free
            if self._free[r] == lease.lease_id
            and regions.get(r).nbytes >= nbytes
            and not self.store.busy(r)
        ]
        if fits:
            best = min(fits, key=lambda r: regions.get(r).nbytes)
            self._unpark(best)
            info = msgspec.structs.replace(regions.get(best), owner=owner)
            regions.remove(best)
            return regions.add(info)
        region = await self.store.create_region(RegionCreate(nbytes, owner=owner, label="staging"))
        self._ids.add(region.region_id)
        return region

    async def _reclaim(self) -> None:
        """Delete every staging region, held or pooled, whose lease was released or
        expired, so readers that never call release cannot grow the daemon's memory.
        Deleted, not reused: a reader whose lease ended may still be reading it (its
        pull fails, but the bytes it read land), and must never read what is packed
        there next. One that a pull of this daemon still reads waits for a later call."""
        for region_id, (lease_id, _) in list(self._held.items()):
            if self._held.get(region_id, ("",))[0] != lease_id:
                continue  # reclaimed or handed back beside this one's awaits
            if self.registry.is_live(lease_id) or self.store.busy(region_id):
                continue
            del self._held[region_id]
            self._ids.discard(region_id)
            await self.store.drop(region_id, self.store.regions.get(region_id))
        for region_id, lease_id in list(self._free.items()):
            # Checked again at each step: a take or drop beside this one's awaits may
            # have taken the region out of the pool since the list was made.
            if self._free.get(region_id) != lease_id:
                continue
            if self.registry.is_live(lease_id) or self.store.busy(region_id):
                continue
            self._unpark(region_id)
            self._ids.discard(region_id)
            await self.store.drop(region_id, self.store.regions.get(region_id))

    async def release(self, region_id: int, lease_id: str) -> None:
        """The reader under ``lease_id`` is done with staging region ``region_id``
        (``DELETE /v1/peer/staging/{id}?lease=``): it returns to the pool. Refused
        (403) when the region was packed for another lease: only the lease that
        packed it (or its end) frees it, so no reader's bytes are repacked under it.
        Releasing one already free is a no-op."""
        info = self.store.regions.get(region_id)
        if region_id not in self._ids or not info.daemon_owned:
            raise ConflictError(
                f"region {region_id} refused as staging: it is not a staging region of this daemon"
            )
        held = self._held.get(region_id)
        if held is None:
            return
        if held[0] != lease_id:
            raise AccessDenied(
                f"staging region {region_id} refused release: it was packed for another "
                f"lease than {lease_id!r}; only that lease's holder or its end frees it"
            )
        await self._to_pool(region_id)

    async def _to_pool(self, region_id: int) -> None:
        """Return a staging region to the pool; the pool keeps at most
        ``STAGING_POOL`` regions and deletes the rest."""
        held = self._held.pop(region_id, None)
        if region_id in self._free:
            return
        self._park(region_id, held[0] if held is not None else "")
        while len(self._free) > STAGING_POOL:
            gone = next(iter(self._free))
            if self.store.busy(gone):  # still read by a pull of this daemon: keep it
                self._free[gone] = self._free.pop(gone)  # to the back
                break
            self._unpark(gone)
            self._ids.discard(gone)
            await self.store.drop(gone, self.store.regions.get(gone))

    def _park(self, region_id: int, lease_id: str) -> None:
        """Put a staging region in the pool, for reuse by ``lease_id`` only: it holds
        memory for nobody now."""
        self._free[region_id] = lease_id
        self.store.set_idle(region_id, True)

    def _unpark(self, region_id: int) -> None:
        """Take a staging region out of the pool: it holds memory for a lease again
        (or is about to go)."""
        del self._free[region_id]
        self.store.set_idle(region_id, False)
