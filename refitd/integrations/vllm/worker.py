"""The worker side: a vLLM ``WeightTransferEngine`` that refits through the node's daemon.

One instance lives in each vLLM worker (one per TP/EP rank). On
``init_transfer_engine`` it connects to the node's daemon (the init info's
``url``, else ``$REFITD_URL``, else the refitd configuration's listener: loopback
by default) and sets up its destinations, in the *loader* format (what the
model's ``weight_loader``\\ s write, before ``process_weights_after_loading``):
live parameters in place where processing left them as loaded, loader-format
buffers for the rest (:mod:`refitd.integrations.vllm.destinations`).

``finish_weight_update`` then brings up to date every module that computes from
a written tensor, found by storage (:mod:`refitd.integrations.vllm.postload`):
vLLM's own ``process_weights_after_loading`` runs again on it, from the loader
format, and what it makes is copied into the storage the running kernels hold. A
module that cannot be brought up to date is refused at ``init_transfer_engine``,
naming it.

``update_weights({"version": N})`` (``N`` omitted: the newest READY version) runs
:class:`~refitd.client.receiver.DaemonReceiver`: lease the version, replay the
compiled plan or capture the model's own ``load_weights`` on a meta twin built
from ``vllm_config`` and plan, pull, install. A plan with any unsupported source,
unattributed write or unwritten destination is refused before any byte moves,
and a failed pull installs nothing, so the engine keeps serving its previous
weights. The default ``mode="swap"`` pulls once, into a second copy of the
destinations' memory (one more copy of the loader-format bytes in host memory),
and rebinds the destinations to it only once the whole pull arrived
(:mod:`refitd.client.swap`); ``"staging"`` pulls into scratch and copies into the
destinations after (two copies, the same memory); ``"direct"`` writes the
destinations in place (one copy, but a failed pull leaves them half written). (Buffers vLLM computes itself and an unquantized checkpoint
never holds, the attention layers' KV-cache scales, are not expected in the
manifest unless the KV cache is quantized.) ``finish_weight_update`` processes the weights and records
this rank's :class:`~refitd.client.receiver.RefitStats` (``last_stats``; logged).

**In-flight refit** (swap mode, docs/vllm.md): ``update_weights({"phase": "prefetch",
"version": N})`` returns at once; a background thread of the worker leases N, pulls it
(on the daemon) into the inactive copy and runs vLLM's post-load processing ahead, into
new storage (:mod:`refitd.integrations.vllm.prepared`), while the engine generates.
:func:`inflight_state` (``collective_rpc``) reports each rank's prefetch;
``{"phase": "swap", "version": N}``, sent while the engine is paused, first has every
rank agree (a gather over the engine's ranks) and swaps only if every one holds N
prepared: otherwise each rank refuses and all serve on the version they had.
``{"phase": "abandon"}`` drops a finished prefetch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refitd.client.deltarefit import DeltaReceiver
from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.errors import ConflictError
from refitd.integrations.vllm.destinations import LoaderDestinations
from refitd.integrations.vllm.lora import refit_lora
from refitd.integrations.vllm.postload import Reprocessing
from refitd.integrations.vllm.prefetching import (
    PHASES,
    InflightWorker,
    RankPrefetch,
    RefitdWorkerExtension,
    asked,
    inflight_state,
    new_background,
)

__all__ = [
    "RefitdInitInfo",
    "RefitdUpdateInfo",
    "RefitdWeightTransferEngine",
    "RefitdWorkerExtension",
    "inflight_state",
    "lora_stats",
    "refit_lora",
    "refit_stats",
]

logger = logging.getLogger(__name__)


@dataclass
class RefitdInitInfo(WeightTransferInitInfo):
    """What the trainer tells every worker once.

    ``model`` is the name the trainer publishes under; ``url`` this node's daemon
    (empty: ``$REFITD_URL``, else the configured listener); ``source_url`` the
    daemon holding the published versions when it is another node's (empty: the
    local one); ``allow_unwritten`` names parameters the manifest may leave as
    they are (strict by default); ``mode`` how a pull lands (the module docstring);
    ``delta`` refits by delta when the engine holds
    the version before (docs/delta.md), a full refit every ``anchor_every`` updates;
    ``delta="auto"`` only when the source daemon is on another host;
    ``prefetch_nice`` the CPU priority of an in-flight prefetch's thread,
    ``prefetch_threads`` the OpenMP threads its processing runs on (0: the engine's
    own count), ``prefetch_duty`` the share of wall time it works while processing
    (it rests between modules the rest; 1: never rests) (docs/vllm.md).
    """

    model: str = "policy"
    url: str = ""
    source_url: str = ""
    token_file: str = ""
    mode: str = "swap"
    lease_ttl_s: float = 60.0
    allow_unwritten: list[str] = field(default_factory=list)
    delta: bool | Literal["auto"] = False
    anchor_every: int = 0
    prefetch_nice: int = 19
    prefetch_threads: int = 0
    prefetch_duty: float = 1.0
    #: False: only LoRA adapters are refitted (no base-model destinations are set up)
    base: bool = True

    def __post_init__(self) -> None:
        if self.prefetch_threads < 0:
            raise ValueError(f"prefetch_threads {self.prefetch_threads}: expected 0 or more")
        if not 0.0 < self.prefetch_duty <= 1.0:
            raise ValueError(f"prefetch_duty {self.prefetch_duty}: expected a share in (0, 1]")


@dataclass
class RefitdUpdateInfo(WeightTransferUpdateInfo):
    """One update: the published ``version`` to refit to (``None``: the newest READY).

    ``phase``: ``"refit"`` (the whole refit now), or an in-flight refit's step:
    ``"prefetch"`` (start; returns at once), ``"swap"`` (all ranks or none),
    ``"abandon"`` (drop a finished prefetch)."""

    version: int | None = None
    phase: str = "refit"
    #: ``phase="lora"``: the adapter (:func:`refitd.integrations.lora.lora_update`)
    lora: dict[str, Any] | None = None


class RefitdWeightTransferEngine(
    LoaderDestinations,
    InflightWorker,
    WeightTransferEngine[RefitdInitInfo, RefitdUpdateInfo],
):
    """refitd as a vLLM weight-transfer backend (``backend="refitd"``)."""

    init_info_cls = RefitdInitInfo
    update_info_cls = RefitdUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._runner: asyncio.Runner | None = None
        self._clients: list[Any] = []
        self.receiver: DaemonReceiver | None = None
        self._reprocess = Reprocessing([], [])
        self._untied: list[str] = []
        self._init_info: RefitdInitInfo | None = None
        self._computed: list[str] = []
        self._pending: RefitStats | None = None
        # The receiver's asyncio runs happen off vLLM's thread: a whole refit on
        # ``_pool`` (waited for), a prefetch on ``_background`` (not waited for, at the
        # lowest CPU priority so the engine's steps come first); one at a time (the lock).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="refitd-worker")
        self._background = new_background()
        self._runs = threading.Lock()
        self._prefetch: RankPrefetch | None = None
        self._dest_names: dict[int, str] = {}
        self.last_stats: dict[str, Any] | None = None
        self._lora: Any = None
        self._lora_pulled: dict[str, dict[str, Any]] = {}  # pulled, not yet installed
        self.last_lora: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on the receiver's thread and wait for it."""
        return self._pool.submit(self._run_here, coro).result()

    def _run_here(self, coro: Any) -> Any:
        assert self._runner is not None
        with self._runs:
            return self._runner.run(coro)

    def init_transfer_engine(self, init_info: RefitdInitInfo) -> None:
        from refitd.integrations.connect import daemon_client

        if self._runner is not None and init_info == self._init_info:
            return  # the same trainer reconnecting: keep the compiled plan
        if self._runner is not None:
            self.shutdown()
        self._init_info = init_info
        self._runner = asyncio.Runner()
        local = daemon_client(init_info.url, init_info.token_file)
        source = (
            daemon_client(init_info.source_url, init_info.token_file)
            if init_info.source_url
            else local
        )
        self._clients = [local] if source is local else [local, source]
        if init_info.mode not in ("swap", "staging", "direct"):
            raise ValueError(
                f"refitd mode must be 'swap', 'staging' or 'direct', not {init_info.mode!r}"
            )
        self._lora = None
        if not init_info.base:
            logger.info("refitd: worker connected to %s for LoRA adapters", local.base_url)
            return
        engine = self._destinations()
        kind: Any = DaemonReceiver
        extra: dict[str, Any] = {}
        if init_info.delta:  # post-load processing runs inside the delta: rolled back too
            kind = DeltaReceiver
            extra = {"anchor_every": init_info.anchor_every, "after_apply": self._process}
            extra["prefer"] = "auto" if init_info.delta == "auto" else "delta"
        self.receiver = kind(
            local=local,
            source=source,
            model=init_info.model,
            engine=engine,
            twin=self._twin,
            capture=self._capture,
            mode=init_info.mode,
            lease_ttl_s=init_info.lease_ttl_s,
            allow_unwritten=[*init_info.allow_unwritten, *self._computed],
            **extra,
        )
        logger.info(
            "refitd: worker connected to %s for %r (modules processed again after each update: %d)",
            local.base_url,
            init_info.model,
            len(self._reprocess.modules),
        )

    # ------------------------------------------------------------ updates

    def start_weight_update(self) -> None:
        self._pending = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        if info.phase == "lora":
            raise ValueError(
                "refitd: a LoRA adapter is not refitted inside a weight update: vLLM's "
                "finish_weight_update drops every adapter; use "
                "collective_rpc(refitd.integrations.vllm.worker.refit_lora, args=(info,))"
            )
        if info.phase not in PHASES:
            raise ValueError(f"refitd: update phase {info.phase!r} refused: one of {PHASES}")
        if self.receiver is None:
            raise RuntimeError("refitd: init_weight_transfer_engine was not called")
        if info.phase == "prefetch":
            self._start_prefetch(info.version)
        elif info.phase == "swap":
            self._swap(info.version)
        elif info.phase == "abandon":
            self._abandon()
        else:
            self.receive_weights(info)
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def _lora_refit(self, info: RefitdUpdateInfo) -> None:
        """Refit one LoRA adapter (:mod:`refitd.integrations.vllm.lora`): pull, then
        land it in a free slot and move the adapter there. ``info.lora["step"]``:
        ``"all"`` (default), or ``"pull"`` then ``"install"`` as two calls, so that at
        TP > 1 no rank installs before every rank has pulled
        (:func:`~refitd.integrations.vllm.lora.refit_adapter`)."""
        from refitd.integrations.lora import AdapterRefused
        from refitd.integrations.vllm.lora import LoraSlots

        if self._runner is None or self._init_info is None:
            raise RuntimeError("refitd: init_weight_transfer_engine was not called")
        if info.lora is None:
            raise ValueError(
                "refitd: phase 'lora' needs the adapter: 'lora': {name, id, model, config}"
            )
        step, name = str(info.lora.get("step", "all")), str(info.lora["name"])
        if step not in ("all", "pull", "install"):
            raise ValueError(f"refitd: LoRA step {step!r} refused: 'all', 'pull' or 'install'")
        if self._lora is None:
            self._lora = LoraSlots(self.model, self.vllm_config)
        if step == "install":
            pulled = self._lora_pulled.pop(name, None)
            want = info.version
            if pulled is None or (want is not None and pulled["stats"].version != want):
                raise AdapterRefused(
                    f"adapter {name!r}: install of {'the pulled version' if want is None else f'v{want}'} "
                    f"refused on rank {self._rank()}: this rank holds no such pull"
                )
        else:
            self._lora_pulled.pop(name, None)  # a new pull rewrites the buffers
            local, source = self._clients[0], self._clients[-1]
            ttl = self._init_info.lease_ttl_s
            pulled = self._run(self._lora.refit(info.lora, info.version, local, source, ttl))
        stats = pulled["stats"]
        self.last_lora = {
            "adapter": name,
            "version": stats.version,
            "replayed": stats.replayed,
            "bytes": stats.bytes,
            "pull_s": stats.pull_s,
            "plan_s": stats.plan_s,
            "pulled_s": time.perf_counter() - pulled["t0"],
        }
        if step == "pull":
            self._lora_pulled[name] = pulled
            return
        t0 = time.perf_counter()
        installed = self._lora.install(name, stats.version)
        self.last_lora |= {
            **installed,
            "total_s": self.last_lora["pulled_s"] + time.perf_counter() - t0,
        }
        logger.info("refitd: LoRA refit %s", self.last_lora)

    def receive_weights(self, update_info: RefitdUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("refitd: init_weight_transfer_engine was not called")
        pf = self._prefetch
        if pf is not None and pf.state == "running":
            raise ConflictError(
                f"refitd: refit refused on rank {self._rank()}: a prefetch of "
                f"{asked(pf.asked)} still runs into the inactive copy; swap or abandon it first"
            )
        self._prefetch = None  # a refit writes the inactive copy: a prefetched version is gone
        self._pending = self._run(self.receiver.refit(update_info.version))

    def finish_weight_update(self) -> None:
        stats, self._pending = self._pending, None
        if stats is None:
            return
        t0 = time.perf_counter()
        last = getattr(self.receiver, "last", None)
        if last is None or last.kind != "delta":  # a delta processed inside its transaction
            self._process()
        process_s = time.perf_counter() - t0
        self.last_stats = {
            "version": stats.version,
            "replayed": stats.replayed,
            "bytes": stats.bytes,
            "descriptors": stats.descriptors,
            "plans": self.receiver.plans if self.receiver is not None else 0,
            "manifest_s": stats.manifest_s,
            "plan_s": stats.plan_s,
            "pull_s": stats.pull_s,
            "install_s": stats.install_s,
            "process_s": process_s,
            "total_s": stats.total_s + process_s,
            "kind": last.kind if last is not None else "full",
            "reason": last.reason if last is not None else "",
        }
        self.history.append(self.last_stats)
        logger.info("refitd: refit %s", self.last_stats)

    def _process(self) -> None:
        """Bring every module that computes from a written tensor up to date
        (:mod:`refitd.integrations.vllm.postload`)."""
        self._reprocess.run()

    def shutdown(self) -> None:
        if self._runner is None:
            return
        pf, self._prefetch = self._prefetch, None
        if pf is not None and pf.future is not None:
            pf.future.result()  # its pull ends (or fails) before the receiver closes
        if self.receiver is not None:
            self._run(self.receiver.close())
        if self._lora is not None:
            for adapter in self._lora.adapters.values():
                self._run(adapter.receiver.close())
            self._lora = None
        for c in self._clients:
            self._run(c.close())
        self._pool.submit(self._runner.close).result()
        self._runner = None
        self._init_info = None
        self.receiver = None
        self._clients = []


def lora_stats(worker: Any) -> dict[str, Any] | None:
    """``llm.collective_rpc(lora_stats)``: each worker's last LoRA refit, or ``None``."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return getattr(engine, "last_lora", None)


def refit_stats(worker: Any) -> dict[str, Any] | None:
    """``llm.collective_rpc(refit_stats)``: each worker's last refit, or ``None``."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return getattr(engine, "last_stats", None)
