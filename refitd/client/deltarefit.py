"""Delta refit, the engine side: pull only what changed since the version the engine
holds, checked against that base first, applied transactionally.

:class:`DeltaReceiver` is a :class:`~refitd.client.receiver.DaemonReceiver` whose
refit tries a delta first:

1. plan (or replay) the version's full pull exactly as a full refit does;
2. check the base before any byte moves: the engine holds a version refitd installed
   (``version``, the source's content digest of it), its memory still has the lane
   digest it had then (``verify_engine``), the scratch layout is this plan's, and no
   anchor is due. The source stages the changed units of the plan's stream only if
   its delta (or a chain of them) starts at exactly that version and digest. Any
   mismatch runs a full refit instead, and :attr:`DeltaReceiver.last` says why;
3. pull the staged delta into a region of its own: nothing of the engine is written
   until every byte of it has landed;
4. apply: each changed unit goes where the full pull would have landed it (the
   engine's memory, a packed block scattered by its strides, or a full pull's
   staged tensor, replayed). Every write keeps the value it overwrote
   (:class:`~refitd.delta.undo.UndoLog`); an error, or one ``after_apply`` raises,
   rolls every write back, so the engine serves its base.

After any number of deltas the parameters equal a full refit of the same version,
bit for bit (``tests/delta``). Host-memory engines only: a GPU engine refits in full.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from refitd.client.install import CompiledPull
from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.delta import native
from refitd.delta.diff import unit_dtype
from refitd.delta.digest import EngineDigest
from refitd.delta.stream import (
    areas_of,
    decode,
    decode_values,
    landing,
    layout,
    scattered,
    unpack_nibbles,
)
from refitd.delta.undo import UndoLog
from refitd.errors import ConflictError, NotFoundError, RefitError
from refitd.wire import DeltaPackRequest, DeltaStaged, DescriptorTable, PullProgress, PullRequest
from transports.segments import SharedSegment

__all__ = ["AUTO_SAME_HOST", "DeltaReceiver", "DeltaStats"]

AUTO_SAME_HOST = (
    "auto: the source is on this host (the last full pull read shared memory), "
    "where a full refit copies at memory speed and a delta is not faster"
)
"""The reason ``prefer="auto"`` gives for refitting in full on the source's host."""

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class DeltaStats:
    """How one refit went: ``kind`` says which ran, ``reason`` why a full one did;
    ``wire_bytes`` what it pulled, ``full_bytes`` what a full refit of it pulls;
    ``changed`` the units applied (``unit`` bytes each).

    A delta's seconds, in order: ``check_s`` the engine's base check (its digest
    window), ``stage_s`` the source selecting and staging the changes (its
    request), the pull (``refit.pull_s``), then ``apply_s``: ``place_s`` decoding
    and placing each unit, ``write_s`` the writes with their undo record,
    ``digest_s`` the engine digest's update, ``post_s`` ``after_apply``."""

    refit: RefitStats
    kind: Literal["delta", "full"]
    reason: str
    wire_bytes: int
    full_bytes: int
    changed: int = 0
    unit: int = 0
    check_s: float = 0.0
    apply_s: float = 0.0
    undo_bytes: int = 0
    stage_s: float = 0.0
    place_s: float = 0.0
    write_s: float = 0.0
    digest_s: float = 0.0
    post_s: float = 0.0


class _PullRefused(Exception):
    """The delta's pull failed (its cause): the engine was not written."""


@dataclass
class _Base:
    version: int
    digest: str  # the source's content digest of that version
    engine: EngineDigest  # the engine memory's, as refits wrote it
    layout: bytes  # the scratch layout of the plan that installed it


class DeltaReceiver(DaemonReceiver):
    """A receiver that refits by delta when its engine holds the base exactly.

    ``anchor_every``: every N-th refit is a full one (0: never by count);
    ``verify_engine``: check the engine memory's digest before each delta;
    ``verify_every``: each check reads ``1/verify_every`` of the engine memory (a
    window that moves on), so memory written outside a refit is found by the
    ``verify_every``-th delta after the write at the latest (1: before the next
    delta, one whole read each time; :mod:`refitd.delta.digest`);
    ``prefer``: ``"delta"`` tries a delta whenever the base allows, ``"auto"`` only
    when the source is across a link (the last full pull did not read this host's
    shared memory): on one host a full refit copies at memory speed and a delta's
    scattered writes are not faster; ``after_apply``: called once a delta is
    written (the engine's post-load processing), a raise rolls it back. Other
    arguments are
    :class:`DaemonReceiver`'s; only ``"staging"`` mode keeps the full pulls' staged
    tensors a delta patches, so deltas need it or no full pull in the plan.
    """

    def __init__(
        self,
        *,
        anchor_every: int = 0,
        verify_engine: bool = True,
        verify_every: int = 4,
        prefer: Literal["delta", "auto"] = "delta",
        after_apply: Callable[[], None] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if verify_every < 1:
            raise ValueError(f"verify_every={verify_every} refused: a check reads 1/N, N >= 1")
        if prefer not in ("delta", "auto"):
            raise ValueError(f"prefer={prefer!r} refused: 'delta' or 'auto'")
        self.anchor_every = anchor_every
        self.verify_engine = verify_engine
        self.verify_every = verify_every
        self.prefer = prefer
        self._same_host: bool | None = None  # the last full pull read shared memory
        self.after_apply = after_apply
        self.last: DeltaStats | None = None
        self._base: _Base | None = None
        self._since_anchor = 0
        self._delta_seg: SharedSegment | None = None
        self._delta_region: int | None = None
        self._overlap_for: CompiledPull | None = None
        self._overlap = True

    # ------------------------------------------------------------ the base

    @property
    def base_version(self) -> int | None:
        """The version the engine holds as a delta base (None: none)."""
        return None if self._base is None else self._base.version

    def forget_base(self) -> None:
        """The engine's parameters were changed outside refitd: the next refit is full."""
        self._base = None

    def _engine_bytes(self) -> npt.NDArray[np.uint8]:
        assert self._engine_seg is not None
        return self._engine_seg.numpy()

    def _layout_key(self, comp: CompiledPull) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        scratch = self._scratch_region.region_id if self._scratch_region is not None else -1
        h.update(repr((self.mode, scratch, [s[0] for s in comp.scatter])).encode())
        h.update(repr([(at, fp.staging_nbytes) for at, fp in comp.full_pulls]).encode())
        return h.digest()

    def _why_full(self, version: int, comp: CompiledPull) -> str:
        """Why this refit cannot be a delta (``""``: it can, as far as the engine knows)."""
        base = self._base
        if self._engine_seg is None:
            return "the engine's parameters are in GPU memory: deltas apply in host memory"
        if self._auto_full():
            return AUTO_SAME_HOST
        if base is None:
            return "no base: the engine holds no version a refit installed and checked"
        if version <= base.version:
            return f"v{version} is not newer than the engine's v{base.version}"
        if self.anchor_every and self._since_anchor + 1 >= self.anchor_every:
            return f"anchor: a full refit every {self.anchor_every} versions"
        if comp.full_pulls and self.mode != "staging":
            return "the plan has full pulls, whose staged tensors only staging mode keeps"
        if base.layout != self._layout_key(comp):
            return "the plan's destinations moved since the base was installed"
        if self.verify_engine:
            block = base.engine.differs(self._engine_bytes(), self.verify_every)
            if block is not None:
                at = block * base.engine.block
                return (
                    f"the engine's memory differs from v{base.version} as refitd installed "
                    f"it (digest mismatch in bytes {at}..{at + base.engine.block}): it was "
                    "written outside a refit"
                )
        return ""

    def _auto_full(self) -> bool:
        """``prefer="auto"`` and the last full pull read this host's shared memory."""
        return self.prefer == "auto" and bool(self._same_host)

    async def _record_base(self, version: int, comp: CompiledPull, digest: str) -> None:
        if self._engine_seg is None or not digest:
            self._base = None
            return
        engine = EngineDigest.of(self._engine_bytes())
        self._base = _Base(version, digest, engine, self._layout_key(comp))

    # ------------------------------------------------------------ refit

    async def _refit_leased(
        self,
        version: int,
        lease_id: str,
        t0: float,
        on_progress: Callable[[PullProgress], None] | None,
    ) -> RefitStats:
        comp, replayed, (t1, t2) = await self._prepare(version)
        reason = self._why_full(version, comp)
        t_check = time.perf_counter()
        staged: DeltaStaged | None = None
        if not reason:
            assert self._base is not None
            req = DeltaPackRequest(
                self.model,
                version,
                lease_id,
                self._base.version,
                self._base.digest,
                DescriptorTable.pack(comp.rows),
                comp.packs,
                nibbles=True,
            )
            try:
                staged = await self.source.delta_pack(req)
            except (ConflictError, NotFoundError) as exc:
                reason = f"the source refused the delta: {exc}"
        t3 = time.perf_counter()
        if staged is not None:
            times = (t0, t1, t2, t_check, t3)
            try:
                return await self._delta(comp, staged, version, lease_id, replayed, times)
            except _PullRefused as exc:
                # Nothing of the engine was written: the same refit goes on in full.
                reason = (
                    f"the delta's pull was refused ({exc.__cause__}); a host mirror "
                    "carries whole versions, not a source's staged delta"
                )
        self._base = None  # until the full refit has landed
        stats = await self._pull_install(
            comp, version, lease_id, replayed, (t0, t1, t2), on_progress
        )
        return await self._full(version, comp, stats, reason)

    async def _full(
        self, version: int, comp: CompiledPull, stats: RefitStats, reason: str
    ) -> RefitStats:
        """A full refit of ``version`` has landed: record it as the next delta's base."""
        self._same_host = stats.pull.path.startswith("shm")
        self._since_anchor = 0
        if self._auto_full():
            # Every refit from this source is full: no base is recorded, so the full
            # path pays no delta bookkeeping (no wait for the source's comparison, no
            # read of the engine memory for its digest). A later pull over a transport
            # (the source moved) records one again.
            self._base = None
        else:
            info = await self.source.delta_info(self.model, version, wait_s=30.0)
            await self._record_base(version, comp, info.digest)
        b = stats.pull.bytes_total
        self.last = DeltaStats(stats, "full", reason, b, b)
        return stats

    async def _delta_landing(self, nbytes: int) -> int:
        """This receiver's region for staged deltas, of at least ``nbytes`` bytes."""
        if self._delta_seg is not None and self._delta_seg.size >= nbytes:
            assert self._delta_region is not None
            return self._delta_region
        if self._delta_region is not None and self._delta_seg is not None:
            await self.local.delete_region(self._delta_region)
            self._delta_seg.close()
        self._delta_seg = SharedSegment.create(max(nbytes, 1 << 16), "delta")
        info = await self.local.attach_region(
            self._delta_seg.name, self._delta_seg.size, label="delta"
        )
        self._delta_region = info.region_id
        return info.region_id

    async def _delta(
        self,
        comp: CompiledPull,
        staged: DeltaStaged,
        version: int,
        lease_id: str,
        replayed: bool,
        times: tuple[float, float, float, float, float],
    ) -> RefitStats:
        t0, t1, t2, t_check, t3 = times
        region = await self._delta_landing(staged.nbytes)
        row = np.array([[staged.region.region_id, 0, region, 0, staged.nbytes]], dtype=np.int64)
        src = self.source.base_url if self.source.base_url != self.local.base_url else ""
        req = PullRequest(self.model, version, lease_id, DescriptorTable.pack(row), [], src)
        try:
            pull = await self.local.pull(req)  # a failure here wrote nothing of the engine
        except RefitError as exc:
            raise _PullRefused() from exc
        t4 = time.perf_counter()
        assert self._delta_seg is not None
        payload = self._delta_seg.numpy()[: staged.nbytes].copy()
        undo = UndoLog()
        assert self._base is not None
        kept = self._base.engine.copy()
        parts = [0.0, 0.0, 0.0]
        try:
            changed = self._apply(comp, staged, payload, undo, parts)
            t_post = time.perf_counter()
            if self.after_apply is not None:
                self.after_apply()
        except BaseException:
            # Every write put back: the engine holds its base, bit for bit, still.
            undo.rollback()
            self._base.engine = kept
            raise
        t5 = time.perf_counter()
        assert self._base is not None
        self._base = _Base(version, staged.digest, self._base.engine, self._base.layout)
        self._since_anchor += 1
        stats = RefitStats(
            version,
            replayed,
            staged.nbytes,
            1,
            0,
            0,
            0,
            t1 - t0,
            t2 - t1,
            t4 - t3,
            t5 - t4,
            t5 - t0,
            pull,
        )
        self.last = DeltaStats(
            stats,
            "delta",
            "",
            staged.nbytes,
            int(comp.rows[:, 4].sum()) + sum(p.nbytes for p in comp.packs),  # full pull
            changed,
            staged.unit,
            t_check - t2,
            t5 - t4,
            undo.nbytes,
            t3 - t_check,
            parts[0],
            parts[1],
            parts[2],
            t5 - t_post,
        )
        return stats

    # ------------------------------------------------------------ applying

    def _apply(
        self,
        comp: CompiledPull,
        staged: DeltaStaged,
        payload: npt.NDArray[np.uint8],
        undo: UndoLog,
        parts: list[float],
    ) -> int:
        """Write the staged delta where the full pull would have landed each unit (see
        the module docstring); every write recorded in ``undo``. Returns units written;
        adds the seconds of placing, writing and the digest's update to ``parts``."""
        assert self._engine_region is not None and self._base is not None
        t0 = time.perf_counter()
        unit = staged.unit
        udt = unit_dtype(unit)
        bits = staged.diff_bits
        if bits not in (4, 8):
            raise ConflictError(f"delta refused: {bits}-bit differences are not a format")
        lay = layout(staged.pages, staged.changed, staged.exceptions, unit, bits)
        counts = payload[lay.counts : lay.counts + staged.pages]
        low = payload[lay.low : lay.low + staged.changed]
        diff = payload[lay.diff : lay.exceptions].view(np.int8)  # bits == 4: two a byte
        exceptions = payload[lay.exceptions : lay.exceptions + unit * staged.exceptions].view(udt)
        if int(counts.sum()) != staged.changed:
            raise ConflictError(
                f"delta of v{staged.base_version}+1 refused: its page counts sum to "
                f"{int(counts.sum())}, not the {staged.changed} positions it carries"
            )
        pieces = np.concatenate(
            [
                comp.rows[:, 2:5],
                np.array(
                    [(p.dst_region, p.dst_offset, p.nbytes) for p in comp.packs], dtype=np.int64
                ).reshape(-1, 3),
            ]
        )
        if int(pieces[:, 2].sum()) // unit != staged.stream_units:
            raise ConflictError(
                f"delta refused: the source staged it for a stream of {staged.stream_units} "
                f"units, this plan's is {int(pieces[:, 2].sum()) // unit}"
            )
        engine_id = self._engine_region.region_id
        scratch_id = self._scratch_region.region_id if self._scratch_region is not None else -2
        limit = self._engine_region.nbytes if self.mode == "staging" else 0
        scat_of, fp_of = areas_of(comp, pieces, scratch_id)
        if self._direct(comp, pieces, scat_of, fp_of, engine_id, scratch_id, limit):
            return self._apply_direct(pieces, counts, low, diff, exceptions, undo, parts, t0, bits)
        k = decode(counts, low)
        if bits == 4:
            diff = unpack_nibbles(diff.view(np.uint8), staged.changed)
        else:
            diff = diff[: staged.changed]
        piece, region, off = landing(pieces, k, unit)
        # Where each unit lands in the engine's memory (-1: in a scratch area).
        eng = np.where((region == engine_id) | ((region == scratch_id) & (off < limit)), off, -1)
        sid = scat_of[piece]
        hit = sid >= 0
        if hit.any():
            eng[hit] = scattered(comp.scatter, self._param_off, sid[hit], off[hit])
        fid = fp_of[piece]
        scratch_writes = fid >= 0
        dirty = np.flatnonzero(np.bincount(fid[scratch_writes], minlength=len(comp.full_pulls)))
        unplaced = (eng < 0) & ~scratch_writes
        if unplaced.any():
            bad = int(np.flatnonzero(unplaced)[0])
            raise ConflictError(
                f"delta refused: stream unit {int(k[bad])} lands in region {int(region[bad])} "
                f"at {int(off[bad])}, outside the engine and this plan's scratch areas"
            )
        engine_u = self._engine_bytes().view(udt)
        at_eng = eng >= 0
        # Each value is sent as its difference from the base's unit where it lands.
        scratch_u = self._scratch_seg.numpy().view(udt) if self._scratch_seg is not None else None
        old = np.empty(len(k), dtype=udt)
        old[at_eng] = engine_u[eng[at_eng] // unit]
        if scratch_writes.any():
            assert scratch_u is not None
            old[scratch_writes] = scratch_u[off[scratch_writes] // unit]
        values = decode_values(old, diff, exceptions)
        idx = eng[at_eng] // unit
        vals, prev = values[at_eng], old[at_eng]
        if self._overlapping(comp, pieces, engine_id, scratch_id, limit):
            # A unit written twice keeps its last value, as the full pull's later read would.
            last = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
            idx, vals, prev = idx[last], vals[last], prev[last]
        t1 = time.perf_counter()
        before = undo.write(engine_u, idx, vals, prev)
        t2 = time.perf_counter()
        self._base.engine.update_units(idx, before, vals)  # type: ignore[arg-type]
        t3 = time.perf_counter()
        if len(dirty):
            assert scratch_u is not None
            undo.write(scratch_u, off[scratch_writes] // unit, values[scratch_writes])
            self._replay(comp, dirty.tolist(), undo, unit)
        t4 = time.perf_counter()
        parts[0] += t1 - t0
        parts[1] += (t2 - t1) + (t4 - t3)  # a replay's digest update counts as writing
        parts[2] += t3 - t2
        return len(k)

    def _direct(
        self,
        comp: CompiledPull,
        pieces: I64,
        scat_of: I64,
        fp_of: I64,
        engine_id: int,
        scratch_id: int,
        limit: int,
    ) -> bool:
        """Whether every piece of the stream lands whole in the engine's own memory
        (no scattered block, no full pull, no two destinations overlapping)."""
        if (scat_of >= 0).any() or (fp_of >= 0).any():
            return False
        mirrored = (pieces[:, 0] == scratch_id) & (pieces[:, 1] + pieces[:, 2] <= limit)
        if not ((pieces[:, 0] == engine_id) | mirrored).all():
            return False
        return not self._overlapping(comp, pieces, engine_id, scratch_id, limit)

    def _apply_direct(
        self,
        pieces: I64,
        counts: npt.NDArray[np.uint8],
        low: npt.NDArray[np.uint8],
        diff: npt.NDArray[np.int8],
        exceptions: npt.NDArray[np.unsignedinteger],
        undo: UndoLog,
        parts: list[float],
        t0: float,
        bits: int,
    ) -> int:
        """:meth:`_apply` where every piece lands whole in the engine (:meth:`_direct`):
        each unit's engine index is its piece's origin plus its stream index. Decoded,
        placed, written and digested natively, one pass each over the changes
        (:mod:`refitd.delta.native`; the general path below is its reference)."""
        unit = exceptions.dtype.itemsize
        assert self._base is not None
        engine = self._engine_bytes()
        try:
            idx, old, values = native.place(
                counts, low, diff, exceptions, pieces, engine, unit, bits
            )
        except ValueError as err:
            raise ConflictError(f"delta of v{self._base.version}+1 refused: {err}") from None
        t1 = time.perf_counter()
        undo.record(engine.view(unit_dtype(unit)), idx, old)
        native.scatter(engine, idx, values)
        t2 = time.perf_counter()
        self._base.engine.update_units(idx, old, values)
        t3 = time.perf_counter()
        parts[0] += t1 - t0
        parts[1] += t2 - t1
        parts[2] += t3 - t2
        return len(idx)

    def _overlapping(
        self, comp: CompiledPull, pieces: I64, engine_id: int, scratch_id: int, limit: int
    ) -> bool:
        """Whether two destinations of the plan may write the same engine byte (then
        a unit landed twice keeps its last value); decided once per compiled plan."""
        if comp is self._overlap_for:
            return self._overlap
        direct = (pieces[:, 0] == engine_id) | (
            (pieces[:, 0] == scratch_id) & (pieces[:, 1] < limit)
        )
        spans = [pieces[direct, 1], pieces[direct, 1] + pieces[direct, 2]]
        lo, hi = list(spans[0].tolist()), list(spans[1].tolist())
        for _at, dt, shape, strides, name, dst_byte in comp.scatter:
            start = self._param_off[name] + dst_byte
            reach = sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
            lo.append(start)
            hi.append(start + (reach + 1) * dt.itemsize)
        for _at, fp in comp.full_pulls:
            for c in fp.copies:
                p = self._params[c.param_name]
                lo.append(self._param_off[c.param_name])
                hi.append(lo[-1] + p.numel() * p.element_size())
        order = np.argsort(np.array(lo, dtype=np.int64), kind="stable")
        a, b = np.array(lo, dtype=np.int64)[order], np.array(hi, dtype=np.int64)[order]
        self._overlap = bool(len(a) > 1 and (a[1:] < np.maximum.accumulate(b)[:-1]).any())
        self._overlap_for = comp
        return self._overlap

    def _replay(self, comp: CompiledPull, dirty: list[int], undo: UndoLog, unit: int) -> None:
        """Replay the full pulls ``dirty`` (patched in scratch) into the parameters,
        each destination parameter recorded whole first; the digest follows."""
        from refitd.reshard.replay import replay_ops
        from refitd.reshard.transfer_plan import write_through_pointer

        assert self._scratch_seg is not None and self._base is not None
        engine = self._engine_bytes()
        scratch = self._scratch_seg.numpy()
        names = sorted({c.param_name for i in dirty for c in comp.full_pulls[i][1].copies})
        spans = []
        for name in names:
            p = self._params[name]
            lo = self._param_off[name]
            hi = lo + p.numel() * p.element_size()
            view = engine[lo:hi]
            spans.append((lo, view, view.copy()))
            undo.keep(view)
        for i in dirty:
            at, fp = comp.full_pulls[i]
            full = torch.frombuffer(scratch[at : at + fp.staging_nbytes].data, dtype=torch.uint8)
            full = full.view(fp.dtype).reshape(fp.global_shape)
            for copy in fp.copies:
                write_through_pointer(
                    self._params[copy.param_name].data_ptr(), copy, replay_ops(full, copy.op_chain)
                )
        for lo, view, before in spans:
            self._base.engine.rewrite(lo, before, view)

    async def close(self) -> None:
        """Delete the delta region too (see :meth:`DaemonReceiver.close`)."""
        if self._delta_region is not None:
            with contextlib.suppress(RefitError):
                await self.local.delete_region(self._delta_region)
        if self._delta_seg is not None:
            self._delta_seg.unlink()
            self._delta_seg.close()
        self._delta_seg = self._delta_region = None
        await super().close()
