"""Lowering: a bound plan turned into the rows and pack specs a daemon's pull runs.

Pure (no I/O, no ``await``): :class:`~refitd.client.receiver.DaemonReceiver` binds the
planner's compiled plan to the manifest's addresses, asks :func:`scratch_layout` how
much scratch it needs, places that scratch (:mod:`refitd.client.engine`), and
:func:`lower` writes every read as one int64 row of ``(src region, src offset, dst
region, dst offset, nbytes)``.

Addresses are synthetic (:data:`~refitd.client.install.SPAN` per region): the planner
sees a parameter's bytes at :func:`param_addr`, and scratch as region -1 (``-SPAN +
offset``), which :func:`lower` names by the scratch region placed.

Scratch layout: [image of the engine region, staging mode only][packed blocks that
land strided][full reads' staged tensors], each block aligned.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from refitd.client.engine import align
from refitd.client.install import SPAN, CompiledPull, Scatter
from refitd.client.swap import unpulled
from refitd.wire import MergedManifest, PackSpec
from transports.batch import merge_ranges

if TYPE_CHECKING:
    from refitd.reshard.compile import BoundPlan
    from refitd.reshard.transfer_plan import FullRead

__all__ = ["ScratchLayout", "engine_layout", "lower", "param_addr", "scratch_layout", "signature"]


def signature(m: MergedManifest, engine_layout: bytes) -> bytes:
    """What a compiled plan is bound to: the source daemon incarnation, every
    tensor's shape/dtype/shards (regions and byte offsets), and the engine layout."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{m.node_id}/{m.incarnation}".encode())
    h.update(msgspec.msgpack.encode(m.tensors))
    h.update(engine_layout)
    return h.digest()


def engine_layout(params: dict[str, torch.nn.Parameter]) -> bytes:
    """The engine's parameters as a plan is bound to them: names, shapes, dtypes."""
    return repr([(n, tuple(p.shape), str(p.dtype)) for n, p in params.items()]).encode()


def param_addr(name: str, staging: bool, engine_id: int, offsets: dict[str, int]) -> int:
    """Where a parameter's bytes land, as a synthetic address: in the engine region
    (``engine_id``; direct and swap modes) or in scratch, written ``-SPAN + offset``
    (``staging``)."""
    if staging:
        return -SPAN + offsets[name]
    return engine_id * SPAN + offsets[name]


@dataclass(frozen=True)
class ScratchLayout:
    """Where a bound plan's blocks sit in scratch (module docstring): ``nbytes`` in
    all, the packed blocks that land strided, each pack's destination (synthetic),
    the full reads at their offsets and their reads' rows ``(src, dst, nbytes)``."""

    nbytes: int
    scatter: list[Scatter]
    pack_dst: list[int]
    full: list[tuple[int, FullRead]]
    fr_rows: list[tuple[int, int, int]]


def scratch_layout(
    bound: BoundPlan, params: dict[str, torch.nn.Parameter], engine_nbytes: int, staging: bool
) -> ScratchLayout:
    """The scratch ``bound`` needs, for an engine region of ``engine_nbytes`` (its
    image at scratch's start in ``staging`` mode)."""
    cursor = engine_nbytes if staging else 0
    scatter: list[Scatter] = []
    pack_dst: list[int] = []
    for p, d in zip(bound.packs, bound.pack_dst.tolist(), strict=True):
        if p.dst_strides is None:
            pack_dst.append(d)
            continue
        dt = params[p.param_name].dtype
        strides = tuple(st // p.elsize for st in p.dst_strides)
        scatter.append((cursor, dt, p.shape, strides, p.param_name, p.dst_byte))
        pack_dst.append(-SPAN + cursor)
        cursor = align(cursor + p.nbytes)
    full: list[tuple[int, FullRead]] = []
    fr_rows: list[tuple[int, int, int]] = []
    for fr in bound.full_reads:
        full.append((cursor, fr))
        fr_rows += [(s.src_addr, -SPAN + cursor + s.dst_byte, s.nbytes) for s in fr.reads]
        cursor = align(cursor + fr.staging_nbytes)
    return ScratchLayout(cursor, scatter, pack_dst, full, fr_rows)


def lower(
    bound: BoundPlan,
    lay: ScratchLayout,
    *,
    scratch_id: int,
    engine_id: int,
    engine_nbytes: int,
    mode: str,
    params: dict[str, torch.nn.Parameter],
    offsets: dict[str, int],
    planned_bytes: int,
    sig: bytes,
) -> CompiledPull:
    """``bound`` as daemon rows and pack specs, scratch laid out as ``lay`` in the
    region ``scratch_id``, the engine region ``engine_id`` of ``engine_nbytes``: the
    compiled pull a refit replays while its signature ``sig`` holds. Staging mode
    also lists the byte ranges of scratch's engine image to install (coalesced), swap mode the
    engine's bytes no read writes (carried over at each swap)."""
    fr_rows = lay.fr_rows
    src = np.concatenate([bound.src, np.array([r[0] for r in fr_rows], dtype=np.int64)])
    dst = np.concatenate([bound.dst, np.array([r[1] for r in fr_rows], dtype=np.int64)])
    nb = np.concatenate([bound.nbytes, np.array([r[2] for r in fr_rows], dtype=np.int64)])
    rows = np.stack([src // SPAN, src % SPAN, dst // SPAN, dst % SPAN, nb], axis=1)
    # Destination region -1 stands for the scratch region (see param_addr).
    rows[rows[:, 2] == -1, 2] = scratch_id
    pdst = np.array(lay.pack_dst, dtype=np.int64)
    packs = [
        PackSpec(
            int(a // SPAN),
            int(a % SPAN),
            p.shape,
            tuple(st // p.elsize for st in p.src_strides),
            p.elsize,
            scratch_id if d // SPAN == -1 else int(d // SPAN),
            int(d % SPAN),
        )
        for p, a, d in zip(bound.packs, bound.pack_src.tolist(), pdst.tolist(), strict=True)
    ]
    install = _image_ranges(rows, packs, scratch_id, engine_nbytes) if mode == "staging" else []
    comp = CompiledPull(sig, rows, packs, lay.scatter, lay.full, install)
    comp.bytes = planned_bytes
    comp.engine_id = engine_id
    if mode == "swap":
        comp.keep = unpulled(comp, params, offsets)
    return comp


def _image_ranges(
    rows: npt.NDArray[np.int64], packs: list[PackSpec], scratch_id: int, limit: int
) -> list[tuple[int, int]]:
    """Staging mode: the byte ranges of scratch's engine image (its first ``limit``
    bytes) that reads write, coalesced: what an install copies into the engine."""
    image = [(int(r[3]), int(r[4])) for r in rows if r[2] == scratch_id and r[3] < limit]
    image += [
        (p.dst_offset, p.nbytes)
        for p in packs
        if p.dst_region == scratch_id and p.dst_offset < limit
    ]
    staged = np.array(image, dtype=np.int64).reshape(-1, 2)
    merged = merge_ranges(np.zeros(len(staged), np.int64), staged[:, 0], staged[:, 1])
    return [(r.offset, r.nbytes) for r in merged]
