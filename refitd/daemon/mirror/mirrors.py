"""Host mirrors and relay: each version crosses each host's link about once.

A *mirror* is one daemon's copy of a version a remote source daemon (the trainer's)
holds: every byte range a lease on it may read, pulled once over the network into
regions this daemon owns, and published in this daemon's own registry under the same
model and version. The local engines' pulls from that source are then served from
the mirror over ``shm`` (:meth:`Mirrors.redirect`), however many replicas read it.

Relay. A mirror is itself a *holder*: it joins the source's holder book
(``POST /v1/mirrors/holders`` at the source), which answers with the holder it reads
from (:mod:`refitd.daemon.mirror.book`): the source has one child, so its link
carries each byte about once per version, whatever the number of hosts; the holders
form a chain up to four hosts and a tree of degree two past them. A downstream
mirror reads from its upstream under a lease of the upstream's own registry (a peer
daemon's, :class:`~refitd.daemon.mirror.leases.MirrorLeases`), through the upstream's
data plane and its signed, lease-scoped records, like any pull; and it reads only *complete*
chunks: while a mirror fills, the scope its records give a lease is cut down to the
chunks it holds in full (:meth:`~refitd.daemon.mirror.hold.FillingMirrors.limit_scope`),
so the data server refuses any byte of an incomplete chunk. A downstream learns of new
chunks from its upstream's feed (:mod:`refitd.daemon.mirror.feed`): one request, a frame of new
records each time chunks complete there, no round trip per chunk.

Local reads. An engine's pull served from a mirror starts once the mirror's regions
exist, not once it is complete: it reads each piece as soon as its chunk is
(:class:`~refitd.daemon.mirror.read.MirrorGate`), under the same lease rules.

Fail-closed. A chunk is marked complete only once the read that filled it returned
without error; a read that failed leaves its chunks incomplete. When an upstream
relay dies, stops answering (its reads and its feed have deadlines) or fails, the
mirror asks the source for another holder, excluding the ones that failed, and reads
the chunks it still lacks from there (the source itself last). If even the source
fails, the mirror fails, naming every holder it tried, and so do the local pulls
reading it (their ranges suspect: nothing is installed from them). A complete mirror
never changes.

Policy (``[mirrors] policy``): ``never`` (default: every pull reads its source),
``always`` (the first pull of a remote version makes the mirror), ``shared`` (a
mirror once two or more distinct leases on the same remote version pull through
this daemon; from then on the later versions of that model are mirrored from their
first pull). Release: a mirror goes once its version is retired here (a newer
version of the model was mirrored) and no lease on it is live.

Wiring. :class:`Mirrors` is built with the owners it uses, never the whole daemon:
the registry, the region store, the model owners, the data planes, the node's
identity, its ``[mirrors]`` section, and the daemon's table of mirrors still filling
(:class:`~refitd.daemon.mirror.hold.FillingMirrors`). Two other parts consult the
mirrors, and neither gets a hook set on it after it is built:

- the daemon's lease rules ask the table of mirrors still filling what a lease may
  read (:meth:`~refitd.daemon.mirror.hold.FillingMirrors.limit_scope`): the daemon
  makes that table and the mirrors are built with it, so the one rule of "only complete
  chunks are read" has one owner, read by the data plane and the records alike;
- the pull manager is built with the mirrors (its ``mirrors``, a
  :class:`~refitd.daemon.pull.pulls.Redirector`) and asks :meth:`Mirrors.redirect`
  of each pull of a remote source. The mirrors fill through the byte loop of the
  manager that asks (a fill is a pull of that manager), lent with each call. The
  manager needs the mirrors and a fill needs the manager, so one of the two meets the
  other only after it is built; a call argument does that with no attribute set from
  outside, no half-built object and no factory, and the mirrors keep no manager.
  (Why not an event: a redirect answers the pull, it does not just follow it, so it is
  a question asked of one owner, not news told to whoever listens.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from refitd.client.leases import held_lease
from refitd.daemon.mirror.chunks import CHUNK_BYTES, HolderBook, Mirror, chunk_count, cut_chunks
from refitd.daemon.mirror.fill import LEASE_TTL_S, Filler
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.daemon.mirror.judge import describe
from refitd.daemon.mirror.leases import OWNER, MirrorLeases
from refitd.daemon.mirror.read import MirroredSource
from refitd.daemon.mirror.space import half_of_shm, held_bytes, make_room, release, take_over
from refitd.daemon.pull.sources import Redirect, RemoteSource
from refitd.daemon.state.plane import HoldsReads
from refitd.errors import ConflictError, NotFoundError, RefitError, TransportError
from refitd.wire import (
    DescriptorTable,
    LeaseInfo,
    ManifestIn,
    PeerRegions,
    PullRequest,
    RegionCreate,
    ShardEntry,
    TensorEntry,
)
from refitd.wire.mirrors import HolderAssign, HolderJoin, MirrorState

if TYPE_CHECKING:
    from refitd.config import MirrorsConfig
    from refitd.daemon.access.owners import ModelOwners
    from refitd.daemon.pull.pulls import PullManager
    from refitd.daemon.state.plane import TransportSet
    from refitd.daemon.state.registry import Registry
    from refitd.daemon.state.store import RegionStore

__all__ = [
    "CHUNK_BYTES",
    "POLICIES",
    "HolderAssign",
    "HolderBook",
    "HolderJoin",
    "Mirror",
    "MirrorState",
    "Mirrors",
    "Redirect",
]

log = logging.getLogger("refitd.mirrors")

POLICIES = ("never", "always", "shared")
"""``[mirrors] policy`` values (see the module docstring)."""


# ---------------------------------------------------------------- the store


class Mirrors:
    """Every mirror of one daemon, its policy, and (as a source) its holder book.

    Built with what it uses (see the module docstring): ``config`` (``[mirrors]``),
    the daemon's ``registry``, region ``store``, model owners (``models``), data
    planes (``plane``) and table of mirrors still filling (``filling``, which it
    alone changes); ``remote(url)`` is the trusted peer daemon at ``url`` (400 for
    one this daemon does not trust), ``self_url()`` the URL other daemons read this
    one at; ``node_id`` and ``secret`` sign what it asks of its peers, and
    ``pull_timeout_s`` bounds a fill's reads (``[data_plane]``). ``lease_changed()``
    is called once a lease it took here ends (drains wake, freed regions go)."""

    def __init__(
        self,
        config: MirrorsConfig,
        *,
        registry: Registry,
        store: RegionStore,
        models: ModelOwners,
        plane: TransportSet,
        filling: FillingMirrors,
        remote: Callable[[str], RemoteSource],
        self_url: Callable[[], str],
        node_id: str,
        secret: bytes,
        pull_timeout_s: float,
        lease_changed: Callable[[], None],
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"mirror policy {config.policy!r}: expected one of {POLICIES}")
        self.policy = config.policy
        self.registry = registry
        self.store = store
        self.models = models
        self.plane = plane
        self._remote = remote
        self.self_url = self_url
        self.node_id = node_id
        self.secret = secret
        self.pull_timeout_s = pull_timeout_s
        self.lease_changed = lease_changed
        self.book = HolderBook()
        #: the lease rules of this daemon's mirrors (granted under a source lease)
        self.leases = MirrorLeases(registry, models, self.find, remote)
        self.budget = config.max_bytes if config.max_bytes is not None else half_of_shm()
        self.by_key: dict[tuple[str, str, int], Mirror] = {}
        #: (source, model, version) -> distinct leases seen pulling it (``shared``)
        self._readers: dict[tuple[str, str, int], set[str]] = {}
        #: (source, model) seen with two or more readers of one version
        self._shared: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: what the data plane holds a downstream's read ahead of a chunk on, and what
        #: the daemon's records let a lease read of a mirror still filling
        self.filling = filling

    # ------------------------------------------------------------ policy

    def wants(self, req: PullRequest) -> bool:
        """Whether ``req`` (from a remote source) should read through a mirror."""
        if not req.source or self.policy == "never":
            return False
        key = (req.source.rstrip("/"), req.model, req.version)
        if self.policy == "always" or key in self.by_key:
            return True
        seen = self._readers.setdefault(key, set())
        seen.add(req.lease_id)
        if len(self._readers) > 256:  # bounded: forget the oldest versions seen
            self._readers.pop(next(iter(self._readers)))
        if len(seen) >= 2:
            self._shared.add(key[:2])
        return key[:2] in self._shared

    # ------------------------------------------------------------ local reads

    async def redirect(self, req: PullRequest, owner: str, pulls: PullManager) -> Redirect | None:
        """``req`` rewritten to read this daemon's mirror of its version (made first if
        needed, filled through ``pulls``: its manager's byte loop), under a lease of
        this daemon; None when the policy says to read the source directly, or the
        version cannot be mirrored here (an older version than one this daemon
        already holds of the model). The pull starts as soon as the mirror's regions
        exist, and reads each piece once its chunk is complete.

        Raises :class:`TransportError` naming every holder tried when the mirror
        failed before the pull began: the pull fails before any byte moved."""
        if not req.source or self.policy == "never":
            return None
        # The engine's lease at the source is what entitles it to the version: checked
        # there first, as for a direct pull, so a mirror never serves a version the
        # source would refuse this caller, and a made-up lease neither reads a mirror
        # nor counts toward the shared policy (ConflictError, nothing moved). A pull that
        # presents the records the source granted that very lease (MAC-verified) shows
        # it without a round trip. The pull checks it again at submit and after its
        # last byte (MirroredSource).
        remote = self._remote(req.source)
        if remote.granted(req) is None:
            await remote.check_lease(req.lease_id, req.model, req.version)
        if not self.wants(req):
            return None
        m = await self.mirror(req.source.rstrip("/"), req.model, req.version, pulls)
        if m is None:
            return None
        if m.error:
            raise TransportError(
                f"pull of {req.model!r} version {req.version} refused: this host's mirror of "
                f"it failed, nothing was read from it: {m.error}"
            )
        lease = self.registry.acquire(req.model, req.version, LEASE_TTL_S, owner=owner)
        local = {s: r.region_id for s, r in m.regions.items()}
        rows = req.descriptors.rows().copy()
        # Mapped in one vectorised pass: a Python loop per row held the event loop
        # for about a second at a request's size bound.
        keys = np.array(sorted(local), dtype=np.int64)
        at = np.minimum(np.searchsorted(keys, rows[:, 0]), max(len(keys) - 1, 0))
        unknown = [int(x) for x in rows[:, 0][keys[at] != rows[:, 0]][:1]] if len(keys) else []
        if len(keys) == 0 and len(rows):
            unknown = [int(rows[0, 0])]
        unknown += [p.src_region for p in req.pack_specs if p.src_region not in local][:1]
        if unknown:
            self.registry.release(lease.lease_id)
            raise ConflictError(
                f"pull refused: source region {unknown[0]} is not part of {req.model!r} "
                f"version {req.version}; nothing was transferred"
            )
        if len(rows):
            rows[:, 0] = np.array([local[int(k)] for k in keys], dtype=np.int64)[at]
        specs = [msgspec.structs.replace(p, src_region=local[p.src_region]) for p in req.pack_specs]
        out = PullRequest(
            req.model, req.version, lease.lease_id, DescriptorTable.pack(rows), specs, ""
        )

        def release() -> None:
            with contextlib.suppress(RefitError):
                self.registry.release(lease.lease_id)
            self.lease_changed()
            self._spawn(self.sweep())

        source = MirroredSource(pulls.source_for(""), self.registry, remote, req, m)
        return Redirect(out, release, source)

    # ------------------------------------------------------------ making one

    async def mirror(
        self, source: str, model: str, version: int, pulls: PullManager
    ) -> Mirror | None:
        """The mirror of ``model`` ``version`` of ``source``: started now if new (its
        regions made and published here before this returns, its bytes read through
        ``pulls``), None if this daemon cannot hold it."""
        key = (source, model, version)
        m = self.by_key.get(key)
        if m is None:
            m = self.by_key[key] = Mirror(source, model, version)
            task = asyncio.create_task(self._run(m, self._filler(pulls)))
            m.task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await m.ready.wait()
        if m.error and not m.regions:
            self.by_key.pop(key, None)
            if m.error.startswith("cannot mirror"):
                return None
        return m

    def _filler(self, pulls: PullManager) -> Filler:
        """What fills a mirror through ``pulls``' byte loop."""
        return Filler(
            pulls,
            node_id=self.node_id,
            secret=self.secret,
            pull_timeout_s=self.pull_timeout_s,
            store=self.store,
            self_url=self.self_url,
            remote=self._remote,
            landed=self.filling.changed,
        )

    async def _run(self, m: Mirror, filler: Filler) -> None:
        src = self._remote(m.source)
        client = src.client
        # Join the source's holder book now, while the lease, the records and the
        # regions are made: its round trip to a busy source is then off the path to
        # the first byte (a relay's lease on this mirror waits for its regions).
        joined = asyncio.create_task(filler.assign(src, m, []))
        try:
            # The grant brings the version's manifest and the source's records of it;
            # the lease is held until the mirror is complete or failed.
            acquiring = client.acquire_lease(m.model, m.version, LEASE_TTL_S, manifest=True)
            async with held_lease(client, acquiring, LEASE_TTL_S) as kept:
                grant = kept.granted
                # The regions are made while the filler opens its upstream (a relay's
                # lease, feed and data path): its first read goes out once they exist.
                prepared = asyncio.create_task(self._prepare(m, src, grant))
                fill = filler.fill(m, src, grant.lease_id, joined, prepared)
                filling = asyncio.create_task(fill)
                try:
                    if await prepared is not None:
                        await filling
                finally:
                    for t in (filling, prepared):
                        t.cancel()
                    await asyncio.gather(filling, prepared, return_exceptions=True)
            m.completed_at = time.time()
            self.filling.remove(m)  # complete: no read of it is held any more
            log.info(
                "mirror of %r version %d from %s complete in %.2f s (read from %s)",
                m.model,
                m.version,
                m.source,
                m.completed_at - m.began_at,
                ", then ".join(m.tried),
            )
        except asyncio.CancelledError:
            m.error = m.error or "cancelled: the daemon is stopping"
            raise
        except Exception as exc:  # every failure ends the mirror, named; never a hang
            m.error = m.error or describe(exc)
            if m.regions:  # published here: no lease may be granted on it any more
                with contextlib.suppress(RefitError):
                    self.registry.retire(m.model, m.version)
            if not isinstance(exc, RefitError):
                log.error("mirror of %r version %d failed", m.model, m.version, exc_info=exc)
        finally:
            joined.cancel()  # done by now unless the mirror failed first
            m.ready.set()
            m.notify()
            self.filling.changed()  # a failed mirror's held reads are refused now

    async def _prepare(self, m: Mirror, src: RemoteSource, grant: LeaseInfo) -> PeerRegions | None:
        """Make the mirror's regions, one per source region of the version, and publish
        the version here over them (so relays can lease it); the source's records of
        them under the lease ``grant`` (as it granted them, else asked for), or None
        when this daemon cannot mirror it (``m.error`` says why)."""
        registry, store = self.registry, self.store
        newest = {v.version for v in registry.versions(m.model)}
        if newest and max(newest) >= m.version:
            m.error = (
                f"cannot mirror {m.model!r} version {m.version}: this daemon already holds "
                f"version {max(newest)} of it"
            )
            return None
        manifest = grant.manifest or await src.client.manifest(m.model, m.version)
        ids = sorted({s.region for t in manifest.tensors for s in t.shards})
        probe = PullRequest(m.model, m.version, grant.lease_id, DescriptorTable.pack(_no_rows()))
        given = src.answered(grant.records) if grant.records is not None else None
        if given is not None and sorted(r.region_id for r in given.regions) == ids:
            peer = given
        else:
            peer = await src.regions(ids, probe)
        m.chunks = cut_chunks({int(k): v for k, v in peer.scope.items()})  # chunk_bytes
        m.done = np.zeros(len(m.chunks), dtype=bool)
        m.layout = frozenset(r.region_id for r in peer.regions)
        m.planned.set()  # a relay's lease and feed go on while the regions are made
        # What the daemon makes on its own behalf is bounded: the mirror's bytes are
        # counted (from before any region is made, so two mirrors preparing at once
        # see each other) against the host's mirror budget; retired, then idle ones go first.
        need = sum(r.nbytes for r in peer.regions)
        sizes = {r.region_id: r.nbytes for r in peer.regions}
        taken = take_over(registry, store, self.by_key, m, sizes, self.filling.remove)
        if taken:  # those bytes were in the budget already: now they are this mirror's
            m.nbytes = need
        elif not await make_room(
            registry, store, self.by_key, need, self.budget, m, self.filling.remove
        ):
            m.error = (
                f"cannot mirror {m.model!r} version {m.version}: its {need} bytes do not fit "
                f"the host's mirror budget ({self.held_bytes()} of {self.budget} bytes held, "
                "[mirrors] max_bytes); its pulls read the source"
            )
            log.warning("%s", m.error)
            return None
        # The mirrored model is the daemon's on this host, as the version is the
        # source's owners' there: no tenant publishes into, drains or retires it.
        try:
            self.models.hold(m.model, OWNER)
        except ConflictError as exc:
            m.error = (
                f"cannot mirror {m.model!r} version {m.version}: {exc}; its pulls read the source"
            )
            log.warning("%s", m.error)
            m.nbytes = 0
            for r in taken.values():  # retired and unleased: nothing protects them
                with contextlib.suppress(RefitError):
                    await store.delete(r.region_id)
            return None
        m.nbytes = need
        try:
            m.regions.update(taken)
            for r in peer.regions:
                if r.region_id not in m.regions:
                    m.regions[r.region_id] = await store.create_region(
                        RegionCreate(r.nbytes, owner=OWNER, label="mirror")  # names no model
                    )
            tensors = [
                TensorEntry(
                    t.name,
                    t.shape,
                    t.dtype,
                    [
                        ShardEntry(s.offset, s.shape, m.regions[s.region].region_id, s.byte_offset)
                        for s in t.shards
                    ],
                )
                for t in manifest.tensors
            ]
            self._hold_reads(m)  # before any lease on it exists
            registry.publish(ManifestIn(m.model, m.version, 0, 1, tensors))
        except BaseException:
            self.filling.remove(m)
            for r in m.regions.values():
                with contextlib.suppress(RefitError):
                    await store.delete(r.region_id)
            m.regions.clear()
            m.nbytes = 0
            raise
        m.ready.set()
        self._spawn(self.sweep())
        return peer

    def _hold_reads(self, m: Mirror) -> None:
        """Reads of ``m``'s chunks not complete yet are held by every data plane that
        can hold them (``tcp``), and refused by the rest (their scope)."""
        self.filling.add(m)
        for t in self.plane.by_scheme.values():
            if isinstance(t, HoldsReads):
                t.hold_reads(self.filling)

    # ------------------------------------------------------------ serving

    def chunk_count(self, model: str, version: int) -> int:
        """How many chunks a mirror cuts ``model`` ``version`` of this daemon into
        (as every mirror of it cuts its whole scope): counted per byte range of the
        registry's cached scope, no chunk made."""
        return chunk_count(self.registry.scope(model, version))

    def held_bytes(self) -> int:
        """Bytes every mirror of this daemon holds, or is about to make."""
        return held_bytes(self.by_key.values())

    def state(self, m: Mirror) -> MirrorState:
        return m.state(self.held_bytes(), self.budget)

    def find(self, model: str, version: int) -> Mirror:
        for m in self.by_key.values():
            if (m.model, m.version) == (model, version):
                return m
        raise NotFoundError(f"no mirror of {model!r} version {version} on this daemon")

    # ------------------------------------------------------------ release

    async def sweep(self) -> list[int]:
        """Delete the regions of every mirror whose version is retired here and no
        longer leased; returns the region ids freed."""
        return await release(self.registry, self.store, self.by_key, self.filling.remove)

    def _spawn(self, coro: Awaitable[object]) -> None:
        async def run() -> None:
            await coro

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _no_rows() -> np.ndarray:
    return np.zeros((0, 5), dtype=np.int64)
