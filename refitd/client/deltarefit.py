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

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from refitd.client.deltastats import AUTO_SAME_HOST, OVERLAPPED, WHERE, DeltaStats
from refitd.client.deltastream import Encoded, open_stream
from refitd.client.install import CompiledPull
from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.delta import native
from refitd.delta.diff import unit_dtype
from refitd.delta.digest import EngineDigest
from refitd.delta.stream import (
    areas_of,
    cut,
    decode,
    decode_values,
    landing,
    layout,
    scattered,
    unpack_nibbles,
)
from refitd.delta.undo import UndoLog
from refitd.errors import ConflictError, NotFoundError
from refitd.reshard.receiver import KEEP_PLANS
from refitd.wire import (
    CHUNK_BYTES,
    DeltaStreamRequest,
    DescriptorTable,
    PullProgress,
    PullState,
)

__all__ = ["AUTO_SAME_HOST", "OVERLAPPED", "WHERE", "DeltaReceiver", "DeltaStats"]

I64 = npt.NDArray[np.int64]


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
        chunk_bytes: int = CHUNK_BYTES,
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
        self.chunk_bytes = chunk_bytes
        self._pieces_of: tuple[CompiledPull, tuple[I64, I64, I64, bool, I64]] | None = None
        self._overlap_for: CompiledPull | None = None
        #: per plan signature, the name the source keeps that plan under
        self._plan_names: dict[bytes, str] = {}
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
        return ""

    def _written(self) -> tuple[str, float]:
        """With ``verify_engine``: why the engine memory is not the base refits left
        (``""``: its digest window matches), and the check's seconds. Run in a worker
        thread while the delta's request is on its way; nothing of the delta is
        placed before it says ``""`` (:meth:`_delta`)."""
        t = time.perf_counter()
        base = self._base
        assert base is not None
        block = base.engine.differs(self._engine_bytes(), self.verify_every)
        if block is None:
            return "", time.perf_counter() - t
        at = block * base.engine.block
        return (
            f"the engine's memory differs from v{base.version} as refitd installed "
            f"it (digest mismatch in bytes {at}..{at + base.engine.block}): it was "
            "written outside a refit"
        ), time.perf_counter() - t

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
        leased = time.perf_counter()
        comp, replayed, (t1, t2) = await self._prepare(version)
        reason = self._why_full(version, comp)
        if not reason:
            times = (t0, leased, t1, t2, time.perf_counter())
            try:
                return await self._delta(comp, version, lease_id, replayed, times)
            except _Written as exc:  # found before anything of the delta was placed
                reason = str(exc)
            except (ConflictError, NotFoundError) as exc:
                if self._streamed:
                    raise  # a chunk refused after its head: every unit was put back
                reason = f"the source refused the delta: {exc}"
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

    async def _delta(
        self,
        comp: CompiledPull,
        version: int,
        lease_id: str,
        replayed: bool,
        times: tuple[float, float, float, float, float],
    ) -> RefitStats:
        """Stream the delta from the base and apply it chunk by chunk as chunks come:
        chunk k is placed (in a worker thread, the GIL released in the native stages)
        while chunk k+1 crosses. Anything that fails puts every placed unit back and
        raises: a stream that broke or a chunk the source failed as
        :class:`~refitd.client.deltastream.StreamBroken`, naming the chunk. The engine
        then holds its base, bit for bit, and the next refit may try a delta again."""
        t0, leased, t1, t2, t_check = times
        assert self._base is not None and self._engine_region is not None
        pieces, _scat, _fp, direct, _ends = self._pieces(comp)
        nbytes = int(pieces[:, 2].sum())
        # The source keeps the plan sent last time (its head named it): named, not sent.
        named = self._plan_names.pop(comp.signature, "")
        req = DeltaStreamRequest(
            self.model,
            version,
            lease_id,
            self._base.version,
            self._base.digest,
            DescriptorTable.pack(comp.rows),
            comp.packs,
            nibbles=True,
            # A plan that scatters or replays full pulls is decoded whole: one chunk.
            chunk_bytes=self.chunk_bytes if direct else max(nbytes, 1 << 16),
        )
        undo = UndoLog()
        kept = self._base.engine.copy()
        parts = [0.0, 0.0, 0.0]
        changed = wire = 0
        clock = [0.0, 0.0, 0.0]  # first chunk came, last chunk came, source's encode
        loop = asyncio.get_running_loop()
        placing: asyncio.Future[int] | None = None
        self._streamed = False
        # The engine's base check reads its digest window while the request crosses
        # and the source selects: as strong as before it (every chunk waits for it),
        # off the critical path.
        checking = loop.run_in_executor(None, self._written) if self.verify_engine else None
        check_s = 0.0
        try:
            async with open_stream(self.source, req, nbytes, named) as (head, chunks):
                self._streamed = True  # refusals before this one refit in full
                while len(self._plan_names) >= KEEP_PLANS:
                    del self._plan_names[next(iter(self._plan_names))]
                self._plan_names[comp.signature] = head.plan  # "" from an older source
                async for chunk, payload in chunks:
                    clock[1] = time.perf_counter()
                    clock[0] = clock[0] or clock[1]
                    clock[2] += chunk.encode_s
                    wire += chunk.nbytes
                    if checking is not None:
                        check_s = await _checked(checking)
                        checking = None
                    if placing is not None:
                        changed += await placing
                    enc = Encoded.of(chunk, head)
                    placing = loop.run_in_executor(
                        None, self._apply, comp, enc, payload, undo, parts
                    )
                if placing is not None:
                    changed += await placing
            if checking is not None:  # a stream of no chunks: its base is checked too
                check_s = await _checked(checking)
            t_post = time.perf_counter()
            if self.after_apply is not None:
                self.after_apply()
        except BaseException:
            # Every write put back: the engine holds its base, bit for bit, still.
            if checking is not None:
                with contextlib.suppress(BaseException):
                    await checking  # it reads the engine: done before anything moves on
            if placing is not None and not placing.done():
                with contextlib.suppress(BaseException):
                    await placing
            undo.rollback()
            self._base.engine = kept
            raise
        t5 = time.perf_counter()
        self._base = _Base(version, head.digest, self._base.engine, self._base.layout)
        self._since_anchor += 1
        full = int(comp.rows[:, 4].sum()) + sum(p.nbytes for p in comp.packs)
        first, last = clock[0] or t_post, clock[1] or t_post  # no chunks: none came
        n = head.chunks
        pull = PullProgress("delta-stream", PullState.DONE, wire, wire, n, n, last - first, 0.0)
        stats = RefitStats(
            version, replayed, wire, 1, 0, 0, 0, t1 - t0, t2 - t1, last - t_check, t5 - last,
            t5 - t0, pull,
        )  # fmt: skip
        where = dict(zip(WHERE, (leased - t0, t1 - leased, t2 - t1, t_check - t2), strict=False))
        where.update(first=first - t_check, src_wait=head.wait_s, src_encode=clock[2])
        where.update(engine_check=check_s)
        where.update(stream=last - first, tail=t_post - last, post=t5 - t_post)
        self.last = DeltaStats(
            stats, "delta", "", wire, full, changed, head.unit, check_s, t5 - first,
            undo.nbytes, head.wait_s + clock[2], parts[0], parts[1], parts[2], t5 - t_post, where,
        )  # fmt: skip
        return stats

    # ------------------------------------------------------------ applying

    def _pieces(self, comp: CompiledPull) -> tuple[I64, I64, I64, bool, I64]:
        """The plan's stream as landing pieces ``(region, offset, bytes)``, each
        piece's scattered block and full pull (-1: none), whether every piece lands
        whole in the engine (:meth:`_direct`), and the pieces' cumulative bytes;
        once per compiled plan."""
        if self._pieces_of is not None and self._pieces_of[0] is comp:
            return self._pieces_of[1]
        assert self._engine_region is not None
        pieces = np.concatenate(
            [
                comp.rows[:, 2:5],
                np.array(
                    [(p.dst_region, p.dst_offset, p.nbytes) for p in comp.packs], dtype=np.int64
                ).reshape(-1, 3),
            ]
        )
        engine_id = self._engine_region.region_id
        scratch_id = self._scratch_region.region_id if self._scratch_region is not None else -2
        limit = self._engine_region.nbytes if self.mode == "staging" else 0
        scat_of, fp_of = areas_of(comp, pieces, scratch_id)
        direct = self._direct(comp, pieces, scat_of, fp_of, engine_id, scratch_id, limit)
        self._pieces_of = (comp, (pieces, scat_of, fp_of, direct, np.cumsum(pieces[:, 2])))
        return self._pieces_of[1]

    def _apply(
        self,
        comp: CompiledPull,
        enc: Encoded,
        payload: npt.NDArray[np.uint8],
        undo: UndoLog,
        parts: list[float],
    ) -> int:
        """Write a chunk of the delta (units ``enc.first`` on of the plan's stream)
        where the full pull would have landed each unit (see the module docstring);
        every write recorded in ``undo``. Returns units written; adds the seconds of
        placing, writing and the digest's update to ``parts``."""
        assert self._engine_region is not None and self._base is not None
        t0 = time.perf_counter()
        unit = enc.unit
        udt = unit_dtype(unit)
        bits = enc.diff_bits
        what = f"delta of v{enc.base_version}+ refused: chunk {enc.index}"
        if bits not in (4, 8):
            raise ConflictError(f"{what}: {bits}-bit differences are not a format")
        lay = layout(enc.pages, enc.changed, enc.exceptions, unit, bits)
        if len(payload) < lay.exceptions + unit * enc.exceptions:
            raise ConflictError(f"{what}: {len(payload)} bytes do not hold what it says")
        counts = payload[lay.counts : lay.counts + enc.pages]
        low = payload[lay.low : lay.low + enc.changed]
        diff = payload[lay.diff : lay.exceptions].view(np.int8)  # bits == 4: two a byte
        exceptions = payload[lay.exceptions : lay.exceptions + unit * enc.exceptions].view(udt)
        if int(counts.sum()) != enc.changed:
            raise ConflictError(
                f"{what}: its page counts sum to {int(counts.sum())}, not the "
                f"{enc.changed} positions it carries"
            )
        pieces, scat_of, fp_of, direct, ends = self._pieces(comp)
        part = cut(pieces, enc.first * unit, (enc.first + enc.units) * unit, ends)
        if direct:
            return self._apply_direct(part, counts, low, diff, exceptions, undo, parts, t0, bits)
        if (enc.first, enc.units) != (0, int(pieces[:, 2].sum()) // unit):
            raise ConflictError(f"{what}: a plan that scatters is applied in one chunk")
        engine_id = self._engine_region.region_id
        scratch_id = self._scratch_region.region_id if self._scratch_region is not None else -2
        limit = self._engine_region.nbytes if self.mode == "staging" else 0
        k = decode(counts, low)
        diff = (
            unpack_nibbles(diff.view(np.uint8), enc.changed) if bits == 4 else diff[: enc.changed]
        )
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
        written and digested natively in one pass over the changes, each unit's cache
        line read and written once (:func:`refitd.delta.native.place_write`; the
        general path above, and ``place``, ``scatter`` and ``digest_update``, are its
        reference). Its seconds count as placing."""
        unit = exceptions.dtype.itemsize
        assert self._base is not None
        engine = self._engine_bytes()
        digest = self._base.engine
        try:
            idx, old = native.place_write(
                counts, low, diff, exceptions, pieces, engine, unit, bits, digest.lanes,
                digest.block,
            )  # fmt: skip
        except ValueError as err:
            raise ConflictError(f"delta of v{self._base.version}+1 refused: {err}") from None
        undo.record(engine.view(unit_dtype(unit)), idx, old)
        parts[0] += time.perf_counter() - t0
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


class _Written(Exception):
    """The engine's base check found memory written outside a refit (its message):
    nothing of the delta was placed, and the refit goes on in full."""


async def _checked(checking: asyncio.Future[tuple[str, float]]) -> float:
    """The base check's seconds, once it found the engine as refits left it; else
    :class:`_Written`."""
    why, secs = await checking
    if why:
        raise _Written(why)
    return secs
