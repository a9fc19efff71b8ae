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
5. install: ``"staging"`` lands the pull in scratch's image of the parameters,
   copied into them only after it succeeded; ``"swap"`` lands it in a second copy
   of their memory, which they are rebound to only after it succeeded (one copy,
   :mod:`refitd.client.swap`); in both a failed pull installs nothing. ``"direct"``
   lands it in the parameters, and a failure names the suspect ones. Full reads are
   replayed from scratch into the parameters in every mode;
6. release the lease.

:meth:`~refitd.client.prefetch.Prefetch.prefetch` stops a swap-mode refit before its
swap (in-flight refit, :mod:`refitd.client.prefetch`).

The engine's parameters are moved once into memory registered with the local
daemon, so pulls can land in them: a shared-memory segment for parameters in host
memory; for parameters on a GPU, one GPU allocation on that device (they never leave
it, and the staging scratch is GPU memory too), read and written by the daemon
through its CUDA IPC handle (:mod:`refitd.client.engine`, :mod:`refitd.client.gpu`;
never run on a GPU yet). A bound plan becomes the pull's rows in
:mod:`refitd.client.lowering`; one install lands a pull in host and GPU memory alike
(:func:`refitd.client.install.install`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import torch

from refitd.client import lowering
from refitd.client.engine import EngineMemory
from refitd.client.http import RefitClient
from refitd.client.install import (
    CompiledPull,
    RefitStats,
    naming_suspects,
    overlapping_params,
    sources_of,
)
from refitd.client.leases import LeaseKeeper, held_lease
from refitd.client.onerefit import OneRefit
from refitd.client.prefetch import Prefetch
from refitd.errors import ConflictError, RefitError
from refitd.reshard.receiver import KEEP_PLANS
from refitd.wire import (
    DescriptorTable,
    LeaseInfo,
    MergedManifest,
    PullProgress,
    PullRequest,
    RegionInfo,
)

if TYPE_CHECKING:
    from refitd.reshard.compile import BoundPlan, DestLayout
    from refitd.reshard.receiver import ReshardReceiver
    from refitd.reshard.transfer_plan import SourceInfo
    from refitd.reshard.types import CaptureResult

__all__ = ["Capture", "DaemonReceiver", "RefitStats"]

Capture = Callable[
    [torch.nn.Module, list[tuple[str, torch.dtype, tuple[int, ...]]]], "CaptureResult"
]
"""``capture(meta_twin, manifest) -> CaptureResult``: runs the engine's loaders."""


class DaemonReceiver(Prefetch):
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
        max_reads_per_copy: int = 64,
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
        self.max_reads_per_copy = max_reads_per_copy
        self.allow_unwritten = frozenset(allow_unwritten)
        self._compiled: CompiledPull | None = None
        self._lowered: dict[bytes, CompiledPull] = {}  # by signature, the newest KEEP_PLANS
        self._one = OneRefit(model)  # a second refit at once is refused (409)
        # the planner's receiver for the last capture, and the destinations it warmed
        self._reshard: ReshardReceiver | None = None
        self._dest: DestLayout = {}
        self._params: dict[str, torch.nn.Parameter] = dict(engine.named_parameters())
        #: where pulls land: the engine's memory, its scratch and swap mode's shadow
        self.memory = EngineMemory(local, self._params)
        self.plans = 0
        self.prefetched: tuple[int, CompiledPull] | None = None  # prefetch(): what waits, whole
        self._hold = False  # the refit running stops before its swap (prefetch())
        self.lease_keeper: LeaseKeeper | None = None  # while a refit holds its lease
        #: the running refit's lease, as the source granted it (its records, manifest)
        self._lease: LeaseInfo | None = None

    # ------------------------------------------------------------ memory

    async def _place_engine(self) -> None:
        """Move the parameters into memory the local daemon writes, once
        (:meth:`~refitd.client.engine.EngineMemory.place`); GPU parameters refit in
        staging mode."""
        if not await self.memory.place(swap=self.mode == "swap") and self.mode == "swap":
            self.mode = "staging"

    async def _scratch(self, nbytes: int) -> RegionInfo:
        """A scratch region of at least ``nbytes``: the one placed, or a new one (the
        pulls lowered for the old one are dropped: their rows name it)."""
        if self.memory.fits(nbytes):
            assert self.memory.scratch is not None
            return self.memory.scratch.region
        self._lowered.clear()
        return await self.memory.new_scratch(nbytes)

    async def close(self) -> None:
        await self.memory.close()

    # ------------------------------------------------------------ planning

    signature = staticmethod(lowering.signature)
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
            max_reads_per_copy=self.max_reads_per_copy,
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
        """Turn a bound plan into daemon rows (:func:`~refitd.client.lowering.lower`),
        in a scratch region large enough for it."""
        engine = self.memory.engine
        assert engine is not None
        lay = lowering.scratch_layout(
            bound, self._params, engine.region.nbytes, self.mode == "staging"
        )
        scratch = await self._scratch(lay.nbytes)
        return lowering.lower(
            bound,
            lay,
            scratch_id=scratch.region_id,
            engine_id=engine.region.region_id,
            engine_nbytes=engine.region.nbytes,
            mode=self.mode,
            params=self._params,
            offsets=self.memory.offsets,
            planned_bytes=planned_bytes,
            sig=signature,
        )

    def _param_addr(self, name: str) -> int:
        """Where a parameter's bytes land (:func:`~refitd.client.lowering.param_addr`)."""
        engine = self.memory.engine
        assert engine is not None
        return lowering.param_addr(
            name, self.mode == "staging", engine.region.region_id, self.memory.offsets
        )

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
            self.prefetched = None  # this refit writes the inactive copy: nothing waits there
            await self._place_engine()
            if self._hold and self.memory.views is None:  # GPU parameters refit in staging mode
                raise ConflictError(
                    f"prefetch of {self.model!r} refused: its engine is not swapped"
                )
            if version is None:
                version = (await self.source.version(self.model, "latest")).version
            # The grant brings the manifest and the source's signed records (with its
            # credentials), which the pull presents: no round trip for either. It is
            # renewed in the background while the refit runs, so a long pull of a
            # healthy version outlives the TTL; a lease that lapses anyway stays lapsed.
            acquiring = self.source.acquire_lease(
                self.model, version, self.lease_ttl_s, label="receiver", manifest=True
            )
            try:
                async with held_lease(self.source, acquiring, self.lease_ttl_s) as keeper:
                    self.lease_keeper, self._lease = keeper, keeper.granted
                    # prefetch() always refits in full: the inactive copy is no delta's base
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

    _full_leased = _refit_leased  # prefetch()'s: a subclass's own kind of refit is not used

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
            assert self.memory.shadow is not None
            rows, packs = comp.landing_in(self.memory.shadow.region.region_id)
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
            self.prefetched = (version, comp)
        t4 = time.perf_counter()
        return RefitStats(
            version,
            replayed,
            comp.bytes,
            comp.rows.shape[0] + len(comp.packs),
            len(comp.packs),
            len(comp.scatter),
            len(comp.full_reads),
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
        sig = self.signature(m, lowering.engine_layout(self._params))
        replayed = self._compiled is not None and self._compiled.signature == sig
        if not replayed and sig in self._lowered:  # an earlier placement (double buffering)
            self._compiled, replayed = self._lowered[sig], True
            if self.memory.engine is not None:  # swaps since moved the serving copy
                self._compiled.retarget(self.memory.engine.region.region_id)
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
        if self.mode != "direct" or progress is None or self.memory.engine is None:
            return exc
        engine = self.memory.engine.region.region_id
        ranges = [(o, n) for r, o, n in progress.suspect if r == engine]
        return naming_suspects(exc, overlapping_params(ranges, self._params, self.memory.offsets))

    def _install(self, comp: CompiledPull) -> None:
        """Land what the pull wrote into the parameters, host or GPU memory alike
        (:meth:`~refitd.client.engine.EngineMemory.install`; swap mode: swap the
        copies first, and swap back if landing the rest fails)."""
        self.memory.install(comp, swap=self.mode == "swap", hold=self._hold)

    def _swap(self, comp: CompiledPull) -> None:
        """Swap mode: the parameters read the other copy, now the engine region (as
        ``comp`` names it); the one they read until now is the next pull's shadow."""
        comp.retarget(self.memory.swap())
