"""The engine side: refit a live model from a published version through two daemons.

:class:`DaemonReceiver` wires :mod:`refitd.reshard` to the daemons:

1. lease the version at the source daemon (renewed in the background at a third
   of its TTL until the refit ends, see :class:`~refitd.client.leases.LeaseKeeper`)
   and fetch its merged manifest;
2. if the manifest's structure and region placement match the last refit, replay
   the compiled pull (no capture, no planning); otherwise capture the engine's own
   loaders on a meta twin, plan, and compile the plan to region-relative rows;
3. refuse the whole refit — before any transfer — if any source is unsupported,
   any copy could not be attributed, or the engine's loaders would leave any
   parameter or persistent buffer (wholly or partly) unwritten by the manifest
   (strict by default; ``allow_unwritten=`` names those meant to keep their values);
4. submit one pull to the local daemon (descriptors + pack specs, the lease) and
   wait, reporting progress;
5. install: ``"staging"`` lands the pull in a scratch mirror of the parameters,
   copied into them only after it succeeded; ``"swap"`` lands it in a second copy
   of their memory, which they are rebound to only after it succeeded (one copy,
   :mod:`refitd.client.swap`); in both a failed pull installs nothing. ``"direct"``
   lands it in the parameters, and a failure names the suspect ones. Full pulls are
   replayed from scratch into the parameters in every mode;
6. release the lease.

:meth:`~refitd.client.staged.Staging.stage` stops a swap-mode refit before its swap
(in-flight refit, :mod:`refitd.client.staged`).

The engine's parameters are moved once into memory registered with the local
daemon, so pulls can land in them: a shared-memory segment for parameters in host
memory; for parameters on a GPU, one GPU allocation on that device (they never leave
it, and the staging scratch is GPU memory too), read and written by the daemon
through its CUDA IPC handle (:mod:`refitd.client.gpu`; never run on a GPU yet).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np
import torch

from refitd.client.http import RefitClient
from refitd.client.install import (
    SPAN,
    CompiledPull,
    RefitStats,
    install_unpacked,
    naming_suspects,
    one_device,
    overlapping_params,
    sources_of,
)
from refitd.client.leases import LeaseKeeper, held_lease
from refitd.client.onerefit import OneRefit
from refitd.client.publisher import ALIGN
from refitd.client.staged import Staging
from refitd.client.swap import EngineViews, unpulled
from refitd.errors import ConflictError, RefitError, TransportError
from refitd.reshard.receiver import KEEP_PLANS
from refitd.wire import (
    DescriptorTable,
    LeaseGrant,
    MergedManifest,
    PackSpec,
    PullProgress,
    PullRequest,
    RegionInfo,
)
from transports.batch import merge_ranges
from transports.segments import SharedSegment

if TYPE_CHECKING:
    from refitd.reshard.compile import BoundPlan, DestLayout
    from refitd.reshard.receiver import ReshardReceiver
    from refitd.reshard.transfer_plan import FullPull, SourceInfo
    from refitd.reshard.types import CaptureResult

__all__ = ["Capture", "DaemonReceiver", "RefitStats"]

Capture = Callable[
    [torch.nn.Module, list[tuple[str, torch.dtype, tuple[int, ...]]]], "CaptureResult"
]
"""``capture(meta_twin, manifest) -> CaptureResult``: runs the engine's loaders."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class DaemonReceiver(Staging):
    """Refits ``engine`` (a real model) from ``model`` published at ``source_url``.

    ``twin`` builds the engine's meta twin (same class, same parallel layout, on
    ``torch.device("meta")``); ``capture`` runs its loaders against a manifest.
    ``local`` is the client of this host's daemon; ``source`` the client of the
    daemon holding the published version (the same one on a single host is fine).
    ``allow_unwritten`` names parameters and persistent buffers that the manifest
    may leave untouched; any other one left unwritten refuses the refit (with
    :class:`~refitd.reshard.types.IncompleteRefit`, naming each) before any byte moves.
    """

    def __init__(
        self,
        *,
        local: RefitClient,
        source: RefitClient,
        model: str,
        engine: torch.nn.Module,
        twin: Callable[[], torch.nn.Module],
        capture: Capture,
        mode: Literal["staging", "direct", "swap"] = "staging",
        lease_ttl_s: float = 60.0,
        strict: bool = False,
        max_segments_per_copy: int = 64,
        allow_unwritten: Iterable[str] = (),
    ) -> None:
        self.local = local
        self.source = source
        self.model = model
        self.engine = engine
        self.twin = twin
        self.capture = capture
        self.mode = mode
        self.lease_ttl_s = lease_ttl_s
        self.strict = strict
        self.max_segments_per_copy = max_segments_per_copy
        self.allow_unwritten = frozenset(allow_unwritten)
        self._compiled: CompiledPull | None = None
        self._lowered: dict[bytes, CompiledPull] = {}  # by signature, the newest KEEP_PLANS
        self._one = OneRefit(model)  # a second refit at once is refused (409)
        # the planner's receiver for the last capture, and the destinations it warmed
        self._reshard: ReshardReceiver | None = None
        self._dest: DestLayout = {}
        self._params: dict[str, torch.nn.Parameter] = dict(engine.named_parameters())
        self._param_off: dict[str, int] = {}
        self._engine_seg: SharedSegment | None = None
        self._engine_region: RegionInfo | None = None
        self._scratch_seg: SharedSegment | None = None
        #: swap mode: the second copy of the engine segment, and both segments' views
        self._shadow_seg: SharedSegment | None = None
        self._shadow_region: RegionInfo | None = None
        self._views: EngineViews | None = None
        self._serving = 0  # which of the views' segments the parameters read
        self._scratch_region: RegionInfo | None = None
        #: GPU parameters: the engine allocation and the scratch one, flat uint8 tensors
        self._engine_flat: torch.Tensor | None = None
        self._scratch_flat: torch.Tensor | None = None
        self.plans = 0
        self.staged: tuple[int, CompiledPull] | None = None  # stage(): what waits, whole
        self._hold = False  # the refit running stops before its swap (stage())
        self.lease_keeper: LeaseKeeper | None = None  # while a refit holds its lease
        #: the running refit's lease, as the source granted it (its records, manifest)
        self._lease: LeaseGrant | None = None

    # ------------------------------------------------------------ memory

    async def _place_engine(self) -> None:
        """Move every parameter into one region the local daemon writes: a shared
        segment for host parameters, one GPU allocation on their device for GPU ones
        (every parameter stays on its device)."""
        if self._engine_region is not None:
            return
        at = 0
        for name, p in self._params.items():
            self._param_off[name] = at
            at = _align(at + p.numel() * p.element_size())
        device = one_device(self._params)
        if device.type != "cpu":
            if self.mode == "swap":  # a CUDA graph holds the parameters' addresses
                self.mode = "staging"
            await self._place_engine_on(device, at)
            return
        seg = SharedSegment.create(max(at, 1), "engine")
        for name, p in self._params.items():
            n = p.numel()
            view = seg.torch(p.dtype, self._param_off[name], n).view(p.shape) if n else p.data
            view.copy_(p.data)
            p.data = view
        self._engine_seg = seg
        self._engine_region = await self.local.attach_region(seg.name, seg.size, label="engine")
        if self.mode == "swap":
            shadow = SharedSegment.create(seg.size, "shadow")
            shadow.numpy()[:] = seg.numpy()
            self._shadow_seg = shadow
            self._shadow_region = await self.local.attach_region(
                shadow.name, shadow.size, label="shadow"
            )
            self._views = EngineViews(self._params, self._param_off, (seg, shadow))

    async def _place_engine_on(self, device: torch.device, nbytes: int) -> None:
        """GPU parameters: moved, on their device, into one allocation refitd makes
        and registers once (``p.data`` becomes a view of it, as for host memory)."""
        from refitd.client.gpu import device_buffer

        flat, region = await device_buffer(self.local, nbytes, device, label="engine")
        for name, p in self._params.items():
            n = p.numel()
            if n:
                at = self._param_off[name]
                view = flat[at : at + n * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
        torch.cuda.synchronize(device)
        self._engine_flat = flat
        self._engine_region = region

    async def _scratch(self, nbytes: int) -> RegionInfo:
        if self._scratch_region is not None and self._scratch_region.nbytes >= nbytes:
            return self._scratch_region
        self._lowered.clear()  # their rows name the scratch region replaced here
        if self._engine_flat is not None:  # GPU parameters: GPU scratch, installs stay on it
            from refitd.client.gpu import device_buffer

            if self._scratch_region is not None:
                await self.local.delete_region(self._scratch_region.region_id)
            self._scratch_region = None
            self._scratch_flat = None
            self._scratch_flat, self._scratch_region = await device_buffer(
                self.local, nbytes, self._engine_flat.device, label="scratch"
            )
            return self._scratch_region
        if self._scratch_region is not None and self._scratch_seg is not None:
            await self.local.delete_region(self._scratch_region.region_id)
            self._scratch_seg.close()
        self._scratch_seg = SharedSegment.create(max(nbytes, 1), "scratch")
        self._scratch_region = await self.local.attach_region(
            self._scratch_seg.name, self._scratch_seg.size, label="scratch"
        )
        return self._scratch_region

    async def close(self) -> None:
        for region, seg in (
            (self._scratch_region, self._scratch_seg),
            (self._shadow_region, self._shadow_seg),
            (self._engine_region, self._engine_seg),
        ):
            if region is not None:
                # A daemon already gone took its record with it.
                with contextlib.suppress(TransportError):
                    await self.local.delete_region(region.region_id)
            if seg is not None:
                # parameters keep views of it: unlink the name, leave them the mapping
                seg.unlink()
        self._scratch_region = self._engine_region = self._shadow_region = None
        # GPU parameters keep their views of the engine allocation (freed with the last).
        self._scratch_flat = None

    # ------------------------------------------------------------ planning

    @staticmethod
    def signature(m: MergedManifest, engine_layout: bytes) -> bytes:
        """What a compiled plan is bound to: the source daemon incarnation, every
        tensor's shape/dtype/shards (regions and byte offsets), and the engine layout."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{m.node_id}/{m.incarnation}".encode())
        h.update(msgspec.msgpack.encode(m.tensors))
        h.update(engine_layout)
        return h.digest()

    def _engine_layout(self) -> bytes:
        return repr([(n, tuple(p.shape), str(p.dtype)) for n, p in self._params.items()]).encode()

    sources_of = staticmethod(sources_of)

    def _plan(self, m: MergedManifest, sources: dict[str, SourceInfo]) -> ReshardReceiver:
        """Capture on a meta twin, then plan and compile through the planner's own
        receiver, which refuses (before any transfer) an unsupported or unattributed
        capture, a destination left unwritten, or an unplannable source."""
        from refitd.reshard.coverage import destinations_of
        from refitd.reshard.receiver import ReshardReceiver
        from refitd.reshard.types import UnsupportedReshard

        manifest = [(n, info.dtype, tuple(info.global_shape)) for n, info in sources.items()]
        with torch.device("meta"):
            twin = self.twin()
        reshard = ReshardReceiver(
            self.capture(twin, manifest),
            max_segments_per_copy=self.max_segments_per_copy,
            strict=self.strict,
            allow_unwritten=self.allow_unwritten,
        )
        # Must be written: every parameter and persistent buffer a checkpoint load writes.
        dest = destinations_of(twin)
        try:
            reshard.warm(sources, dest)
        except UnsupportedReshard as exc:
            exc.add_note(f"refit of {m.model!r} v{m.version}")
            raise
        self._dest = dest
        self.plans += 1
        return reshard

    async def _lower(self, bound: BoundPlan, planned_bytes: int, signature: bytes) -> CompiledPull:
        """Turn a bound plan into daemon rows: every read one int64 row of
        ``(src region, src offset, dst region, dst offset, nbytes)``."""
        assert self._engine_region is not None
        staging = self.mode == "staging"
        # Scratch layout: [mirror of the engine segment, staging mode only][packed
        # blocks that land strided][full-pull buffers].
        cursor = self._engine_region.nbytes if staging else 0
        scatter: list[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], str, int]] = []
        pack_dst: list[int] = []
        for p, d in zip(bound.packs, bound.pack_dst.tolist(), strict=True):
            if p.dst_strides is None:
                pack_dst.append(d)
                continue
            dt = self._params[p.param_name].dtype
            strides = tuple(st // p.elsize for st in p.dst_strides)
            scatter.append((cursor, dt, p.shape, strides, p.param_name, p.dst_byte))
            pack_dst.append(-SPAN + cursor)
            cursor = _align(cursor + p.nbytes)
        full: list[tuple[int, FullPull]] = []
        fp_rows: list[tuple[int, int, int]] = []
        for fp in bound.full_pulls:
            full.append((cursor, fp))
            fp_rows += [(s.src_addr, -SPAN + cursor + s.dst_byte, s.nbytes) for s in fp.segments]
            cursor = _align(cursor + fp.staging_nbytes)
        scratch = await self._scratch(cursor)
        src = np.concatenate([bound.src, np.array([r[0] for r in fp_rows], dtype=np.int64)])
        dst = np.concatenate([bound.dst, np.array([r[1] for r in fp_rows], dtype=np.int64)])
        nb = np.concatenate([bound.nbytes, np.array([r[2] for r in fp_rows], dtype=np.int64)])
        rows = np.stack([src // SPAN, src % SPAN, dst // SPAN, dst % SPAN, nb], axis=1)
        # Destination region -1 stands for the scratch region (see _param_addr).
        rows[rows[:, 2] == -1, 2] = scratch.region_id
        pdst = np.array(pack_dst, dtype=np.int64)
        packs = [
            PackSpec(
                int(a // SPAN),
                int(a % SPAN),
                p.shape,
                tuple(st // p.elsize for st in p.src_strides),
                p.elsize,
                scratch.region_id if d // SPAN == -1 else int(d // SPAN),
                int(d % SPAN),
            )
            for p, a, d in zip(bound.packs, bound.pack_src.tolist(), pdst.tolist(), strict=True)
        ]
        install: list[tuple[int, int]] = []
        if staging:
            limit = self._engine_region.nbytes
            mirror = [
                (int(r[3]), int(r[4])) for r in rows if r[2] == scratch.region_id and r[3] < limit
            ]
            mirror += [
                (p.dst_offset, p.nbytes)
                for p in packs
                if p.dst_region == scratch.region_id and p.dst_offset < limit
            ]
            staged = np.array(mirror, dtype=np.int64).reshape(-1, 2)
            merged = merge_ranges(np.zeros(len(staged), np.int64), staged[:, 0], staged[:, 1])
            install = [(r.offset, r.nbytes) for r in merged]
        comp = CompiledPull(signature, rows, packs, scatter, full, install)
        comp.bytes = planned_bytes
        comp.engine_id = self._engine_region.region_id
        if self.mode == "swap":
            comp.keep = unpulled(comp, self._params, self._param_off)
        return comp

    def _param_addr(self, name: str) -> int:
        """Where a parameter's bytes land, as a synthetic address: in the engine
        region (direct mode) or in scratch, written ``-SPAN + offset`` (staging)."""
        assert self._engine_region is not None
        if self.mode == "staging":
            return -SPAN + self._param_off[name]
        return self._engine_region.region_id * SPAN + self._param_off[name]

    # ------------------------------------------------------------ refit

    async def refit(
        self,
        version: int | None = None,
        *,
        on_progress: Callable[[PullProgress], None] | None = None,
    ) -> RefitStats:
        """Refit the engine to ``version`` (the newest READY one by default); refused
        (409) while another refit runs on this receiver."""
        t0 = time.perf_counter()
        with self._one.refit(version):
            self.staged = None  # this refit writes the inactive copy: nothing waits there
            await self._place_engine()
            if self._hold and self._views is None:  # GPU parameters refit in staging mode
                raise ConflictError(f"stage of {self.model!r} refused: its engine is not swapped")
            if version is None:
                version = (await self.source.version(self.model, "latest")).version
            # The grant brings the manifest and the source's signed records (with its
            # credentials), which the pull presents: no round trip for either. It is
            # renewed in the background while the refit runs, so a long pull of a
            # healthy version outlives the TTL; a lease that lapses anyway stays lapsed.
            acquiring = self.source.acquire_lease(
                self.model, version, self.lease_ttl_s, holder="receiver", manifest=True
            )
            try:
                async with held_lease(self.source, acquiring, self.lease_ttl_s) as keeper:
                    self.lease_keeper, self._lease = keeper, keeper.granted
                    # stage() is always a full pull: the inactive copy is no delta's base
                    leased = self._refit_leased if not self._hold else self._full_leased
                    return await leased(version, keeper.granted.lease_id, t0, on_progress)
            except RefitError as exc:
                kept = self.lease_keeper
                if kept is not None and kept.error is not None:
                    held = kept.granted.lease_id
                    exc.add_note(f"renewing lease {held!r} was refused: {kept.error}")
                raise
            finally:
                self.lease_keeper = self._lease = None

    async def _refit_leased(
        self,
        version: int,
        lease_id: str,
        t0: float,
        on_progress: Callable[[PullProgress], None] | None,
    ) -> RefitStats:
        """The refit of ``version`` under the live lease ``lease_id``."""
        comp, replayed, (t1, t2) = await self._prepare(version)
        return await self._pull_install(
            comp, version, lease_id, replayed, (t0, t1, t2), on_progress
        )

    _full_leased = _refit_leased  # stage()'s: a subclass's own kind of refit is not used

    async def _prepare(self, version: int) -> tuple[CompiledPull, bool, tuple[float, float]]:
        """``version``'s compiled (or replayed) pull, whether it was replayed, and the
        clock after fetching its manifest and after the plan."""
        lease = self._lease
        m = (
            lease.manifest
            if lease is not None and lease.manifest is not None and lease.version == version
            else await self.source.manifest(self.model, version)
        )
        t1 = time.perf_counter()
        comp, replayed = await self._compiled_for(m, version)
        return comp, replayed, (t1, time.perf_counter())

    async def _pull_install(
        self,
        comp: CompiledPull,
        version: int,
        lease_id: str,
        replayed: bool,
        times: tuple[float, float, float],
        on_progress: Callable[[PullProgress], None] | None,
    ) -> RefitStats:
        """Pull ``comp`` under ``lease_id`` and install it (:meth:`_install_timed`)."""
        rows, packs = comp.rows, comp.packs
        if self.mode == "swap":  # land in the shadow; the engine serves on meanwhile
            assert self._shadow_region is not None
            rows, packs = comp.landing_in(self._shadow_region.region_id)
        remote = self.source.base_url != self.local.base_url
        grant = self._lease.records if self._lease is not None and remote else None
        req = PullRequest(
            self.model,
            version,
            lease_id,
            DescriptorTable.pack(rows),
            packs,
            self.source.base_url if remote else "",
            grant,  # the source's records and credentials: presented, not asked for
        )
        try:
            result = await self.local.pull(req, on_progress=on_progress)
        except RefitError as exc:
            named = self._name_suspects(exc)
            if named is exc:
                raise
            raise named from exc
        return self._install_timed(comp, version, replayed, times, result)

    def _install_timed(
        self,
        comp: CompiledPull,
        version: int,
        replayed: bool,
        times: tuple[float, float, float],
        pull: PullProgress,
    ) -> RefitStats:
        """Install ``comp`` once its pulls are done and report the refit; ``times`` are the
        clock at its start, after the manifest and after the plan."""
        t0, t1, t2 = times
        t3 = time.perf_counter()
        self._install(comp)
        if self._hold:
            self.staged = (version, comp)
        t4 = time.perf_counter()
        return RefitStats(
            version,
            replayed,
            comp.bytes,
            comp.rows.shape[0] + len(comp.packs),
            len(comp.packs),
            len(comp.scatter),
            len(comp.full_pulls),
            t1 - t0,
            t2 - t1,
            t3 - t2,
            t4 - t3,
            t4 - t0,
            pull,
        )

    async def _compiled_for(self, m: MergedManifest, version: int) -> tuple[CompiledPull, bool]:
        """The compiled pull for manifest ``m``, and whether it was replayed (the
        manifest's placement is exactly the last refit's: no planning at all)."""
        sig = self.signature(m, self._engine_layout())
        replayed = self._compiled is not None and self._compiled.signature == sig
        if not replayed and sig in self._lowered:  # an earlier placement (double buffering)
            self._compiled, replayed = self._lowered[sig], True
            if self._engine_region is not None:  # swaps since moved the serving copy
                self._compiled.retarget(self._engine_region.region_id)
        if not replayed:
            # Not the exact placement of last time: rebind the compiled plan if only
            # addresses moved (no planning), else capture and plan again (a new
            # structure needs a new capture), or refuse in strict mode.
            from refitd.reshard.compile import SignatureMismatch

            sources = self.sources_of(m)
            reshard = self._reshard
            if reshard is None or (
                not self.strict
                and reshard.compiled is not None
                and reshard.compiled.mismatch(sources, self._dest) is not None
                and not reshard.recall(sources, self._dest)
            ):
                reshard = self._reshard = self._plan(m, sources)
            try:
                bound = reshard.bind(sources, self._param_addr, self._dest)
            except SignatureMismatch as exc:
                raise ConflictError(f"{self.model!r} v{version}: {exc}") from exc
            assert reshard.compiled is not None
            planned = reshard.compiled.plan.bytes_planned()
            self._compiled = self._lowered[sig] = await self._lower(bound, planned, sig)
            while len(self._lowered) > KEEP_PLANS:
                del self._lowered[next(iter(self._lowered))]
        comp = self._compiled
        assert comp is not None
        return comp, replayed

    def _name_suspects(self, exc: RefitError) -> RefitError:
        """In direct mode a failed pull may have written parameters: say which."""
        progress = getattr(exc, "progress", None)
        if self.mode != "direct" or progress is None or self._engine_region is None:
            return exc
        engine = self._engine_region.region_id
        ranges = [(o, n) for r, o, n in progress.suspect if r == engine]
        return naming_suspects(exc, overlapping_params(ranges, self._params, self._param_off))

    def _install(self, comp: CompiledPull) -> None:
        """Land what the pull wrote in scratch into the parameters (swap mode: swap
        the segments first, and swap back if landing the rest fails)."""
        if self._engine_flat is not None:
            from refitd.client.gpu import install_on_device

            install_on_device(comp, self._params, self._engine_flat, self._scratch_flat)
            return
        if self.mode == "swap":
            assert self._engine_seg is not None and self._shadow_seg is not None
            serving, shadow = self._engine_seg.numpy(), self._shadow_seg.numpy()
            for off, n in comp.keep:
                shadow[off : off + n] = serving[off : off + n]
            if self._hold:  # stage(): land the rest in the inactive copy, swap later
                assert self._views is not None
                inactive = self._views.views[1 - self._serving]
                if self._scratch_seg is not None:
                    scratch = self._scratch_seg.numpy()
                    install_unpacked(comp.scatter, comp.full_pulls, inactive, scratch)
                return
            self._swap(comp)
            try:
                self._install_unpacked(comp)
            except BaseException:
                self._swap(comp)  # the previous version's segment, untouched: serve it
                raise
            return
        assert self._engine_seg is not None
        engine = self._engine_seg.numpy()
        scratch = self._scratch_seg.numpy() if self._scratch_seg is not None else engine[:0]
        for off, n in comp.install:
            engine[off : off + n] = scratch[off : off + n]
        self._install_unpacked(comp)

    def _swap(self, comp: CompiledPull) -> None:
        """Swap mode: the parameters read the other segment, now the engine region (as
        ``comp`` names it); the one they read until now is the next pull's shadow."""
        assert self._views is not None and self._engine_region is not None
        assert self._shadow_region is not None
        self._serving = 1 - self._serving
        self._views.bind(self._serving)
        self._engine_seg, self._shadow_seg = self._shadow_seg, self._engine_seg
        self._engine_region, self._shadow_region = self._shadow_region, self._engine_region
        comp.retarget(self._engine_region.region_id)

    def _install_unpacked(self, comp: CompiledPull) -> None:  # scatter, full pulls
        if self._scratch_seg is not None:
            install_unpacked(comp.scatter, comp.full_pulls, self._params, self._scratch_seg.numpy())
