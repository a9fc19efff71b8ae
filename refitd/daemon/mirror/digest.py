"""Chunk digests: a mirror tells a chunk a holder got wrong from the chunk its source holds.

A host mirror reads each chunk of a version from any holder of it: the source, or
another host's mirror. A holder that is not the source can send wrong bytes (a memory
fault, a bug). The source is the only party whose bytes define the version, so it
states the digest of every chunk (:class:`SourceDigests`, served as
``GET /v1/mirrors/{model}/{version}/digests?lease=``); a mirror fetches them once per
version, and checks each batch of chunks it read from another holder as it lands
(:func:`verify`): a chunk that does not match is asked of another holder, and that
holder is dropped from the book.

Why BLAKE3 (the ``blake3`` package, Rust bindings):

- it is a cryptographic hash: a holder that wants a wrong chunk accepted must find a
  second preimage of its digest (2**128 work for the 16 bytes kept), so a checked
  chunk is the source's chunk, whether the holder erred or lied. A CRC or xxHash
  catches a flipped bit but not a chunk made to pass;
- it is fast enough not to cost the fill: one core hashes 2.5 to 3 GB/s on the
  development machine (AVX2), faster than one 10 Gbit/s link delivers, and the
  bindings release the GIL, so the hashing runs in a worker thread beside the event
  loop and the data plane. The source may spread one chunk over several cores
  (``max_threads``).

The chunks are the cut every mirror of the version makes
(:func:`~refitd.daemon.mirror.chunks.cut_chunks` of the version's whole scope at the source,
:func:`~refitd.daemon.mirror.chunks.chunk_bytes` of its bytes), so digest ``i`` is chunk
``i``'s. The wire form is :class:`refitd.wire.digests.ChunkDigests`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

import blake3
import numpy as np
import numpy.typing as npt

from refitd.daemon.mirror.chunks import chunk_bytes, cut_chunks
from refitd.errors import AccessDenied, ConflictError, NotFoundError, ProtocolError, RefitError
from refitd.wire import VersionState
from refitd.wire.digests import DIGEST_BYTES, ChunkDigests
from transports.batch import within
from transports.interface import Scope

if TYPE_CHECKING:
    from refitd.daemon.access.owners import ModelOwners
    from refitd.daemon.mirror.chunks import Mirror
    from refitd.daemon.state.registry import Registry
    from refitd.daemon.state.store import RegionStore

__all__ = [
    "DIGEST_BYTES",
    "KEEP_VERSIONS",
    "SOURCE_THREADS",
    "ChunkDigests",
    "SourceDigests",
    "check_cut",
    "chunk_digests",
    "digest_rows",
    "local_rows",
    "verify",
    "verify_mirror",
]

T = TypeVar("T")

KEEP_VERSIONS = 4
"""A source computes the digests of a model's newest this many versions (READY or
retired; pending ones are not counted) and keeps them; an older version's are refused
(409). Versions only move forward, so a version leaves this window once and never
comes back: its digests are computed at most once in a daemon's life."""

SOURCE_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Cores the source's hashing of one version may use at once (BLAKE3's own threads,
within a chunk): a version's digests are computed once, and the first mirror of it
waits for them before it checks a chunk from another holder."""


# ---------------------------------------------------------------- hashing


def _bytes_of(view: memoryview) -> memoryview:
    """``view`` as one flat run of bytes (a region's view is one already)."""
    mv = memoryview(view)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _check_rows(views: Mapping[int, memoryview], rows: npt.NDArray[np.int64]) -> None:
    """Refuse (:class:`ProtocolError`) a row that names no view or reaches outside its
    view, before any byte is read: a slice past a view's end would hash fewer bytes,
    not fail."""
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise ProtocolError(f"chunk rows are (region, offset, nbytes) triples, got {rows.shape}")
    if not len(rows):
        return
    keys = np.array(sorted(views), dtype=np.int64)
    sizes = np.array([len(_bytes_of(views[int(k)])) for k in keys], dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, rows[:, 0]), max(len(keys) - 1, 0))
    known = (keys[at] == rows[:, 0]) if len(keys) else np.zeros(len(rows), dtype=bool)
    limit = np.where(known, sizes[at] if len(keys) else 0, 0)
    off, n = rows[:, 1], rows[:, 2]
    bad = ~known | ~within(off, n, limit)
    if bool(bad.any()):
        i = int(np.argmax(bad))
        rid, o, k = (int(x) for x in rows[i])
        why = "names no region given" if not known[i] else f"lies outside its {limit[i]} bytes"
        raise ProtocolError(f"chunk {i} (region {rid}, bytes {o}..{o + k}) {why}")


def digest_rows(
    views: Mapping[int, memoryview],
    rows: npt.NDArray[np.int64],
    max_threads: int = 1,
    stop: threading.Event | None = None,
) -> bytes:
    """The BLAKE3 digest (:data:`DIGEST_BYTES` bytes) of each ``(region, offset,
    nbytes)`` row's bytes in ``views[region]``, concatenated in row order. Blocking:
    run it in a worker thread (:func:`chunk_digests`). Stops early, its answer
    incomplete, once ``stop`` is set (checked between rows)."""
    rows = np.asarray(rows, dtype=np.int64)
    _check_rows(views, rows)
    flat = {rid: _bytes_of(v) for rid, v in views.items()}
    out = bytearray(len(rows) * DIGEST_BYTES)
    for i, (rid, off, n) in enumerate(rows.tolist()):
        if stop is not None and stop.is_set():
            break
        h = blake3.blake3(flat[rid][off : off + n], max_threads=max_threads)
        out[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] = h.digest(DIGEST_BYTES)
    return bytes(out)


async def _in_thread(work: Callable[[threading.Event], T]) -> T:
    """``work(stop)`` in a worker thread. Cancelled, it sets ``stop`` and waits for the
    thread to end (one chunk at most) before it lets go: the memory it reads stays
    mapped until then (a daemon unmaps regions only after its tasks ended)."""
    stop = threading.Event()
    done = asyncio.ensure_future(asyncio.to_thread(work, stop))
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([done])
        if done.done() and not done.cancelled():
            done.exception()  # retrieved: its answer is no longer wanted
        raise


async def chunk_digests(
    views: Mapping[int, memoryview], chunks: npt.NDArray[np.int64], max_threads: int = 1
) -> bytes:
    """:func:`digest_rows` of ``chunks`` off the event loop: one worker thread for the
    whole batch (BLAKE3 releases the GIL), which may spread a chunk over
    ``max_threads`` cores. ``views`` maps each region id ``chunks`` names to its
    memory (a region's is :meth:`refitd.daemon.app.node.Daemon.view`)."""
    rows = np.asarray(chunks, dtype=np.int64).reshape(-1, 3)
    return await _in_thread(lambda stop: digest_rows(views, rows, max_threads, stop))


# ---------------------------------------------------------------- the mirror's check


def check_cut(expected: ChunkDigests, chunks: npt.NDArray[np.int64]) -> None:
    """Refuse (:class:`ProtocolError`) digests that are not of the cut ``chunks``
    (``(source region, offset, nbytes)`` rows, as the mirror cut them): another count,
    other bytes or a larger chunk size would check a chunk against another chunk's
    digest."""
    rows = np.asarray(chunks, dtype=np.int64).reshape(-1, 3)
    nbytes = int(rows[:, 2].sum()) if len(rows) else 0
    largest = int(rows[:, 2].max()) if len(rows) else 0
    why = ""
    if expected.chunks != len(rows):
        why = f"{expected.chunks} chunks, this mirror cut {len(rows)}"
    elif len(expected.digests) != expected.chunks * DIGEST_BYTES:
        why = f"{len(expected.digests)} bytes of digests for {expected.chunks} chunks"
    elif expected.nbytes != nbytes:
        why = f"{expected.nbytes} bytes in all, this mirror's chunks hold {nbytes}"
    elif largest > expected.chunk_bytes:
        why = f"chunks of {expected.chunk_bytes} bytes, this mirror has one of {largest}"
    if why:
        raise ProtocolError(f"the source's chunk digests do not fit this mirror's chunks: {why}")


def local_rows(chunks: npt.NDArray[np.int64], regions: Mapping[int, int]) -> npt.NDArray[np.int64]:
    """``chunks`` (``(source region, offset, nbytes)``) with each source region id
    replaced by this daemon's region id of it (``regions``: source id -> local id, as
    a mirror's ``regions`` map them). :class:`ProtocolError` for a source region
    ``regions`` does not map."""
    rows = np.array(chunks, dtype=np.int64).reshape(-1, 3)
    if not len(rows):
        return rows
    keys = np.array(sorted(regions), dtype=np.int64)
    if not len(keys):
        raise ProtocolError(f"chunk of source region {int(rows[0, 0])}: no region is mapped")
    at = np.minimum(np.searchsorted(keys, rows[:, 0]), len(keys) - 1)
    unknown = keys[at] != rows[:, 0]
    if bool(unknown.any()):
        rid = int(rows[int(np.argmax(unknown)), 0])
        raise ProtocolError(f"chunk of source region {rid}: this mirror holds no region of it")
    rows[:, 0] = np.array([regions[int(k)] for k in keys], dtype=np.int64)[at]
    return rows


async def verify(
    views: Mapping[int, memoryview],
    chunks: npt.NDArray[np.int64],
    regions: Mapping[int, int],
    expected: ChunkDigests,
    idx: npt.ArrayLike | None = None,
    max_threads: int = 1,
) -> npt.NDArray[np.int64]:
    """The indices (into ``chunks``), sorted, of the chunks among ``idx`` (default:
    every one) whose bytes here do not match ``expected``: an empty array when all
    match.

    ``chunks`` is the version's whole cut as the mirror made it (``(source region,
    offset, nbytes)`` rows, ``Mirror.chunks``); ``regions`` maps each source region id
    to this daemon's region id (``{s: r.region_id for s, r in Mirror.regions.items()}``);
    ``views`` maps those local ids to their memory; ``expected`` is what the source
    answered (checked against the cut first, :func:`check_cut`). Hashes off the event
    loop, one worker thread per call (a chunk spread over ``max_threads`` cores): call
    it once per batch of chunks as they land, while nothing else writes them."""
    check_cut(expected, chunks)
    rows = np.asarray(chunks, dtype=np.int64).reshape(-1, 3)
    which = (
        np.arange(len(rows), dtype=np.int64)
        if idx is None
        else np.asarray(idx, dtype=np.int64).reshape(-1)
    )
    if len(which) and (int(which.min()) < 0 or int(which.max()) >= len(rows)):
        raise ProtocolError(f"chunk indices {which.tolist()[:8]} outside 0..{len(rows) - 1}")
    got = await chunk_digests(views, local_rows(rows[which], regions), max_threads)
    want = np.frombuffer(expected.digests, dtype=np.uint8).reshape(-1, DIGEST_BYTES)[which]
    have = np.frombuffer(got, dtype=np.uint8).reshape(-1, DIGEST_BYTES)
    return np.unique(which[(have != want).any(axis=1)])


async def verify_mirror(
    store: RegionStore,
    m: Mirror,
    expected: ChunkDigests,
    idx: npt.ArrayLike,
    max_threads: int = 1,
) -> npt.NDArray[np.int64]:
    """:func:`verify` of chunks ``idx`` of mirror ``m``, in its own regions of
    ``store``, which stay mapped meanwhile (``store.using``: none is deleted while it
    hashes). The chunks must be in regions ``m`` made already."""
    local = {s: r.region_id for s, r in m.regions.items()}
    ids = sorted(local.values())
    with store.using(ids):
        views = {rid: store.view(rid) for rid in ids}
        return await verify(views, m.chunks, local, expected, idx, max_threads)


# ---------------------------------------------------------------- the source's cache


class SourceDigests:
    """The chunk digests of the versions this daemon is the source of, each computed
    at most once: the first request of a version starts its computation and every
    request meanwhile awaits that same one; the answer (or the refusal it ended with:
    a version never changes) is kept.

    Bounded (docs/trust.md: what a request makes the daemon compute is bounded
    before it starts): only a caller holding a live lease on the version here asks
    (409 otherwise, 403 with none named); a model's digests are computed only for its
    newest :data:`KEEP_VERSIONS` versions, and kept only for those (at most
    ``KEEP_VERSIONS`` per model, 16 bytes a chunk); a version retired with no live
    lease left (none can be taken on it again) loses its digests when another version
    of its model is first asked for; one computation runs at a time on the daemon, on
    at most ``max_threads`` cores.

    Built with the daemon's ``registry`` (the leases, versions and scopes asked of),
    region ``store`` (the bytes hashed) and model owners (``models``: the models it
    holds as mirrors, whose digests are their source's to give)."""

    def __init__(
        self,
        registry: Registry,
        store: RegionStore,
        models: ModelOwners,
        keep: int = KEEP_VERSIONS,
        max_threads: int = SOURCE_THREADS,
    ) -> None:
        self.registry = registry
        self.store = store
        self.models = models
        self.keep = keep
        self.max_threads = max_threads
        self._kept: dict[tuple[str, int], asyncio.Task[ChunkDigests]] = {}
        self._one = asyncio.Semaphore(1)
        #: computations started in this daemon's life (one per version at most)
        self.computed = 0

    async def get(self, model: str, version: int, lease_id: str) -> ChunkDigests:
        """The digests of ``model`` ``version``'s chunks, for a caller holding
        ``lease_id``, a live lease on that version here."""
        what = f"chunk digests of {model!r} version {version}"
        if not lease_id:
            raise AccessDenied(
                f"{what} refused: they are read under a live lease on that version at its "
                "source (?lease=)"
            )
        try:
            self.registry.check(lease_id, model, version)
        except ConflictError as exc:
            raise ConflictError(f"{what} refused: {exc}") from None
        return await asyncio.shield(self._task(model, version, what))

    def prepare(self, model: str, version: int) -> None:
        """Start computing the digests of ``model`` ``version`` now, if they are to
        be (a peer daemon joined its holder book: its mirror will ask for them once it
        reads a chunk from another holder). A refusal waits for the request it is
        the answer to."""
        with contextlib.suppress(RefitError):
            _ = self._task(model, version, f"chunk digests of {model!r} version {version}")

    def _task(self, model: str, version: int, what: str) -> asyncio.Task[ChunkDigests]:
        """The computation of ``model`` ``version``'s digests, started if new."""
        if self.models.held(model):
            raise ConflictError(
                f"{what} refused: this daemon holds {model!r} as a host mirror, not as its "
                "source; a chunk's digest is asked of the source, whose bytes define it"
            )
        key = (model, version)
        task = self._kept.get(key)
        if task is None:
            # Swept when a version is first asked for (each new version is), not on
            # every request: a request of kept digests costs no scan of the registry.
            self._forget(model)
            newest = self._newest(model)
            if version not in newest:
                raise ConflictError(
                    f"{what} refused: this daemon computes the digests of a model's newest "
                    f"{self.keep} versions ({sorted(newest)}), and that version is older; "
                    "read its chunks from the source itself"
                )
            # Read now, under the lease just checked: a version's scope never changes.
            scope = self.registry.scope(model, version)
            task = asyncio.create_task(self._compute(what, scope))
            task.add_done_callback(_retrieved)
            self._kept[key] = task
            self.computed += 1
        return task

    def kept(self) -> list[tuple[str, int]]:
        """The ``(model, version)`` whose digests are kept (or being computed), sorted."""
        return sorted(self._kept)

    def _newest(self, model: str) -> set[int]:
        ever_ready = [
            v.version for v in self.registry.versions(model) if v.state is not VersionState.PENDING
        ]
        return set(sorted(ever_ready)[-self.keep :])

    def _forget(self, model: str) -> None:
        """Drop the digests of ``model``'s versions past the newest :attr:`keep` and of
        those retired with no live lease left (nobody can ask for them again)."""
        mine = [k for k in self._kept if k[0] == model]
        if not mine:
            return
        newest = self._newest(model)
        for key in mine:
            try:
                info = self.registry.version(*key)
                gone = info.state is VersionState.RETIRED and info.leases == 0
            except NotFoundError:
                gone = True
            if gone or key[1] not in newest:
                del self._kept[key]  # a computation still running ends on its own

    async def _compute(self, what: str, scope: Scope) -> ChunkDigests:
        async with self._one:
            total = sum(end - start for ext in scope.values() for start, end in ext)
            size = chunk_bytes(total)
            ids = sorted(scope)
            kinds = self.store.device_kinds(ids)
            if kinds:
                raise ConflictError(
                    f"{what} refused: the version's regions include {', '.join(kinds)} "
                    "memory, and digests are made of host memory only (as a mirror reads "
                    "only host memory of a remote source)"
                )
            with self.store.using(ids):  # none is deleted (and unmapped) meanwhile
                views = {rid: self.store.view(rid) for rid in ids}

                def work(stop: threading.Event) -> tuple[int, bytes]:
                    rows = cut_chunks(dict(scope), size)
                    return len(rows), digest_rows(views, rows, self.max_threads, stop)

                count, digests = await _in_thread(work)
        return ChunkDigests(size, count, total, digests)

    async def close(self) -> None:
        """Cancel the computations still running, and wait for their threads."""
        tasks = [t for t in self._kept.values() if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._kept.clear()


def _retrieved(task: asyncio.Task[ChunkDigests]) -> None:
    """Mark a computation's refusal as seen: every request that awaited it got it."""
    if not task.cancelled():
        task.exception()
