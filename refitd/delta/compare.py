"""The source's comparison of a version with its base, grouped by bytes.

A version may be published as a few large shards or as tens of thousands of tiny
ones; either way the comparison's cost on the daemon's event loop must not grow with
the count. So everything per block is built in worker threads, as arrays:

- :func:`table_of`: the version's blocks (one per shard of its merged manifest):
  key ``(name, offset, shape, dtype)``, region, byte offset and bytes;
- :func:`pair_with`: each block's twin in the base (same key), or why not;
- :func:`jobs_of`: the blocks cut into *pieces* of at most :data:`CHUNK` bytes, in
  (region, offset) order, and the pieces grouped into jobs of about
  :data:`JOB_BYTES` (a tiny piece counted as :data:`PIECE_COST` bytes, so a job
  holds a bounded number of them): the loop handles one future per job;
- :func:`run_job`: a job, in a worker thread: pieces copied through the bus-error
  guard into private chunks (a segment its owner shrinks fails the comparison, not
  the daemon), compared and digested natively (:func:`refitd.delta.native`);
- :func:`digest`: the version's digest from its blocks' hashes, in key order.

A block's hash is BLAKE2b of its key and its lane digest (the first
``min(LANES, ceil(bytes / 8))`` lanes: a small block's other lanes are zero), so a
version's digest depends on its blocks and their bytes, not on how they were cut
into jobs or which side of a comparison they were on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from refitd.delta.diff import CHUNK, LANES, unit_dtype
from refitd.delta.stream import ChangeIndex, compose
from refitd.errors import ConflictError, ProtocolError
from refitd.wire.versions import DTYPE_SIZES
from transports.batch import within, within_spans

__all__ = [
    "JOB_BYTES",
    "PIECE_COST",
    "JobResult",
    "Jobs",
    "Table",
    "address_of",
    "assemble",
    "check_twins",
    "comparison_bytes",
    "composed",
    "digest",
    "jobs_of",
    "pair_with",
    "run_job",
    "table_of",
    "translate",
]

JOB_BYTES = 8 * CHUNK
"""Bytes of one comparison job handed to a worker thread."""
PIECE_COST = 4096
"""What a piece counts toward its job's bytes at least: a job holds at most
``JOB_BYTES / PIECE_COST`` (2,048) pieces, however tiny."""

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def comparison_bytes(threads: int, blocks: int, unit: int = 1) -> int:
    """Daemon memory one comparison of ``blocks`` blocks holds besides the changes it
    keeps (those count against ``[pulls] delta_max_bytes``): per job in flight (at most
    two a thread, :meth:`~refitd.daemon.delta.source.DeltaBook._run`) its two chunks copied
    and one chunk's changes found (an int64 offset and old and new bytes a unit of
    ``unit`` bytes; 1, the worst, unless known), and 32 B a block (its two hashes)."""
    job = 2 * CHUNK + (CHUNK // unit) * (8 + 2 * unit)
    return 2 * threads * job + 32 * blocks


U64 = npt.NDArray[np.uint64]
Key = tuple[str, tuple[int, ...], tuple[int, ...], str]


class _Shard(Protocol):
    @property
    def offset(self) -> Sequence[int]: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def region(self) -> int: ...
    @property
    def byte_offset(self) -> int: ...


class _Tensor(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shards(self) -> Sequence[_Shard]: ...


class _Manifest(Protocol):
    @property
    def tensors(self) -> Sequence[_Tensor]: ...


@dataclass(frozen=True)
class Table:
    """A version's blocks, in (region, offset) order."""

    keys: list[Key]
    region: I64
    at: I64
    nbytes: I64
    itemsizes: frozenset[int]
    #: block indices in key order (the digest's order)
    by_key: I64

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())


def table_of(manifest: _Manifest, itemsize: Callable[[str], int]) -> Table:
    """The blocks of a merged manifest (in a worker thread: a Python step per shard)."""
    sizes: dict[str, int] = {}
    keys: list[Key] = []
    rows: list[tuple[int, int, int]] = []
    for t in manifest.tensors:
        size = sizes.get(t.dtype)
        if size is None:
            size = sizes[t.dtype] = itemsize(t.dtype)
        for s in t.shards:
            keys.append((t.name, tuple(s.offset), tuple(s.shape), t.dtype))
            rows.append((s.region, s.byte_offset, math.prod(s.shape) * size))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    order = np.lexsort((arr[:, 1], arr[:, 0]))
    arr = arr[order]
    keys = [keys[i] for i in order.tolist()]
    by_key = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    return Table(keys, arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(),
                 frozenset(sizes.values()), by_key)  # fmt: skip


def pair_with(table: Table, base: Table) -> tuple[I64, I64] | str:
    """Each block's twin in ``base`` (same key): its region and byte offset; or why
    some block has none."""
    where = {k: i for i, k in enumerate(base.keys)}
    twin = np.empty(len(table.keys), dtype=np.int64)
    for i, k in enumerate(table.keys):
        j = where.get(k)
        if j is None:
            return f"block {k[0]!r} at {k[1]} shape {k[2]} {k[3]} has no match"
        twin[i] = j
    return base.region[twin], base.at[twin]


def check_bounds(table: Table, sizes: Mapping[int, int], what: str) -> None:
    """Every block lies inside its region (``sizes``: region bytes); else refused."""
    size = np.array([sizes.get(int(r), -1) for r in table.region.tolist()], dtype=np.int64)
    bad = np.flatnonzero(~within(table.at, table.nbytes, size))  # nothing is inside size -1
    if len(bad):
        i = int(bad[0])
        raise ConflictError(
            f"{what}: block {table.keys[i][0]!r} at byte {int(table.at[i])} "
            f"({int(table.nbytes[i])} bytes) lies outside region {int(table.region[i])}"
        )


@dataclass(frozen=True)
class Jobs:
    """A version's pieces (each inside one block, at most ``CHUNK`` bytes, in
    (region, offset) order) and the jobs that group them: job ``j`` is pieces
    ``[bounds[j], bounds[j + 1])``."""

    block: I64
    lo: I64  # the piece's start in its block
    n: I64
    bounds: I64

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


def jobs_of(table: Table) -> Jobs:
    """Cut ``table``'s blocks into pieces and group them by bytes (a worker thread)."""
    per = np.maximum(1, -(-table.nbytes // CHUNK))  # a 0-byte block: one empty piece
    block = np.repeat(np.arange(len(table.nbytes), dtype=np.int64), per)
    first = np.cumsum(per) - per
    lo = (np.arange(len(block), dtype=np.int64) - np.repeat(first, per)) * CHUNK
    n = np.minimum(table.nbytes[block] - lo, CHUNK)
    cost = np.maximum(n, PIECE_COST)
    ends = np.cumsum(cost)
    job = (ends - cost) // JOB_BYTES
    cuts = np.flatnonzero(np.diff(job)) + 1 if len(job) else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], cuts, [len(block)]]).astype(np.int64)
    if not len(block):
        bounds = np.zeros(1, np.int64)
    return Jobs(block, lo, n, bounds)


@dataclass
class JobResult:
    """What one job found: hashes of the blocks it held whole (new side, base side),
    the lanes of pieces of blocks cut across jobs, and its changes (offsets in their
    region, ascending in (region, offset) order; each one's old then new unit)."""

    whole: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    hash_new: U8 = field(default_factory=lambda: np.zeros((0, 16), np.uint8))
    hash_old: U8 = field(default_factory=lambda: np.zeros((0, 16), np.uint8))
    partial: list[tuple[int, U64, U64]] = field(default_factory=list)
    offsets: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    values: U8 = field(default_factory=lambda: np.zeros(0, np.uint8))
    per_region: dict[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.values.nbytes


def block_hash(key: Key, lanes: U64) -> bytes:
    return hashlib.blake2b(repr(key).encode() + lanes.tobytes(), digest_size=16).digest()


def _used(n: int) -> int:
    return min(LANES, -(-n // 8))


def run_job(
    table: Table,
    jobs: Jobs,
    j: int,
    bases: tuple[I64, I64] | None,
    address: Mapping[int, int],
    unit: int,
    copy: Callable[[I64, I64, I64], None],
) -> JobResult:
    """Job ``j``, in a worker thread. ``bases``: each block's twin (region, offset) in
    the base, None to take the version's lanes only; ``address``: each region's mapped
    address; ``copy``: the guarded batch copy (dst, src, bytes addresses)."""
    from refitd.delta import native

    p0, p1 = int(jobs.bounds[j]), int(jobs.bounds[j + 1])
    blk, lo, n = jobs.block[p0:p1], jobs.lo[p0:p1], jobs.n[p0:p1]
    reg = table.region[blk]
    src_new = np.array([address[int(r)] for r in reg.tolist()], dtype=np.int64) + table.at[blk] + lo
    src_old = None
    if bases is not None:
        breg = bases[0][blk]
        src_old = np.array([address[int(r)] for r in breg.tolist()], dtype=np.int64)
        src_old += bases[1][blk] + lo
    dst_off = table.at[blk] + lo  # a change's offset in its region
    used = np.minimum(LANES, -(-n // 8))
    lanes_at = np.cumsum(used) - used
    lanes_new = np.zeros(int(used.sum()), np.uint64)
    lanes_old = np.zeros(len(lanes_new), np.uint64)
    buf_new = np.empty(CHUNK, np.uint8)
    buf_old = np.empty(CHUNK, np.uint8)
    at = np.empty(CHUNK // unit, np.int64)
    vals = np.empty(2 * CHUNK, np.uint8)
    per_piece = np.zeros(len(blk), np.int64)
    offs: list[I64] = []
    values: list[U8] = []
    lib = native._lib()
    # Sub-batches of consecutive pieces filling a chunk: one guarded copy per side and
    # one native call each, the chunk staying in cache between the two.
    start = 0
    while start < len(blk):
        end, size = start, 0
        while end < len(blk) and size + int(n[end]) <= CHUNK:
            size += int(n[end])
            end += 1
        sl = slice(start, end)
        dst = buf_new.ctypes.data + np.cumsum(n[sl]) - n[sl]
        copy(dst, src_new[sl], n[sl])
        if src_old is not None:
            copy(buf_old.ctypes.data + (dst - buf_new.ctypes.data), src_old[sl], n[sl])
        k = np.ascontiguousarray(n[sl])
        d_off = np.ascontiguousarray(dst_off[sl])
        l_at = np.ascontiguousarray(lanes_at[sl])
        pp = np.zeros(end - start, np.int64)
        got = lib.rfx_compare_pieces(
            end - start, k.ctypes.data, d_off.ctypes.data,
            buf_old.ctypes.data if src_old is not None else None, buf_new.ctypes.data, unit,
            l_at.ctypes.data, lanes_old.ctypes.data, lanes_new.ctypes.data,
            at.ctypes.data, vals.ctypes.data, pp.ctypes.data,
        )  # fmt: skip
        per_piece[sl] = pp
        if got:
            offs.append(at[:got].copy())
            values.append(vals[: 2 * unit * got].copy())
        start = end
    out = JobResult()
    whole = (lo == 0) & (n == table.nbytes[blk])
    w = np.flatnonzero(whole)
    out.whole = blk[w]
    out.hash_new = np.empty((len(w), 16), np.uint8)
    out.hash_old = np.empty((len(w), 16), np.uint8)
    for row, i in enumerate(w.tolist()):
        key = table.keys[int(blk[i])]
        a, u = int(lanes_at[i]), int(used[i])
        out.hash_new[row] = np.frombuffer(block_hash(key, lanes_new[a : a + u]), np.uint8)
        if bases is not None:
            out.hash_old[row] = np.frombuffer(block_hash(key, lanes_old[a : a + u]), np.uint8)
    for i in np.flatnonzero(~whole).tolist():
        a, u = int(lanes_at[i]), int(used[i])
        ln, lo_ = np.zeros(LANES, np.uint64), np.zeros(LANES, np.uint64)
        ln[:u], lo_[:u] = lanes_new[a : a + u], lanes_old[a : a + u]
        out.partial.append((int(blk[i]), ln, lo_))
    if offs:
        out.offsets = np.concatenate(offs)
        out.values = np.concatenate(values)
        counts = np.bincount(np.searchsorted(np.unique(reg), reg), weights=per_piece)
        for r, c in zip(np.unique(reg).tolist(), counts.tolist(), strict=True):
            if c:
                out.per_region[int(r)] = int(c)
    return out


def digest(table: Table, hashes: U8) -> str:
    """The version's digest from its blocks' hashes (``(blocks, 16)``), in key order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(hashes[table.by_key]).tobytes())
    return h.hexdigest()


def itemsize_of(dtype: str) -> int:
    """A manifest dtype's item size by name (:data:`refitd.wire.DTYPE_SIZES`, so the
    daemon never imports torch for it); refused (ProtocolError) for another name."""
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise ProtocolError(f"dtype {dtype!r} is not a dtype a manifest may name")
    return size


def translate(
    index: ChangeIndex, values: U8, unit: int, source: Table, target: Table
) -> tuple[ChangeIndex, U8]:
    """Changes keyed by ``source``'s layout (its regions and offsets) as changes of
    ``target``'s: each block moved to where the block of the same key lies in
    ``target`` (a double-buffered trainer publishes consecutive versions in different
    regions). Refused (ConflictError) when a block has no twin or a change lies in
    no block."""
    twins = pair_with(target, source)  # per target block: its twin in source
    if isinstance(twins, str):
        raise ConflictError(f"a version between is laid out otherwise ({twins})")
    order = np.lexsort((twins[1], twins[0]))
    s_reg, s_at = twins[0][order], twins[1][order]
    t_reg, t_at, n = target.region[order], target.at[order], target.nbytes[order]
    offs, regs, keep = [], [], []
    for r, (lo, hi) in index.spans.items():
        o = index.offsets[lo:hi]
        first, last = np.searchsorted(s_reg, r), np.searchsorted(s_reg, r, "right")
        if first == last:
            raise ConflictError(f"changes of region {r} lie in no block of the version")
        # A change is at a unit's first byte: it lies in a block when that byte does
        # (the blocks' ends do not overflow: each was bounded by its region).
        at = s_at[first:last]
        k, inside = within_spans(o, 1, at, at + n[first:last])
        b = first + k
        if not bool(inside.all()):
            raise ConflictError(f"a change of region {r} lies in no block of the version")
        offs.append(o - s_at[b] + t_at[b])
        regs.append(t_reg[b])
        keep.append(np.arange(lo, hi, dtype=np.int64))
    if not offs:
        return ChangeIndex.of({}), np.zeros(0, np.uint8)
    o, g, at = np.concatenate(offs), np.concatenate(regs), np.concatenate(keep)
    by = np.lexsort((o, g))
    o, g, at = o[by], g[by], at[by]
    pairs = values.view(unit_dtype(unit)).reshape(-1, 2)[at]
    per: dict[int, I64] = {}
    for r in np.unique(g).tolist():
        per[int(r)] = o[g == r]
    return ChangeIndex.of(per), np.ascontiguousarray(pairs).view(np.uint8).reshape(-1)


def composed(
    chain: list[tuple[ChangeIndex, U8, Table | None]], unit: int
) -> tuple[ChangeIndex, U8]:
    """The chain's changes, each link's moved into the last one's layout, composed."""
    target = chain[-1][2]
    if target is None or any(t is None for _, _, t in chain):
        raise ConflictError("a delta between was dropped meanwhile: a full refit is needed")
    moved = [translate(i, v, unit, t, target) for i, v, t in chain[:-1] if t is not None]
    return compose([*moved, (chain[-1][0], chain[-1][1])], unit)


def address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


def check_twins(table: Table, twins: tuple[I64, I64], sizes: dict[int, int], what: str) -> None:
    """Each block's twin in the base lies inside its region (as :func:`check_bounds`)."""
    base = Table(table.keys, twins[0], twins[1], table.nbytes, table.itemsizes, table.by_key)
    check_bounds(base, sizes, f"{what} (base)")


def assemble(kept: list[JobResult]) -> tuple[ChangeIndex, U8]:
    """The jobs' changes as one index: jobs hold pieces in (region, offset) order, so
    concatenated in job order each region's offsets ascend (checked: blocks that
    overlap in a region would break it, and are then sorted)."""
    spans: dict[int, tuple[int, int]] = {}
    at = 0
    for res in kept:
        for r, c in res.per_region.items():
            lo, _ = spans.get(r, (at, at))
            spans[r] = (lo, at + c)
            at += c
    offsets = np.concatenate([r.offsets for r in kept])
    values = np.concatenate([r.values for r in kept])
    for lo, hi in spans.values():
        part = offsets[lo:hi]
        if len(part) > 1 and not bool((part[1:] > part[:-1]).all()):
            raise ConflictError("comparison refused: two blocks of the version overlap in a region")
    return ChangeIndex(offsets, spans), values
