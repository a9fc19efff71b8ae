"""The pure core of a pull: validation, path choice, pacing, suspect ranges, outcomes.

No ``await``, no sockets, no daemon: every function here takes values and returns
values or raises a :class:`~refitd.errors.RefitError` naming what is refused.
:mod:`refitd.daemon.pull.pulls` calls them around its awaits (the lease check, the
source's records, the staging pack, the data plane's reads).

Rows are the wire layout of descriptors, ``(src_region, src_offset, dst_region,
dst_offset, nbytes)`` (int64, bytes); a pack spec's strides are in elements of its
``itemsize`` (see :class:`refitd.wire.PackSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from refitd.daemon.access.trust import check_pack_reads, check_reads
from refitd.daemon.pull.paths import AUTO, SHM_ONLY
from refitd.daemon.pull.plancheck import runs_of, validate_descriptors, validate_plan
from refitd.errors import ProtocolError, RefitError, TransportError
from refitd.wire import (
    DescriptorTable,
    ErrorBody,
    MemoryKind,
    PackSpec,
    PeerRegions,
    PullRequest,
    StagedPack,
)
from transports.batch import ReadBatch, read_spans, rows_as_batch, split_pieces, suspect_ranges
from transports.interface import Capabilities

__all__ = [
    "BATCH_BYTES",
    "TRANSPORT_PACE",
    "Pace",
    "cancelled",
    "check_plan",
    "check_staged",
    "cut",
    "direct_reads",
    "dst_ids",
    "failed",
    "forced",
    "merge_peer",
    "pace_for",
    "peer_devices",
    "placed",
    "refuse_peer_devices",
    "scope_check",
    "shm_refused",
    "source_gone",
    "source_ids",
    "source_name",
    "spans",
    "staged_by_source",
    "staged_rows",
    "suspect",
    "total_bytes",
    "tries_shm",
    "widened",
]


# ---------------------------------------------------------------- what a pull touches


def source_ids(rows: np.ndarray, specs: list[PackSpec]) -> list[int]:
    """The source regions of a pull's descriptor ``rows`` and pack ``specs``, sorted."""
    return sorted({int(x) for x in np.unique(rows[:, 0])} | {p.src_region for p in specs})


def dst_ids(rows: np.ndarray, specs: list[PackSpec]) -> set[int]:
    """The destination regions of a pull's descriptor ``rows`` and pack ``specs``."""
    return {int(x) for x in np.unique(rows[:, 2])} | {p.dst_region for p in specs}


def total_bytes(rows: np.ndarray, specs: list[PackSpec]) -> int:
    """Bytes a pull moves: its descriptors' and its packed blocks'."""
    return int(rows[:, 4].sum()) + sum(p.nbytes for p in specs)


# ---------------------------------------------------------------- validation


def scope_check(peer: PeerRegions, req: PullRequest) -> str:
    """Refuse records not given under ``req``'s lease; name that lease for refusals."""
    if peer.lease_id != req.lease_id:
        raise ProtocolError(
            f"region records from {peer.node_id!r} refused: they were given under lease "
            f"{peer.lease_id!r}, not the pull's {req.lease_id!r}; nothing was transferred"
        )
    return f"{req.model!r} version {req.version} read under lease {req.lease_id!r}"


def check_plan(
    rows: np.ndarray, req: PullRequest, peer: PeerRegions | None, dst_sizes: dict[int, int]
) -> None:
    """Refuse a pull (nothing moved) whose descriptors or pack specs leave the source's
    regions (as ``peer``'s records state them) or this daemon's (``dst_sizes``), or
    read outside what the source's records say the pull's lease may read. The
    refusal names the first offending descriptor or pack spec."""
    src_sizes = {r.region_id: r.nbytes for r in peer.regions} if peer else {}
    validate_plan(rows, req.pack_specs, src_sizes, dst_sizes)
    if peer is not None:
        what = scope_check(peer, req)
        check_reads(rows, peer.scope, what)
        check_pack_reads(req.pack_specs, peer.scope, what)


def staged_rows(staged: StagedPack, specs: list[PackSpec]) -> np.ndarray:
    """The descriptor rows that read each packed block back from the staging region
    at the offsets the source sent (not yet checked: see :func:`check_staged`)."""
    return np.array(
        [
            (staged.region.region_id, o, p.dst_region, p.dst_offset, p.nbytes)
            for p, o in zip(specs, staged.offsets, strict=True)
        ],
        dtype=np.int64,
    ).reshape(-1, 5)


def check_staged(
    extra: np.ndarray, staging: PeerRegions, req: PullRequest, dst_sizes: dict[int, int]
) -> None:
    """The staging record comes authenticated like any other region, scoped to the
    pull's lease, and the rows reading it back (``extra``) are checked like any
    descriptor: in bounds of that record, inside its scope."""
    what = scope_check(staging, req)
    validate_descriptors(
        DescriptorTable.pack(extra), {r.region_id: r.nbytes for r in staging.regions}, dst_sizes
    )
    check_reads(extra, staging.scope, what)


def merge_peer(a: PeerRegions, b: PeerRegions) -> PeerRegions:
    """``a``'s records with ``b``'s regions (a staging record) added: ``a`` wins on ids
    both list; ``b``'s scopes and advertisements are added, its advertisements winning
    (its same-host one lists every region the lease reads, the staging region too)."""
    seen = {r.region_id for r in a.regions}
    return PeerRegions(
        a.node_id,
        a.incarnation,
        a.transport,
        a.regions + [r for r in b.regions if r.region_id not in seen],
        b.advert or a.advert,
        a.lease_id,
        {**a.scope, **b.scope},
        {**a.adverts, **b.adverts},
    )


# ---------------------------------------------------------------- path choice


def shm_refused(mode: str, node_id: str, refusal: str) -> str:
    """Why a pull from ``node_id`` does not read through ``shm`` (``refusal``: why the
    ``shm`` transport did not connect), for the remote choice to name. Raises
    :class:`TransportError` (nothing moved) when ``mode`` is ``shm``: no other path
    is allowed."""
    if mode == SHM_ONLY:
        raise TransportError(
            f"pull from {node_id!r} refused before any byte moved: this daemon "
            "runs the shared-memory path only (--transport shm), and that path is "
            f"refused: {refusal}"
        )
    return refusal


def peer_devices(peer: PeerRegions) -> list[int]:
    """The regions of ``peer``'s records that are GPU memory (no data plane reads them
    as they are: the source stages them, see :func:`staged_by_source`)."""
    return [r.region_id for r in peer.regions if r.kind is not MemoryKind.HOST]


def refuse_peer_devices(peer: PeerRegions, mode: str) -> None:
    """Refuse (:class:`TransportError`, nothing moved) a pull reading another daemon's
    GPU regions on the ``shm``-only path: it maps a peer's segments by name, and a
    GPU allocation has none. Other paths read them through the source's staging."""
    gpu = peer_devices(peer)
    if gpu and mode == SHM_ONLY:
        raise TransportError(
            f"pull from {peer.node_id!r} refused before any byte moved: its region(s) "
            f"{gpu} are GPU memory, which only the daemon holding them reads, and this "
            "daemon runs the shared-memory path only (--transport shm); see docs/gpu.md"
        )


def staged_by_source(
    rows: np.ndarray, specs: list[PackSpec], devices: list[int]
) -> tuple[np.ndarray, list[PackSpec]]:
    """``rows`` without those reading ``devices`` (GPU regions of the source), and
    ``specs`` with each of those as a one-run pack spec: the source copies them into
    a host staging region through its engine, and the pull reads that region as it
    reads any packed block. The bytes land exactly where the rows said."""
    from_gpu = np.isin(rows[:, 0], np.array(devices, dtype=np.int64))
    moved = [
        PackSpec(int(r[0]), int(r[1]), (int(r[4]),), (1,), 1, int(r[2]), int(r[3]))
        for r in rows[from_gpu]
    ]
    return rows[~from_gpu], [*specs, *moved]


def placed(
    rows: np.ndarray, req: PullRequest, devices: list[int]
) -> tuple[np.ndarray, PullRequest, int, set[int]]:
    """``req`` (its descriptor ``rows``) as it is run: the rows reading ``devices``
    staged by the source (:func:`staged_by_source`; none: as it is), with the bytes it
    moves and its destination regions."""
    if devices:
        rows, specs = staged_by_source(rows, req.pack_specs, devices)
        req = msgspec.structs.replace(req, descriptors=DescriptorTable.pack(rows), pack_specs=specs)
    return rows, req, total_bytes(rows, req.pack_specs), dst_ids(rows, req.pack_specs)


def tries_shm(mode: str) -> bool:
    """Whether a daemon in ``mode`` tries the ``shm`` path for another daemon first."""
    return mode in (AUTO, SHM_ONLY)


def forced(mode: str) -> str:
    """Why a daemon in ``mode`` does not try ``shm`` for another daemon."""
    return f"this daemon is forced to its transport (--transport {mode})"


# ---------------------------------------------------------------- pacing


@dataclass(frozen=True)
class Pace:
    """How a path's reads are cut and batched (bytes): a read longer than ``piece``
    is cut into ``piece``-sized reads (so several can be in flight); a batch handed
    to the peer holds at most ``reads`` reads and about ``max_bytes`` bytes (a larger
    single read is a batch of its own). Progress is reported, and a cancel lands,
    between batches."""

    piece: int
    reads: int
    max_bytes: int


BATCH_BYTES = 256 << 20
"""About the most bytes of one batch handed to a data plane, whatever the path."""


def pace_for(caps: Capabilities) -> Pace:
    """The :class:`Pace` of a path whose transport can do ``caps``: its pieces and
    reads a batch (:class:`~transports.interface.Capabilities`), batches of about
    :data:`BATCH_BYTES`."""
    return Pace(piece=caps.piece, reads=caps.batch_reads, max_bytes=BATCH_BYTES)


TRANSPORT_PACE = pace_for(Capabilities())
"""A transport's that says nothing of its pace (UCX's): 32 MiB reads, so one large
region keeps both batches busy."""


def cut(
    rows: np.ndarray, pace: Pace, done: np.ndarray | None = None
) -> tuple[ReadBatch, np.ndarray]:
    """Wire ``rows`` as transport reads (``local``: destination, ``remote``: source),
    each longer than ``pace.piece`` cut into pieces; and per read 1 where a
    descriptor ends (its last piece), else 0: a descriptor is done once its last
    piece landed. ``done`` (per row, 0 or 1; default all 1) says which rows end a
    descriptor: a pack spec read directly is many rows and one descriptor."""
    batch = rows_as_batch(rows)
    reads = split_pieces(batch, pace.piece)
    pieces = np.maximum(1, -(-batch["nbytes"] // pace.piece))
    ends = np.zeros(len(reads), dtype=np.int64)
    ends[np.cumsum(pieces) - 1] = 1 if done is None else done
    return reads, ends


MIN_DIRECT_RUN = 256
"""Bytes: a pack spec whose contiguous runs are shorter is packed by the source
(each run read directly would cost a 40-byte row and a copy call of its own)."""

MAX_DIRECT_ROWS = 1 << 21
"""Rows: past this many runs (80 MiB of row table) the pack specs are packed by
the source instead."""


def direct_reads(
    specs: list[PackSpec], *, min_run: int = MIN_DIRECT_RUN, max_rows: int = MAX_DIRECT_ROWS
) -> tuple[np.ndarray, np.ndarray] | None:
    """Pack specs as plain reads, for a path that maps the source's memory (``shm``):
    the strided blocks are gathered by the reader's own copy, straight into their
    destinations, instead of packed into staging by the source and read again (one
    copy instead of two). Returns wire rows, one per contiguous run of each block in
    the order the source would pack it (row-major), landing exactly where the packed
    bytes would; and per row 1 where a spec's last run is (see :func:`cut`). ``None``
    when a block's runs are shorter than ``min_run`` bytes or there would be more
    than ``max_rows`` rows: the source then packs, as asked. The specs are checked
    already (:func:`check_plan`): every run lies inside its spec's checked span."""
    if sum(max(1, runs_of(p)) for p in specs) > max_rows:  # counted before any is listed
        return None
    out: list[np.ndarray] = []
    last: list[np.ndarray] = []
    total = 0
    for p in specs:
        if p.nbytes == 0:  # still one descriptor: a read of no bytes
            zero = [[p.src_region, p.src_offset, p.dst_region, p.dst_offset, 0]]
            out.append(np.array(zero, dtype=np.int64))
            last.append(np.ones(1, dtype=np.int64))
            continue
        dims = [(n, st) for n, st in zip(p.shape, p.strides, strict=True) if n != 1]
        run = 1  # elements in one contiguous run: the trailing dims that are dense
        while dims and dims[-1][1] == run:
            run *= dims.pop()[0]
        run_bytes = run * p.itemsize
        if run_bytes < min_run:
            return None
        offsets = np.zeros(1, dtype=np.int64)
        for n, st in dims:
            offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
        total += len(offsets)
        if total > max_rows:
            return None
        rows = np.empty((len(offsets), 5), dtype=np.int64)
        rows[:, 0] = p.src_region
        rows[:, 1] = p.src_offset + offsets * p.itemsize
        rows[:, 2] = p.dst_region
        rows[:, 3] = p.dst_offset + np.arange(len(offsets), dtype=np.int64) * run_bytes
        rows[:, 4] = run_bytes
        out.append(rows)
        ends = np.zeros(len(offsets), dtype=np.int64)
        ends[-1] = 1
        last.append(ends)
    if not out:
        return np.zeros((0, 5), dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(out), np.concatenate(last)


def spans(sizes: np.ndarray, max_reads: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans of reads with at most ``max_reads`` reads and about
    ``max_bytes`` bytes each: the data planes' :func:`~transports.batch.read_spans`."""
    return read_spans(sizes, max_reads, max_bytes)


# ---------------------------------------------------------------- outcomes


def suspect(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Destination ``(region, offset, nbytes)`` ranges of wire ``rows``, sorted and
    merged: the data plane's :func:`~transports.batch.suspect_ranges` of those reads.
    Once bytes may have moved, every one of them is suspect: a data plane that
    failed mid-batch cannot say which reads landed."""
    return [(r.region, r.offset, r.nbytes) for r in suspect_ranges(rows_as_batch(rows))]


SUSPECT_KEPT = 1024
"""Suspect ranges an ended pull's record keeps at most: past it, the nearest ranges
of a region are joined (the gap between them reported suspect too)."""


def widened(ranges: list[tuple[int, int, int]], limit: int) -> list[tuple[int, int, int]]:
    """Sorted, merged ``(region, offset, nbytes)`` ranges joined across their smallest
    gaps (within a region) until at most ``limit`` remain, or one a region: a record
    of bounded size that still names every byte that may have been written (a wider
    suspect range is safe: its bytes are reinstalled, never trusted)."""
    if len(ranges) <= limit:
        return ranges
    a = np.array(ranges, dtype=np.int64)
    region, start, end = a[:, 0], a[:, 1], a[:, 1] + a[:, 2]
    gap = np.where(region[1:] == region[:-1], start[1:] - end[:-1], np.iinfo(np.int64).max)
    joinable = int((region[1:] == region[:-1]).sum())
    k = min(len(ranges) - limit, joinable)
    join = np.zeros(len(gap), dtype=bool)
    if k > 0:
        join[np.argpartition(gap, k - 1)[:k]] = True
    first = np.flatnonzero(~np.concatenate(([False], join)))
    last = np.append(first[1:], len(a)) - 1
    return [
        (int(region[f]), int(start[f]), int(end[e] - start[f]))
        for f, e in zip(first.tolist(), last.tolist(), strict=True)
    ]


def source_name(url: str, peer: PeerRegions | None) -> str:
    """How a failed pull names where it read from: the peer's node id and URL."""
    if not url:
        return "this daemon"
    return f"{peer.node_id!r} at {url}" if peer is not None else url


def failed(pull_id: str, source: str, exc: Exception) -> ErrorBody:
    """The error of a pull that ``exc`` failed: a RefitError keeps its class name,
    anything else is the data plane's (``TransportError``)."""
    return ErrorBody(
        type(exc).__name__ if isinstance(exc, RefitError) else "TransportError",
        f"pull {pull_id} from {source} failed: {exc}",
    )


def source_gone(pull_id: str, source: str, reason: str) -> ErrorBody:
    """The error of a pull failed because its source left (``reason``)."""
    return ErrorBody("TransportError", f"pull {pull_id} from {source} failed: {reason}")


def cancelled(pull_id: str, reason: str) -> ErrorBody:
    """The error of a pull cancelled for ``reason`` before it completed."""
    return ErrorBody("ConflictError", f"pull {pull_id} cancelled before it completed: {reason}")
