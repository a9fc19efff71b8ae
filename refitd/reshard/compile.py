"""Compiled plans: a plan lowered to flat arrays, bound to the signature it was warmed on.

A refit repeats every step with the same geometry, so planning runs once. The plan
is lowered to numpy arrays (one row per exact segment; pack specs and full pulls
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

import numpy as np
import numpy.typing as npt
import torch

from refitd.errors import PlanError
from refitd.reshard.slice_plan import Segment
from refitd.reshard.transfer_plan import FullPull, PackSpec, SourceInfo, TransferPlan
from refitd.reshard.transport import PackedRead, ReadDescriptor

__all__ = [
    "BoundPlan",
    "CompiledPlan",
    "DestLayout",
    "PlanSignature",
    "SignatureMismatch",
    "compile_plan",
    "dest_layout_of",
    "destination_signature",
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

    manifest: bytes
    destination: bytes
    options: tuple[object, ...]


def manifest_signature(sources: Mapping[str, SourceInfo]) -> bytes:
    """Digest of the manifest's structure, in the mapping's order; O(sources) once
    each ``SourceInfo`` has cached its own digest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(sources)).encode())
    h.update(b"".join([info.structure_digest for info in sources.values()]))
    return h.digest()


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
    addresses; ``full_pulls`` carry rebased segments.
    """

    sessions: tuple[str, ...]
    session: IntArray
    src: IntArray
    dst: IntArray
    nbytes: IntArray
    packs: tuple[PackSpec, ...]
    pack_src: IntArray
    pack_dst: IntArray
    full_pulls: tuple[FullPull, ...]

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


@dataclass(frozen=True)
class CompiledPlan:
    """A :class:`TransferPlan` lowered to arrays and bound to its signature."""

    signature: PlanSignature
    plan: TransferPlan
    sessions: tuple[str, ...]
    params: tuple[str, ...]
    seg_session: IntArray
    seg_src: IntArray
    seg_param: IntArray
    seg_dst: IntArray
    seg_nbytes: IntArray
    pack_session: IntArray
    pack_src: IntArray
    pack_param: IntArray
    pack_dst: IntArray
    fp_session: tuple[IntArray, ...]
    ref_sources: tuple[str, ...]
    ref_counts: IntArray
    ref_session: IntArray
    ref_addr: IntArray

    def mismatch(
        self, sources: Mapping[str, SourceInfo], dest_layout: DestLayout | None = None
    ) -> str | None:
        """Why this plan cannot replay for ``sources``/``dest_layout``, or ``None``."""
        if manifest_signature(sources) != self.signature.manifest:
            return "the manifest structure changed (sources, shapes, dtypes or shard layouts)"
        if (
            dest_layout is not None
            and destination_signature(dest_layout) != self.signature.destination
        ):
            return "the destination layout changed (parameter names, shapes, strides or dtypes)"
        return None

    def _session_shift(self, sources: Mapping[str, SourceInfo]) -> IntArray:
        parts = [sources[n].shard_addrs for n in self.ref_sources]
        new = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
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
                f"was compiled; reads merged across them would be wrong. Re-plan."
            )
        return np.where(used, lo, 0)

    def bind(
        self,
        sources: Mapping[str, SourceInfo],
        resolve_param_ptr: Callable[[str], int],
        dest_layout: DestLayout | None = None,
    ) -> BoundPlan:
        """Rebase this plan onto ``sources`` and the parameters' current addresses.

        Raises :class:`SignatureMismatch` when the signature differs: re-plan, and
        warm the exact signature first if replays must never plan.
        """
        why = self.mismatch(sources, dest_layout)
        if why is not None:
            raise SignatureMismatch(
                f"compiled plan refused: {why}. A compiled plan replays only for the exact "
                f"signature it was warmed on; re-plan (warm the exact signature first)."
            )
        shift = self._session_shift(sources)
        ptrs = np.array([resolve_param_ptr(p) for p in self.params], dtype=np.int64)
        fps = tuple(
            replace(
                fp,
                segments=[
                    replace(s, src_addr=s.src_addr + int(shift[c]))
                    for s, c in zip(fp.segments, codes.tolist(), strict=True)
                ],
            )
            for fp, codes in zip(self.plan.full_pulls, self.fp_session, strict=True)
        )
        return BoundPlan(
            self.sessions,
            self.seg_session,
            self.seg_src + shift[self.seg_session],
            ptrs[self.seg_param] + self.seg_dst if ptrs.size else self.seg_dst.copy(),
            self.seg_nbytes,
            tuple(self.plan.packs),
            self.pack_src + shift[self.pack_session],
            ptrs[self.pack_param] + self.pack_dst if ptrs.size else self.pack_dst.copy(),
            fps,
        )


def _codes(values: list[str], table: dict[str, int]) -> IntArray:
    return np.array([table.setdefault(v, len(table)) for v in values], dtype=np.int64)


def compile_plan(
    plan: TransferPlan,
    sources: Mapping[str, SourceInfo],
    dest_layout: DestLayout,
    options: tuple[object, ...] = (),
) -> CompiledPlan:
    """Lower ``plan`` (made from ``sources`` for ``dest_layout``) to a compiled plan."""
    if plan.fallback:
        raise PlanError(
            f"refusing to compile a plan with {len(plan.fallback)} fallback sources "
            f"({plan.fallback[:5]}); it must never be executed"
        )
    sessions: dict[str, int] = {}
    params: dict[str, int] = {}
    segs: list[Segment] = plan.segments
    planned = set(plan.planned_sources)
    ref = [n for n in sources if n in planned]
    ref_session = [s.session for n in ref for s in sources[n].shards]
    ref_codes = _codes(ref_session, sessions)
    compiled = CompiledPlan(
        signature=PlanSignature(
            manifest_signature(sources), destination_signature(dest_layout), options
        ),
        plan=plan,
        sessions=(),
        params=(),
        seg_session=_codes([s.session for s in segs], sessions),
        seg_src=np.array([s.src_addr for s in segs], dtype=np.int64),
        seg_param=_codes([s.param_name for s in segs], params),
        seg_dst=np.array([s.dst_byte for s in segs], dtype=np.int64),
        seg_nbytes=np.array([s.nbytes for s in segs], dtype=np.int64),
        pack_session=_codes([p.session for p in plan.packs], sessions),
        pack_src=np.array([p.src_addr for p in plan.packs], dtype=np.int64),
        pack_param=_codes([p.param_name for p in plan.packs], params),
        pack_dst=np.array([p.dst_byte for p in plan.packs], dtype=np.int64),
        fp_session=tuple(
            _codes([s.session for s in fp.segments], sessions) for fp in plan.full_pulls
        ),
        ref_sources=tuple(ref),
        ref_counts=np.array([len(sources[n].shards) for n in ref], dtype=np.int64),
        ref_session=ref_codes,
        ref_addr=np.concatenate([sources[n].shard_addrs for n in ref])
        if ref
        else np.zeros(0, dtype=np.int64),
    )
    return replace(
        compiled,
        sessions=tuple(sorted(sessions, key=sessions.__getitem__)),
        params=tuple(sorted(params, key=params.__getitem__)),
    )
