"""Compiled plans: a plan lowered to flat arrays, bound to the signature it was warmed on.

A refit repeats every step with the same geometry, so planning runs once. The plan
is lowered to numpy arrays (one row per exact read; pack specs and full reads
alongside) and bound to a :class:`PlanSignature`:

- the *manifest structure*: every source's name, global shape, dtype, element size
  and shard layout (boxes and sessions) — not the shard addresses;
- the *destination layout*: every parameter's name, shape, stride and dtype;
- the planning options.

Replaying does no planning: it checks the signature, checks that each session's
shards moved together (one base shift per session, so merged reads stay valid),
and rebases addresses with array adds. Any other change is a :class:`SignatureMismatch`;
the caller re-plans, or — strict mode — reports it, because a plan replays only for
the exact signature it was warmed on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from refitd.errors import PlanError, TransportError
from refitd.reshard.reads import PackedRead, ReadDescriptor, ReadExecutor
from refitd.reshard.slice_plan import Read
from refitd.reshard.transfer_plan import FullRead, PackPlan, SourceInfo, TransferPlan, run_full_read

__all__ = [
    "BoundPlan",
    "CompiledPlan",
    "DestLayout",
    "ManifestLayout",
    "PlanSignature",
    "SignatureMismatch",
    "compile_plan",
    "dest_layout_of",
    "destination_signature",
    "execute_bound",
    "manifest_signature",
]

IntArray = npt.NDArray[np.int64]

DestLayout = Mapping[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]
"""Parameter name -> ``(shape, stride, dtype)``, shape and stride in elements."""


class SignatureMismatch(PlanError):
    """A compiled plan was asked to replay for a signature it was not warmed on."""


@dataclass(frozen=True)
class PlanSignature:
    """Digests of what a compiled plan depends on (see the module docstring)."""

    manifest: int
    destination: bytes
    options: tuple[object, ...]


def manifest_signature(sources: Mapping[str, SourceInfo]) -> int:
    """A process-local hash of a whole manifest's structure, in the mapping's order:
    names plus each source's ``layout_key`` (everything but addresses)."""
    return hash((tuple(sources), tuple(map(_KEY, sources.values()))))


def dest_layout_of(
    params: Mapping[str, torch.Tensor],
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """The destination layout of real (or meta) parameters."""
    return {n: (tuple(p.shape), tuple(p.stride()), p.dtype) for n, p in params.items()}


def destination_signature(layout: DestLayout) -> bytes:
    text = repr(sorted((n, s, st, str(dt)) for n, (s, st, dt) in layout.items()))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class BoundPlan:
    """A compiled plan with addresses for one refit: every array is ready to post.

    ``src``/``dst`` are absolute byte addresses, ``nbytes`` bytes, ``session`` an
    index into ``sessions``. ``pack_src``/``pack_dst`` are the rebased pack specs'
    addresses; ``full_reads`` carry rebased reads.
    """

    sessions: tuple[str, ...]
    session: IntArray
    src: IntArray
    dst: IntArray
    nbytes: IntArray
    packs: tuple[PackPlan, ...]
    pack_src: IntArray
    pack_dst: IntArray
    full_reads: tuple[FullRead, ...]

    def descriptors(self) -> list[ReadDescriptor]:
        names = self.sessions
        return [
            ReadDescriptor(names[s], a, d, n)
            for s, a, d, n in zip(
                self.session.tolist(),
                self.src.tolist(),
                self.dst.tolist(),
                self.nbytes.tolist(),
                strict=True,
            )
        ]

    def packed_reads(self) -> list[PackedRead]:
        return [
            PackedRead(p.session, a, p.shape, p.src_strides, p.elsize, d, p.dst_strides)
            for p, a, d in zip(
                self.packs, self.pack_src.tolist(), self.pack_dst.tolist(), strict=True
            )
        ]


_KEY = attrgetter("layout_key")
_ADDRS = attrgetter("shard_addrs")
_SESSION = attrgetter("session")


@dataclass(frozen=True)
class ManifestLayout:
    """The manifest structure a compiled plan depends on.

    ``names`` are all source names in manifest order; ``ref_sources`` the ones the
    plan reads and ``keys`` their ``SourceInfo.layout_key``. Unread sources only
    need to keep their names: the plan never touches their bytes.
    """

    names: tuple[str, ...]
    ref_sources: tuple[str, ...]
    keys: list[int]


@dataclass(frozen=True)
class CompiledPlan:
    """A :class:`TransferPlan` lowered to arrays and bound to its signature.

    ``read_*`` hold one row per exact read (session and parameter as codes into
    ``sessions``/``params``, byte addresses and offsets), ``pack_*`` one row per pack
    spec, ``fr_session`` the session codes of each full read's reads;
    ``ref_session``/``ref_addr`` every read shard's session code and compile-time
    address, in :class:`ManifestLayout` order.
    """

    signature: PlanSignature
    layout: ManifestLayout
    plan: TransferPlan
    sessions: tuple[str, ...]
    params: tuple[str, ...]
    read_session: IntArray
    read_src: IntArray
    read_param: IntArray
    read_dst: IntArray
    read_nbytes: IntArray
    pack_session: IntArray
    pack_src: IntArray
    pack_param: IntArray
    pack_dst: IntArray
    fr_session: tuple[IntArray, ...]
    ref_session: IntArray
    ref_addr: IntArray

    def mismatch(
        self, sources: Mapping[str, SourceInfo], dest_layout: DestLayout | None = None
    ) -> str | None:
        """Why this plan cannot replay for ``sources``/``dest_layout``, or ``None``."""
        why, addrs = self._scan(sources, dest_layout)
        if why is None:
            try:
                self._session_shift(addrs)
            except SignatureMismatch as exc:
                return str(exc)
        return why

    def _scan(
        self, sources: Mapping[str, SourceInfo], dest_layout: DestLayout | None
    ) -> tuple[str | None, IntArray]:
        """Check the signature and gather the read shards' addresses.

        Cost: O(sources) name comparisons plus O(sources read) key comparisons and
        array concatenation; never a walk over shards (each ``SourceInfo`` keyed
        its own layout when it was built).
        """
        none = np.zeros(0, dtype=np.int64)
        lay = self.layout
        if tuple(sources) != lay.names:
            return "the manifest's sources changed (added, removed or reordered)", none
        infos = [sources[n] for n in lay.ref_sources]
        if list(map(_KEY, infos)) != lay.keys:
            return (
                "a source the plan reads changed its shape, dtype, shard boxes or sessions",
                none,
            )
        if (
            dest_layout is not None
            and destination_signature(dest_layout) != self.signature.destination
        ):
            return (
                "the destination layout changed (parameter names, shapes, strides or dtypes)",
                none,
            )
        addrs = list(map(_ADDRS, infos))
        return None, np.concatenate(addrs) if addrs else none

    def _session_shift(self, new: IntArray) -> IntArray:
        """Per-session address shift; every shard of one session must move alike."""
        delta = new - self.ref_addr
        n = len(self.sessions)
        lo = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        hi = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(lo, self.ref_session, delta)
        np.maximum.at(hi, self.ref_session, delta)
        used = lo <= hi
        if bool((lo[used] != hi[used]).any()):
            moved = [self.sessions[i] for i in np.flatnonzero(used & (lo != hi)).tolist()]
            raise SignatureMismatch(
                f"shards of sessions {moved[:5]} moved relative to each other since the plan "
                f"was compiled, so reads merged across them would be wrong; re-plan"
            )
        shift: IntArray = np.where(used, lo, 0)
        return shift

    def bind(
        self,
        sources: Mapping[str, SourceInfo],
        resolve_param_ptr: Callable[[str], int],
        dest_layout: DestLayout | None = None,
    ) -> BoundPlan:
        """Rebase this plan onto ``sources`` and the parameters' current addresses.

        Does no planning. Raises :class:`SignatureMismatch` when the signature
        differs: re-plan, and warm the exact signature first where replays must
        never plan.
        """
        why, addrs = self._scan(sources, dest_layout)
        if why is not None:
            raise SignatureMismatch(
                f"compiled plan refused: {why}. A compiled plan replays only for the exact "
                f"signature it was warmed on; re-plan (warm the exact signature first)."
            )
        shift = self._session_shift(addrs)
        ptrs = np.array([resolve_param_ptr(p) for p in self.params], dtype=np.int64)
        if not ptrs.size:
            ptrs = np.zeros(1, dtype=np.int64)
        frs = tuple(
            replace(
                fr,
                reads=[
                    replace(s, src_addr=s.src_addr + int(shift[c]))
                    for s, c in zip(fr.reads, codes.tolist(), strict=True)
                ],
            )
            for fr, codes in zip(self.plan.full_reads, self.fr_session, strict=True)
        )
        return BoundPlan(
            self.sessions,
            self.read_session,
            self.read_src + shift[self.read_session],
            ptrs[self.read_param] + self.read_dst,
            self.read_nbytes,
            tuple(self.plan.packs),
            self.pack_src + shift[self.pack_session],
            ptrs[self.pack_param] + self.pack_dst,
            frs,
        )

    def replay(
        self,
        sources: Mapping[str, SourceInfo],
        resolve_param_ptr: Callable[[str], int],
        transport: ReadExecutor,
        dest_layout: DestLayout | None = None,
    ) -> dict[str, Any]:
        """:meth:`bind`, then move the bytes through ``transport``; no planning."""
        return execute_bound(
            self.bind(sources, resolve_param_ptr, dest_layout), resolve_param_ptr, transport
        )


def _codes(values: list[str], table: dict[str, int]) -> IntArray:
    return np.array([table.setdefault(v, len(table)) for v in values], dtype=np.int64)


def compile_plan(
    plan: TransferPlan,
    sources: Mapping[str, SourceInfo],
    dest_layout: DestLayout,
    options: tuple[object, ...] = (),
) -> CompiledPlan:
    """Lower ``plan`` (made from ``sources`` for ``dest_layout``) to a compiled plan.

    Refuses a plan with any ``fallback`` source: it must never run.
    """
    if plan.fallback:
        raise PlanError(
            f"refusing to compile a plan with {len(plan.fallback)} fallback sources "
            f"({plan.fallback[:5]}); it must never be executed"
        )
    sessions: dict[str, int] = {}
    params: dict[str, int] = {}
    reads: list[Read] = plan.reads
    planned = set(plan.planned_sources)
    ref = tuple(n for n in sources if n in planned)
    infos = [sources[n] for n in ref]
    shards = [s for info in infos for s in info.shards]
    layout = ManifestLayout(names=tuple(sources), ref_sources=ref, keys=list(map(_KEY, infos)))
    ref_session = _codes([s.session for s in shards], sessions)
    compiled = CompiledPlan(
        signature=PlanSignature(
            manifest_signature(sources), destination_signature(dest_layout), options
        ),
        layout=layout,
        plan=plan,
        sessions=(),
        params=(),
        read_session=_codes([s.session for s in reads], sessions),
        read_src=np.array([s.src_addr for s in reads], dtype=np.int64),
        read_param=_codes([s.param_name for s in reads], params),
        read_dst=np.array([s.dst_byte for s in reads], dtype=np.int64),
        read_nbytes=np.array([s.nbytes for s in reads], dtype=np.int64),
        pack_session=_codes([p.session for p in plan.packs], sessions),
        pack_src=np.array([p.src_addr for p in plan.packs], dtype=np.int64),
        pack_param=_codes([p.param_name for p in plan.packs], params),
        pack_dst=np.array([p.dst_byte for p in plan.packs], dtype=np.int64),
        fr_session=tuple(_codes([s.session for s in fr.reads], sessions) for fr in plan.full_reads),
        ref_session=ref_session,
        ref_addr=np.array([s.addr for s in shards], dtype=np.int64),
    )
    return replace(
        compiled,
        sessions=tuple(sorted(sessions, key=sessions.__getitem__)),
        params=tuple(sorted(params, key=params.__getitem__)),
    )


def execute_bound(
    bound: BoundPlan, resolve_param_ptr: Callable[[str], int], transport: ReadExecutor
) -> dict[str, Any]:
    """Post a bound plan's reads; full reads are fetched to staging and replayed."""
    transport.read(bound.descriptors())
    if bound.packs:
        read_packed = getattr(transport, "read_packed", None)
        if read_packed is None:
            raise TransportError(
                f"{len(bound.packs)} pack specs planned but {type(transport).__name__} "
                f"cannot pack; plan with pack_specs=False for this transport"
            )
        read_packed(bound.packed_reads())
    for fr in bound.full_reads:
        run_full_read(fr, resolve_param_ptr, transport)
    return {
        "bytes": int(bound.nbytes.sum())
        + sum(p.nbytes for p in bound.packs)
        + sum(fr.nbytes() for fr in bound.full_reads),
        "reads": int(bound.nbytes.size),
        "packs": len(bound.packs),
        "full_reads": len(bound.full_reads),
        "fallback": [],
    }
