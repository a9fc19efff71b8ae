"""The daemon's regions and the memory behind them: records, segments, pins, reaping.

:class:`RegionStore` owns every shared-memory segment the daemon created or attached.
One memory is one region: a segment is keyed by its file's ``(st_dev, st_ino)``, so
a second id for the same memory (whose rules its first id's would not bind) is
refused. Each region is registered with every data plane of the daemon's
:class:`~refitd.daemon.state.plane.TransportSet` once, and deregistered when it goes.

A region is pinned while a running pull reads or writes it (:meth:`RegionStore.using`;
it is never unmapped under a copy) and marked while a pull writes it
(:meth:`RegionStore.writing`; no version is published from it meanwhile). A region
created or attached with a ``process`` lives with that client process: once it exits,
its regions are released as soon as nothing needs them any more (:meth:`RegionStore.reap`).

The store also admits regions against their principal's caps (``[limits]``
``max_regions_per_principal``, ``max_region_bytes_per_principal``): a region made or
attached for a principal is refused (429) past them, and counted once made
(:meth:`RegionStore.admit`, :meth:`RegionStore.charge`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import logging
import os
from collections.abc import Iterable, Iterator

from refitd.daemon.access.caps import Caps
from refitd.daemon.state.memory import (
    SharedSegment,
    attach_memory,
    byte_view,
    check_shm_capacity,
    free_shm_bytes,
    map_whole,
    proves_owner,
    refuse_created_gpu_memory,
)
from refitd.daemon.state.plane import TransportSet
from refitd.daemon.state.processes import ProcessWatch
from refitd.daemon.state.records import RegionTable
from refitd.daemon.state.registry import Registry
from refitd.errors import AccessDenied, ConflictError, InsufficientStorage, PlanError
from refitd.memory_kinds import MemoryKind
from refitd.wire import GcReport, RegionAttach, RegionCreate, RegionInfo
from transports.interface import MappedMemory
from transports.segments import SHM_DIR, cleanup_stale, creator_tag, is_stale, stale_segments

__all__ = ["RegionStore"]

log = logging.getLogger("refitd.daemon")

MAKING = "making-"
"""Prefix of the caps places held by regions being made (see ``create_region``)."""


async def _made_off_loop(nbytes: int, label: str) -> SharedSegment:
    """A new segment of ``nbytes``, every byte backed, made in a worker thread:
    backing one takes time in proportion to its bytes (a page at a time: 64 MiB
    took 0.1-0.23 s on a loaded 2-core host), and the event loop serves every other
    request meanwhile. A caller cancelled while it is made does not leave
    it behind: it is unlinked when the thread is done."""
    made = asyncio.get_running_loop().run_in_executor(None, SharedSegment.create, nbytes, label)
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        made.add_done_callback(_close_made)
        raise


def _close_made(made: asyncio.Future[SharedSegment]) -> None:
    if not made.cancelled() and made.exception() is None:
        made.result().close()  # its owner: unmapped and unlinked


async def _opened_off_loop(req: RegionAttach) -> MappedMemory:
    """The memory a client names, opened in a worker thread: a GPU allocation's
    first opening loads and initialises the CUDA driver, retains a context and
    opens the IPC handle (``cuInit``, ``cuIpcOpenMemHandle``: a blocking call each,
    0.15 s for the first handle on the measured GPU machine). A caller cancelled
    meanwhile leaves nothing open: it is closed when the thread is done."""
    opened = asyncio.get_running_loop().run_in_executor(
        None, attach_memory, req.kind, req.handle, req.nbytes
    )
    try:
        return await asyncio.shield(opened)
    except asyncio.CancelledError:
        opened.add_done_callback(_close_opened)
        raise


def _close_opened(opened: asyncio.Future[MappedMemory]) -> None:
    if not opened.cancelled() and opened.exception() is None:
        opened.result().close()


def _check_process_uid(req: RegionAttach, uid: int) -> None:
    """Refuse memory that proves no owner unless it comes with its ``process``, a live
    process of the caller's kernel-named ``uid``: the region then lives exactly as
    long as that process, and no caller registers it for another user's process."""
    pid = req.process.partition(".")[0]
    try:
        process_uid = os.stat(f"/proc/{pid}").st_uid if pid else None
    except OSError:
        process_uid = None
    if process_uid != uid:
        raise AccessDenied(
            f"{req.kind} region refused: it must name its process, one live and of the "
            f"caller's uid {uid} (the process whose allocation it is); got "
            f"{req.process or 'none'!r}"
        )


class RegionStore:
    """Region records (``regions``) and their mapped segments (``segments``) of one
    daemon life (``incarnation``), registered with the data planes of ``plane``.
    ``registry`` says which regions a version protects from deletion and reaping."""

    def __init__(
        self,
        incarnation: int,
        plane: TransportSet,
        registry: Registry,
        caps: Caps | None = None,
    ) -> None:
        self.incarnation = incarnation
        #: per-principal caps (``[limits]``); the region and byte caps are admitted here
        self.caps = caps or Caps(0, 0, 0)
        #: regions holding memory for nobody now (free staging: :meth:`set_idle`)
        self._idle: set[int] = set()
        self.plane = plane
        self.registry = registry
        self.regions = RegionTable(incarnation)
        #: the memory of each region: a shared segment, or a GPU allocation opened here
        self.segments: dict[int, MappedMemory] = {}
        #: the memory behind each region, its kind's identity (a segment's ``("host",
        #: st_dev, st_ino)``, a GPU allocation's ``("cuda", uuid, address)``) -> region
        #: id: one memory is one region, so every rule keyed on a region id holds for
        #: that memory (see :meth:`_record`)
        self._memory: dict[tuple[str | int, ...], int] = {}
        #: caps places held by regions being made (see :meth:`create_region`)
        self._making: set[str] = set()
        self._places = itertools.count()
        #: regions a running pull of this daemon reads or writes (see :meth:`using`)
        self._busy: collections.Counter[int] = collections.Counter()
        #: regions a running pull writes, with the ids of those pulls (see :meth:`writing`)
        self._writing: dict[int, set[str]] = {}
        #: regions an expert pool holds -> the pool's name (set by the pools)
        self.pool_regions: dict[int, str] = {}
        #: client processes regions live with, and regions whose client exited
        self.processes = ProcessWatch(self._process_exited)
        self._by_process: dict[str, set[int]] = {}
        self._orphans: set[int] = set()
        self._exited: set[str] = set()  # process tags seen exiting (maybe not yet reaped)
        self._reaping: asyncio.Task[list[RegionInfo]] | None = None

    # ------------------------------------------------------------ records

    async def _record(
        self,
        seg: MappedMemory,
        kind: MemoryKind,
        owner: str,
        label: str,
        daemon_owned: bool,
        process: str = "",
    ) -> RegionInfo:
        ident = seg.identity
        same = self._memory.get(ident)
        if same is not None:
            if not daemon_owned:
                seg.close()  # unmap what attach mapped; the file is not ours to unlink
            what = (
                f"device {ident[1]}, inode {ident[2]}"
                if ident[0] == MemoryKind.HOST
                else f"{ident[0]} allocation of device {ident[1]}"
            )
            raise ConflictError(
                f"region refused: {seg.name!r} is memory this daemon already holds "
                f"as region {same} ({what}); one memory is one "
                "region, never a second id whose rules its first id's would not bind"
            )
        rid = self.regions.new_id()
        self._memory[ident] = rid
        try:
            return await self._record_new(rid, seg, kind, owner, label, daemon_owned, process)
        except BaseException:
            if rid not in self.regions:
                self._memory.pop(ident, None)
            raise

    async def _record_new(
        self,
        rid: int,
        seg: MappedMemory,
        kind: MemoryKind,
        owner: str,
        label: str,
        daemon_owned: bool,
        process: str,
    ) -> RegionInfo:
        if process and not self.processes.watch(process):
            process = ""  # not a process visible here: the region lives until deleted
        info = RegionInfo(
            rid, kind, seg.name, seg.size, self.incarnation, owner, label, daemon_owned, process
        )
        if process:
            self._by_process.setdefault(process, set()).add(rid)
        await self.plane.register(rid, seg)
        self.segments[rid] = seg
        return self.regions.add(info)

    # ------------------------------------------------------------ per-principal caps

    def holds_memory(self, region_id: int) -> bool:
        """Whether ``region_id`` holds memory for a principal now: a region that
        exists and is not idle (a free staging region). What the region cap counts."""
        return region_id in self.regions and region_id not in self._idle

    def set_idle(self, region_id: int, idle: bool) -> None:
        """Mark ``region_id`` as holding memory for nobody (``idle``: a free staging
        region waiting in its pool) or for its principal again. The staging pool, built
        with this store, tells it; the store keeps the fact its cap admissions ask
        (never a predicate another part assigns). A dropped region is forgotten."""
        (self._idle.add if idle else self._idle.discard)(region_id)

    def _alive(self, region_id: str) -> bool:
        if region_id.startswith(MAKING):
            return region_id in self._making
        return self.holds_memory(int(region_id))

    def admit(self, principal: str, regions: int = 1, nbytes: int = 0) -> None:
        """Refuse (:class:`~refitd.errors.QuotaExceeded`, 429) unless ``principal`` may
        hold ``regions`` more regions and ``nbytes`` more bytes the daemon makes."""
        self.caps.regions.admit(principal, self._alive, regions)
        if nbytes:
            self.caps.bytes.admit(principal, self._alive, nbytes)

    @contextlib.contextmanager
    def holding(self, principal: str, regions: int, nbytes: int = 0) -> Iterator[None]:
        """:meth:`admit` ``principal`` for ``regions`` more regions and ``nbytes`` more
        bytes, and hold their places under its caps for the block: making the memory
        waits (off the event loop), and a request of the same principal meanwhile is
        admitted against these places, not past them. The block charges
        what it made; the places end with it."""
        self.admit(principal, regions, nbytes)
        places = [f"{MAKING}{next(self._places)}" for _ in range(regions)]
        self._making.update(places)
        for p in places:
            self.caps.regions.add(principal, p)
        if places and nbytes:
            self.caps.bytes.add(principal, places[0], nbytes)
        try:
            yield
        finally:
            self._making.difference_update(places)
            for p in places:
                self.caps.regions.discard(principal, p)
                self.caps.bytes.discard(principal, p)

    def charge(self, principal: str, info: RegionInfo, *, memory: bool = True) -> RegionInfo:
        """Count region ``info`` against ``principal`` (after :meth:`admit`), and its
        bytes too when the daemon made its memory (``memory``)."""
        self.caps.regions.add(principal, str(info.region_id))
        if memory:
            self.caps.bytes.add(principal, str(info.region_id), info.nbytes)
        return info

    # ------------------------------------------------------------ regions

    async def create_region(self, req: RegionCreate, principal: str | None = None) -> RegionInfo:
        """A new daemon-owned segment of exactly ``req.nbytes`` bytes (≥ 1); for
        ``principal`` (admitted by its region and byte caps, and counted), else the
        daemon's own."""
        if principal is not None:
            with self.holding(principal, 1, req.nbytes):
                return self.charge(principal, await self.create_region(req))
        if req.kind is not MemoryKind.HOST:
            refuse_created_gpu_memory()
        check_shm_capacity(req.nbytes, f"region of {req.nbytes} bytes")
        try:  # a size the kernel cannot map is the client's mistake, not a server error
            # Every byte is reserved now: a full /dev/shm refuses here (507), never
            # later as a bus error in the middle of a pull.
            seg = await _made_off_loop(req.nbytes, req.label or "region")
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise InsufficientStorage(
                    f"region of {req.nbytes} bytes refused: {SHM_DIR} cannot reserve its "
                    f"memory ({free_shm_bytes()} bytes free); nothing was created"
                ) from None
            raise PlanError(f"region of {req.nbytes} bytes refused: {exc}") from None
        except OverflowError as exc:
            raise PlanError(f"region of {req.nbytes} bytes refused: {exc}") from None
        return await self._record(
            seg, req.kind, req.owner, req.label, daemon_owned=True, process=req.process
        )

    async def attach_region(
        self,
        req: RegionAttach,
        uid: int | None = None,
        via: str = "loopback",
        principal: str | None = None,
    ) -> RegionInfo:
        """Map (or open) memory a client made; its size must equal ``req.nbytes``.

        ``uid``: the caller's uid when the kernel named it (Unix socket, not root): the
        memory must then prove it is that uid's (a segment: its file's owner). The
        daemon may open files its caller cannot (its own, its group's), and must not
        map them on that caller's behalf. Memory that proves no owner (a GPU
        allocation's IPC handle is a bearer capability) is taken only where the
        caller's identity stands in for it: ``via`` the Unix socket, from a
        ``process`` of the caller's uid, or from the unauthenticated loopback
        of a single-user daemon; never from a token's tenant (docs/trust.md).
        ``principal``: the caller, admitted by its region cap and counted (the memory
        is the client's, so not its byte cap)."""
        if principal is not None:
            with self.holding(principal, 1):
                return self.charge(principal, await self.attach_region(req, uid, via), memory=False)
        if not proves_owner(req.kind):
            # Decided before the memory is opened: opening maps it into the daemon.
            if via == "token":
                raise AccessDenied(
                    f"{req.kind} region refused: a GPU allocation's handle proves no "
                    "owner, so the daemon takes it only over its Unix socket (the kernel "
                    "names the caller's uid), not from a token's tenant"
                )
            if uid is not None:
                _check_process_uid(req, uid)
        seg = await _opened_off_loop(req)
        if seg.owner_uid is not None and uid is not None and seg.owner_uid != uid:
            seg.close()
            raise AccessDenied(
                f"attaching segment {req.handle!r} refused: its file belongs to uid "
                f"{seg.owner_uid}, not to the caller's uid {uid}; a client attaches only "
                "segments it made"
            )
        try:
            await map_whole(seg, f"attaching segment {req.handle!r}")
        except BaseException:
            seg.close()
            raise
        return await self.record_attached(seg, req)

    async def record_attached(self, memory: MappedMemory, req: RegionAttach) -> RegionInfo:
        """Record memory a client made, opened by :meth:`attach_region` (whose checks
        it has passed) as a region; on refusal the memory is let go."""
        return await self._record(
            memory, req.kind, req.owner, req.label, daemon_owned=False, process=req.process
        )

    def device_kinds(self, region_ids: Iterable[int]) -> list[str]:
        """The device kinds (not host memory) the listed regions are made of, sorted."""
        kinds = {self.segments[r].kind for r in region_ids if r in self.segments}
        return sorted(kinds - {MemoryKind.HOST})

    async def delete(self, region_id: int) -> RegionInfo:
        """Forget a region, refused (409) while a READY, pending or leased version
        publishes from it (a retired version included, while leased) or while a
        running pull of this daemon reads or writes it."""
        info = self.regions.get(region_id)
        protected = self.registry.protected_regions().get(region_id)
        if protected is not None:
            model, version, why = protected
            raise ConflictError(
                f"region {region_id} refused deletion: {model!r} version {version} "
                f"publishes tensors in it and is {why}"
            )
        return await self.drop(region_id, info)

    async def drop(self, region_id: int, info: RegionInfo) -> RegionInfo:
        """Forget a region nothing protects any more: deregistered from every data
        plane, unmapped. Refused (409) only while a running pull reads or writes it."""
        if self._busy[region_id]:
            raise ConflictError(
                f"region {region_id} refused deletion: {self._busy[region_id]} running "
                "pull(s) of this daemon read or write it; cancel them or wait"
            )
        self.regions.remove(region_id)
        self._orphans.discard(region_id)
        self._idle.discard(region_id)
        if info.process:
            self._by_process.get(info.process, set()).discard(region_id)
        await self.plane.deregister(region_id)
        seg = self.segments.pop(region_id)
        if self._memory.get(seg.identity) == region_id:
            del self._memory[seg.identity]
        # Off the loop: a host mapping's close unregisters it from a device driver
        # first (cuMemHostUnregister), a GPU region's closes its IPC mapping.
        await asyncio.shield(asyncio.to_thread(seg.close))
        return info

    def view(self, region_id: int) -> memoryview:
        self.regions.get(region_id)
        return byte_view(self.segments[region_id])

    def covers(self, region_id: int, address: int) -> bool:
        """Whether ``address`` (in this process) lies in region ``region_id``'s mapping."""
        seg = self.segments.get(region_id)
        return seg is not None and seg.address <= address < seg.address + seg.size

    def close(self) -> None:
        """Unmap every segment (the daemon is stopping, its data planes closed)."""
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()

    # ------------------------------------------------------------ pins

    def busy(self, region_id: int) -> int:
        """How many running pulls of this daemon read or write ``region_id``."""
        return self._busy[region_id]

    @contextlib.contextmanager
    def using(self, region_ids: Iterable[int]) -> Iterator[None]:
        """Mark regions as read or written by a running pull for the block: none of
        them is deleted (and unmapped) meanwhile."""
        ids = sorted(set(region_ids))
        self._busy.update(ids)
        try:
            yield
        finally:
            self._busy.subtract(ids)
            for i in ids:
                if self._busy[i] <= 0:
                    del self._busy[i]

    @contextlib.contextmanager
    def writing(self, region_ids: Iterable[int], pull_id: str) -> Iterator[None]:
        """Mark regions as written by running pull ``pull_id`` for the block: no
        version is published from them meanwhile (see :meth:`writers`)."""
        ids = sorted(set(region_ids))
        for i in ids:
            self._writing.setdefault(i, set()).add(pull_id)
        try:
            yield
        finally:
            for i in ids:
                pulls = self._writing.get(i, set())
                pulls.discard(pull_id)
                if not pulls:
                    self._writing.pop(i, None)

    def writers(self, region_id: int) -> list[str]:
        """The ids of the running pulls that write ``region_id``, sorted."""
        return sorted(self._writing.get(region_id, ()))

    # ------------------------------------------------------------ client death

    def _process_exited(self, tag: str) -> None:
        self._exited.add(tag)
        self._orphans |= self._by_process.pop(tag, set())
        log.info("client %s exited: releasing its regions %s", tag, sorted(self._orphans))
        self.reap_soon()

    def reap_soon(self) -> None:
        """Release exited clients' regions in a task (no-op when there are none)."""
        if self._orphans and (self._reaping is None or self._reaping.done()):
            self._reaping = asyncio.get_running_loop().create_task(self.reap())

    async def reap(self, dry_run: bool = False) -> list[RegionInfo]:
        """Release (``dry_run``: only list) every region whose process exited
        and that nothing still needs: no READY, pending or leased version publishes
        from it and no running pull reads or writes it. Those still needed stay
        orphans and are released by a later call, once they are free; a client's
        segment whose creator is gone is unlinked with it."""
        protected = self.registry.protected_regions()
        out: list[RegionInfo] = []
        for rid in sorted(self._orphans):
            if rid not in self.regions:
                self._orphans.discard(rid)
                continue
            if rid in protected or self._busy[rid]:
                continue
            info = self.regions.get(rid)
            out.append(info)
            if dry_run:
                continue
            stale = not info.daemon_owned and (
                creator_tag(info.handle) in self._exited or is_stale(info.handle)
            )
            if stale:  # its name first: once the region is gone, so is its file
                with contextlib.suppress(OSError):
                    (SHM_DIR / info.handle).unlink()
            await self.drop(rid, info)
        return out

    async def gc(self, dry_run: bool = False) -> GcReport:
        """``POST /v1/gc``: free exited clients' regions and stale segments."""
        regions = await self.reap(dry_run)
        segments = stale_segments() if dry_run else await asyncio.to_thread(cleanup_stale)
        return GcReport(dry_run, regions, segments)
