"""Plan every recorded copy of a capture against published sources, and execute it.

:func:`plan_transfer` resolves each copy to exact, coalesced reads
(:mod:`refitd.reshard.slice_plan`), then applies the cost model
(:mod:`refitd.reshard.cost`) under a per-copy descriptor budget:

- exact reads when they fit the budget;
- otherwise the cheapest of a *pack spec* per session (a strided source region the
  source packs contiguous: one descriptor, no extra bytes) and a *full read* of the
  bounding row range of every touched shard into a staging buffer, followed by
  local replay of the op chain (only for sources published as dim-0 blocks;
  others are reported in ``unbounded_sources``).

With ``pack_specs=False`` the planner behaves like ModelExpress: over-budget copies
of dim-0-blocked sources get a full read, others keep their exact descriptors.

Sources unsupported at capture, missing from ``sources`` or unplannable land in
``fallback``: nothing is planned or fetched for them, and a receiver must refuse
the whole plan (:mod:`refitd.reshard.receiver`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from refitd.errors import PlanError, TransportError
from refitd.reshard.chunks import chunk_table, is_dim0_block
from refitd.reshard.cost import (
    DESCRIPTOR_COST_BYTES,
    PACK_COST_BYTES,
    Choice,
    choose,
    full_cost,
    full_read_rows,
)
from refitd.reshard.reads import PackedRead, ReadDescriptor, ReadExecutor
from refitd.reshard.replay import replay_ops
from refitd.reshard.slice_plan import (
    Pieces,
    Read,
    Shard,
    check_cast,
    coalesce,
    copy_runs,
    split_runs,
    write_through_pointer,
)
from refitd.reshard.types import CaptureResult, RecordedCopy, UnsupportedReshard

__all__ = [
    "FullRead",
    "PackPlan",
    "SourceInfo",
    "TransferPlan",
    "exact_descriptors",
    "execute_transfer",
    "plan_transfer",
    "write_through_pointer",
]

IntArray = npt.NDArray[np.int64]


_LAYOUT = attrgetter("shard_offset", "shape", "session", "elsize")
_ADDR = attrgetter("addr")


@dataclass(frozen=True)
class SourceInfo:
    """A full source tensor as published: its global shape (elements), dtype,
    bytes per element, and the shards that hold it (replicas allowed).

    On construction it records ``layout_key`` (a process-local hash of everything
    but the shards' addresses: shape, dtype, elsize, every shard's box, session and
    elsize) and ``shard_addrs`` (bytes, one per shard). That is O(shards), paid once
    per manifest entry, and is what lets a compiled plan replay against a fresh
    manifest without walking its shards. Treat a ``SourceInfo`` as immutable.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    elsize: int
    shards: list[Shard]
    layout_key: int = field(init=False, repr=False, compare=False)
    shard_addrs: IntArray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout = (
            tuple(self.global_shape),
            self.dtype,
            self.elsize,
            tuple(map(_LAYOUT, self.shards)),
        )
        try:
            key = hash(layout)
        except TypeError:  # lists where tuples were meant: same content, same key
            key = hash(repr(layout))
        object.__setattr__(self, "layout_key", key)
        addrs = np.fromiter(map(_ADDR, self.shards), dtype=np.int64, count=len(self.shards))
        object.__setattr__(self, "shard_addrs", addrs)


@dataclass(frozen=True)
class FullRead:
    """Read the bounding rows of a source's shards into staging, then replay.

    The staging buffer is laid out as the full tensor (``staging_nbytes`` bytes,
    row-major ``global_shape`` of ``dtype``); each read's ``dst_byte`` is a byte
    offset into it and its ``param_name`` is the source's name. ``copies`` are
    replayed on the staging tensor with ``replay_ops`` into their parameters.
    """

    src_name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    elsize: int
    reads: list[Read]
    copies: list[RecordedCopy]

    @property
    def staging_nbytes(self) -> int:
        return math.prod(self.global_shape) * self.elsize

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.reads)


@dataclass(frozen=True)
class PackPlan:
    """The planner's pack spec: a strided region of one session that the source packs
    contiguous.

    ``shape`` is in elements; ``src_strides``/``dst_strides`` in **bytes**, as in
    every planner type (:class:`~refitd.reshard.reads.PackedRead` too). Only the HTTP
    wire's :class:`refitd.wire.PackSpec` counts strides in elements; the client
    divides by the itemsize where it builds one. The packed payload lands at byte
    ``dst_byte`` of ``param_name``'s storage, contiguous when ``dst_strides`` is
    ``None``, else scattered with those strides.
    """

    src_name: str
    param_name: str
    session: str
    src_addr: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    elsize: int
    dst_byte: int
    dst_strides: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.elsize


@dataclass
class TransferPlan:
    """What to read for one capture: exact reads, pack specs and full reads.

    ``exact_bytes``/``exact_descriptor_count`` describe the all-exact plan (every
    copy as exact coalesced reads); the accessors compare the chosen plan to it.
    ``max_descriptors_per_copy`` is the largest descriptor count any one copy got;
    ``choices`` counts copies per option; ``planned_sources`` names the sources read.
    """

    reads: list[Read] = field(default_factory=list)
    full_reads: list[FullRead] = field(default_factory=list)
    packs: list[PackPlan] = field(default_factory=list)
    unbounded_sources: list[str] = field(default_factory=list)
    fallback: list[str] = field(default_factory=list)
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    exact_bytes: int = 0
    exact_descriptor_count: int = 0
    max_descriptors_per_copy: int = 0
    choices: dict[str, int] = field(default_factory=lambda: {"exact": 0, "pack": 0, "full": 0})
    planned_sources: list[str] = field(default_factory=list)

    def bytes_planned(self) -> int:
        """Bytes that cross the wire."""
        return (
            sum(s.nbytes for s in self.reads)
            + sum(fr.nbytes() for fr in self.full_reads)
            + sum(p.nbytes for p in self.packs)
        )

    def descriptor_count(self) -> int:
        """Reads posted: exact reads, the reads of full reads, and pack specs (one each)."""
        return len(self.reads) + sum(len(fr.reads) for fr in self.full_reads) + len(self.packs)

    def descriptor_savings(self) -> int:
        return self.exact_descriptor_count - self.descriptor_count()

    def extra_wire_bytes(self) -> int:
        return self.bytes_planned() - self.exact_bytes


def _param_keyed(p: Pieces, param: IntArray, n_sessions: int) -> Pieces:
    # Coalescing must never join reads into different parameters.
    return Pieces(p.shard, param * n_sessions + p.session, p.addr, p.dst, p.nbytes)


def _merge_exact(parts: list[tuple[int, Pieces]], n_sessions: int) -> tuple[Pieces, IntArray]:
    if not parts:
        z = np.zeros(0, dtype=np.int64)
        return Pieces(z, z, z, z, z), z
    param = np.concatenate([np.full(len(p), c, dtype=np.int64) for c, p in parts])
    allp = Pieces.concat([p for _, p in parts])
    order = np.lexsort((allp.dst, param))
    keyed = coalesce(_param_keyed(allp.take(order), param[order], n_sessions))
    return (
        Pieces(keyed.shard, keyed.session % n_sessions, keyed.addr, keyed.dst, keyed.nbytes),
        keyed.session // n_sessions,
    )


def plan_transfer(
    capture: CaptureResult,
    sources: Mapping[str, SourceInfo],
    max_reads_per_copy: int = 64,
    *,
    pack_specs: bool = True,
    descriptor_cost_bytes: int = DESCRIPTOR_COST_BYTES,
    pack_cost_bytes: int = PACK_COST_BYTES,
) -> TransferPlan:
    """Plan every copy of ``capture`` against ``sources`` (see the module docstring).

    ``max_reads_per_copy`` is the descriptor budget per recorded copy;
    ``descriptor_cost_bytes``/``pack_cost_bytes`` price a descriptor and a pack spec
    in wire bytes (:mod:`refitd.reshard.cost`). Replicas
    are assigned so no byte is read twice and reads spread across sessions.
    """
    plan = TransferPlan(
        fallback=list(capture.unsupported), fallback_reasons=dict(capture.unsupported_reasons)
    )
    by_source: dict[str, list[RecordedCopy]] = {}
    for copy in capture.copies:
        by_source.setdefault(copy.src_name, []).append(copy)
    sessions: dict[str, int] = {}
    params: dict[str, int] = {}
    loads: dict[str, int] = {}
    chosen: list[tuple[str, SourceInfo, list[Choice]]] = []
    for name, copies in by_source.items():
        if name in plan.fallback_reasons or name in plan.fallback:
            continue
        info = sources.get(name)
        if info is None:
            plan.fallback.append(name)
            plan.fallback_reasons[name] = f"source {name!r} is not in the published manifest"
            continue
        try:
            chosen.append(
                (
                    name,
                    info,
                    _plan_source(
                        name,
                        info,
                        copies,
                        sessions,
                        loads,
                        max_reads_per_copy,
                        pack_specs,
                        (descriptor_cost_bytes, pack_cost_bytes),
                        plan,
                    ),
                )
            )
        except (UnsupportedReshard, PlanError) as exc:
            plan.fallback.append(name)
            plan.fallback_reasons[name] = f"{exc} on lazy {name!r}"
    _assemble(plan, chosen, sessions, params)
    return plan


def _plan_source(
    name: str,
    info: SourceInfo,
    copies: list[RecordedCopy],
    sessions: dict[str, int],
    loads: dict[str, int],
    budget: int,
    pack_specs: bool,
    costs: tuple[int, int],
    plan: TransferPlan,
) -> list[Choice]:
    shape = tuple(int(n) for n in info.global_shape)
    table = chunk_table(shape, info.shards, info.elsize, loads)
    codes = np.array(
        [sessions.setdefault(s.session, len(sessions)) for s in info.shards], dtype=np.int64
    )
    bounded = all(is_dim0_block(shape, s) for s in info.shards)
    out = []
    for copy in copies:
        cast = copy.dest_dtype != info.dtype or bool(copy.casts)
        if cast:
            check_cast(copy, info.dtype, bounded)
        shard, storage, dst, nbytes = split_runs(copy_runs(copy, shape), table, info.elsize)
        raw = Pieces(shard, codes[shard], info.shard_addrs[shard] + storage, dst, nbytes)
        exact = coalesce(raw)
        choice = (
            # Bytes cannot convert themselves: stage the source, convert at install.
            Choice(copy, "full", exact, raw)
            if cast
            else choose(
                copy, raw, exact, info.shards, info.elsize, bounded, budget, pack_specs, costs
            )
        )
        if len(exact) > budget and not bounded and name not in plan.unbounded_sources:
            plan.unbounded_sources.append(name)
        out.append(choice)
    return out


def _assemble(
    plan: TransferPlan,
    chosen: list[tuple[str, SourceInfo, list[Choice]]],
    sessions: dict[str, int],
    params: dict[str, int],
) -> None:
    names = sorted(sessions, key=sessions.__getitem__)
    n_sessions = max(len(sessions), 1)
    exact_parts: list[tuple[int, Pieces]] = []
    all_parts: list[tuple[int, Pieces]] = []
    for src_name, info, choices in chosen:
        plan.planned_sources.append(src_name)
        full_raw: list[Pieces] = []
        full_copies: list[RecordedCopy] = []
        for c in choices:
            code = params.setdefault(c.copy.param_name, len(params))
            all_parts.append((code, c.exact if c.kind != "pack" else coalesce(c.raw)))
            plan.exact_bytes += c.raw.total()
            plan.choices[c.kind] += 1
            if c.kind == "full":
                full_raw.append(c.raw)
                full_copies.append(c.copy)
                n_desc = full_cost(c.raw, info.shards, info.elsize)[1]
            else:
                exact_parts.append((code, c.exact))
                n_desc = len(c.exact) + len(c.packs)
            for fit, session in c.packs:
                plan.packs.append(
                    PackPlan(
                        src_name,
                        c.copy.param_name,
                        names[session],
                        fit.src0,
                        fit.shape,
                        fit.src_strides,
                        info.elsize,
                        fit.dst0,
                        fit.dst_strides,
                    )
                )
            plan.max_descriptors_per_copy = max(plan.max_descriptors_per_copy, n_desc)
        if full_copies:
            plan.full_reads.append(
                _full_read(src_name, info, Pieces.concat(full_raw), full_copies, names, sessions)
            )
    param_names = sorted(params, key=params.__getitem__)
    merged, param_of = _merge_exact(exact_parts, n_sessions)
    plan.reads = [
        Read(names[s], a, d, n, param_names[p])
        for s, a, d, n, p in zip(
            merged.session.tolist(),
            merged.addr.tolist(),
            merged.dst.tolist(),
            merged.nbytes.tolist(),
            param_of.tolist(),
            strict=True,
        )
    ]
    plan.exact_descriptor_count = len(_merge_exact(all_parts, n_sessions)[0])


def _full_read(
    src_name: str,
    info: SourceInfo,
    raw: Pieces,
    copies: list[RecordedCopy],
    names: list[str],
    sessions: dict[str, int],
) -> FullRead:
    rows = full_read_rows(raw, info.shards, info.elsize)
    ks = sorted(
        rows, key=lambda k: info.shards[k].shard_offset[0] + rows[k][0] if info.global_shape else 0
    )
    parts = []
    for k in ks:
        shard = info.shards[k]
        r0, r1 = rows[k]
        row_bytes = math.prod(shard.shape[1:]) * info.elsize
        g0 = shard.shard_offset[0] if shard.shard_offset else 0
        parts.append(
            (
                sessions[shard.session],
                shard.addr + r0 * row_bytes,
                (g0 + r0) * row_bytes,
                (r1 - r0) * row_bytes,
                k,
            )
        )
    arr = np.array(parts, dtype=np.int64).reshape(-1, 5)
    p = coalesce(Pieces(arr[:, 4], arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]))
    reads = [
        Read(names[s], a, d, n, src_name)
        for s, a, d, n in zip(
            p.session.tolist(), p.addr.tolist(), p.dst.tolist(), p.nbytes.tolist(), strict=True
        )
    ]
    return FullRead(src_name, tuple(info.global_shape), info.dtype, info.elsize, reads, copies)


def exact_descriptors(
    plan: TransferPlan, resolve_param_ptr: Callable[[str], int]
) -> list[ReadDescriptor]:
    """The plan's exact reads as absolute descriptors into the parameters, in plan order."""
    ptrs: dict[str, int] = {}
    out = []
    for s in plan.reads:
        base = ptrs.get(s.param_name)
        if base is None:
            base = ptrs[s.param_name] = resolve_param_ptr(s.param_name)
        out.append(ReadDescriptor(s.session, s.src_addr, base + s.dst_byte, s.nbytes))
    return out


def run_full_read(
    fr: FullRead, resolve_param_ptr: Callable[[str], int], transport: ReadExecutor
) -> None:
    """Fetch ``fr`` into a fresh staging buffer and replay its copies locally."""
    # empty, not zeros: pages of rows outside the bounding ranges are never touched,
    # so a large tensor costs memory only for the rows actually pulled.
    staging = torch.empty(fr.staging_nbytes, dtype=torch.uint8)
    base = staging.data_ptr()
    transport.read(
        [ReadDescriptor(s.session, s.src_addr, base + s.dst_byte, s.nbytes) for s in fr.reads]
    )
    full = staging.view(fr.dtype).reshape(fr.global_shape)
    for copy in fr.copies:
        write_through_pointer(
            resolve_param_ptr(copy.param_name), copy, replay_ops(full, copy.op_chain)
        )


def execute_transfer(
    plan: TransferPlan, resolve_param_ptr: Callable[[str], int], transport: ReadExecutor
) -> dict[str, Any]:
    """Move every planned byte through ``transport``; return what moved.

    Exact reads go in one ``read`` call (exactly :func:`exact_descriptors`);
    pack specs need a transport with ``read_packed``; full reads land in staging
    and are replayed. ``fallback`` is reported, never acted on: refusing a plan
    with unsupported sources is the receiver's policy.
    """
    descriptors = exact_descriptors(plan, resolve_param_ptr)
    transport.read(descriptors)
    if plan.packs:
        read_packed = getattr(transport, "read_packed", None)
        if read_packed is None:
            raise TransportError(
                f"the plan has {len(plan.packs)} pack specs but {type(transport).__name__} "
                f"cannot pack strided source regions; re-plan with pack_specs=False"
            )
        read_packed(
            [
                PackedRead(
                    p.session,
                    p.src_addr,
                    p.shape,
                    p.src_strides,
                    p.elsize,
                    resolve_param_ptr(p.param_name) + p.dst_byte,
                    p.dst_strides,
                )
                for p in plan.packs
            ]
        )
    for fr in plan.full_reads:
        run_full_read(fr, resolve_param_ptr, transport)
    return {
        "bytes": plan.bytes_planned(),
        "reads": len(descriptors),
        "packs": len(plan.packs),
        "full_reads": len(plan.full_reads),
        "descriptors": plan.descriptor_count(),
        "fallback": list(plan.fallback),
    }
