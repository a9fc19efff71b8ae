"""Delta refit, the engine side: pull only what changed since the version the engine
holds, checked against that base first, applied transactionally.

:class:`DeltaReceiver` is a :class:`~refitd.client.receiver.DaemonReceiver` whose
refit tries a delta first:

1. plan (or replay) the version's pull exactly as a full refit does;
2. check the base before any byte moves: the engine holds a version refitd installed
   (``version``, the source's content digest of it), its memory still has the lane
   digest it had then (``verify_engine``), the scratch layout is this plan's, and no
   anchor is due. The source stages the changed units of the plan's stream only if
   its delta (or a chain of them) starts at exactly that version and digest. Any
   mismatch runs a full refit instead, and :attr:`DeltaReceiver.last` says why;
3. pull the staged delta into a region of its own: nothing of the engine is written
   until every byte of it has landed;
4. apply: each changed unit goes where a full refit would have landed it (the
   engine's memory, a packed block scattered by its strides, or a full read's
   staged tensor, replayed by the one install; the pure algebra is
   :mod:`refitd.delta.apply`). Every write keeps the value it overwrote
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

from refitd.client.deltastats import AUTO_SAME_HOST, OVERLAPPED, WHERE, DeltaStats
from refitd.client.deltastream import Encoded, open_stream
from refitd.client.install import CompiledPull, replay_full_reads
from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.delta.apply import Landing, Target, apply_chunk
from refitd.delta.digest import EngineDigest
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
    when the source is across a link (the last full refit did not read this host's
    shared memory): on one host a full refit copies at memory speed and a delta's
    scattered writes are not faster; ``after_apply``: called once a delta is
    written (the engine's post-load processing), a raise rolls it back. Other
    arguments are
    :class:`DaemonReceiver`'s; only ``"staging"`` mode keeps the full reads' staged
    tensors a delta patches, so deltas need it or no full read in the plan.
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
        self._same_host: bool | None = None  # the last full refit read shared memory
        self.after_apply = after_apply
        self.last: DeltaStats | None = None
        self._base: _Base | None = None
        self._since_anchor = 0
        self.chunk_bytes = chunk_bytes
        #: where the last plan's stream lands, for that plan in those regions
        self._landing: tuple[CompiledPull, int, int, Landing] | None = None
        #: per plan signature, the name the source keeps that plan under
        self._plan_names: dict[bytes, str] = {}

    # ------------------------------------------------------------ the base

    @property
    def base_version(self) -> int | None:
        """The version the engine holds as a delta base (None: none)."""
        return None if self._base is None else self._base.version

    def forget_base(self) -> None:
        """The engine's parameters were changed outside refitd: the next refit is full."""
        self._base = None

    def _engine_bytes(self) -> npt.NDArray[np.uint8]:
        assert self.memory.engine is not None
        return self.memory.engine.bytes()

    def _layout_key(self, comp: CompiledPull) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        scratch = self.memory.scratch.region.region_id if self.memory.scratch is not None else -1
        h.update(repr((self.mode, scratch, [s[0] for s in comp.scatter])).encode())
        h.update(repr([(at, fr.staging_nbytes) for at, fr in comp.full_reads]).encode())
        return h.digest()

    def _why_full(self, version: int, comp: CompiledPull) -> str:
        """Why this refit cannot be a delta (``""``: it can, as far as the engine knows)."""
        base = self._base
        if self.memory.engine is None or self.memory.on_device:
            return "the engine's parameters are in GPU memory: deltas apply in host memory"
        if self._auto_full():
            return AUTO_SAME_HOST
        if base is None:
            return "no base: the engine holds no version a refit installed and checked"
        if version <= base.version:
            return f"v{version} is not newer than the engine's v{base.version}"
        if self.anchor_every and self._since_anchor + 1 >= self.anchor_every:
            return f"anchor: a full refit every {self.anchor_every} versions"
        if comp.full_reads and self.mode != "staging":
            return "the plan has full reads, whose staged tensors only staging mode keeps"
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
        """``prefer="auto"`` and the last full refit read this host's shared memory."""
        return self.prefer == "auto" and bool(self._same_host)

    async def _record_base(self, version: int, comp: CompiledPull, digest: str) -> None:
        if self.memory.engine is None or self.memory.on_device or not digest:
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
        assert self._base is not None and self.memory.engine is not None
        at = self._landing_of(comp)
        nbytes = int(at.pieces[:, 2].sum())
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
            # A plan that scatters or replays full reads is decoded whole: one chunk.
            chunk_bytes=self.chunk_bytes if at.direct else max(nbytes, 1 << 16),
        )
        undo = UndoLog()
        kept = self._base.engine.copy()
        target = self._target(comp)
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
                        None, apply_chunk, at, comp, enc, payload, target, undo, parts
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

    def _landing_of(self, comp: CompiledPull) -> Landing:
        """Where the stream of ``comp`` lands (:class:`~refitd.delta.apply.Landing`),
        worked out once per plan and regions."""
        memory = self.memory
        assert memory.engine is not None
        engine_id = memory.engine.region.region_id
        scratch_id = memory.scratch.region.region_id if memory.scratch is not None else -2
        cached = self._landing
        if cached is not None and cached[:3] == (comp, engine_id, scratch_id):
            return cached[3]
        limit = memory.engine.region.nbytes if self.mode == "staging" else 0
        at = Landing.of(comp, engine_id, scratch_id, limit, self._spans())
        self._landing = (comp, engine_id, scratch_id, at)
        return at

    def _spans(self) -> dict[str, tuple[int, int]]:
        """Each parameter's ``(byte offset, nbytes)`` in the engine region."""
        return {
            name: (off, self._params[name].numel() * self._params[name].element_size())
            for name, off in self.memory.offsets.items()
        }

    def _target(self, comp: CompiledPull) -> Target:
        """The engine memory a delta of ``comp`` writes (:class:`~refitd.delta.apply.Target`):
        a full read it patches is replayed by the one install
        (:func:`~refitd.client.install.replay_full_reads`)."""
        memory = self.memory
        assert memory.engine is not None and self._base is not None
        scratch = memory.scratch

        def replay(dirty: list[int]) -> None:
            assert scratch is not None
            chosen = [comp.full_reads[i] for i in dirty]
            replay_full_reads(chosen, self._params, scratch.flat)

        return Target(
            memory.engine.bytes(),
            scratch.bytes() if scratch is not None else None,
            self._base.engine,
            self._spans(),
            self._base.version,
            replay,
        )


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
