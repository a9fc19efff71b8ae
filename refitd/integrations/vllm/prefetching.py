"""In-flight refit, the worker side: prefetch while the engine serves, swap all or none.

:class:`InflightWorker` is mixed into
:class:`~refitd.integrations.vllm.worker.RefitdWeightTransferEngine`; its phases arrive
through vLLM's own ``update_weights`` (docs/vllm.md):

- ``prefetch``: returns at once; the worker's prefetch thread (lowest CPU priority)
  runs :meth:`DaemonReceiver.prefetch <refitd.client.receiver.DaemonReceiver.prefetch>` (a
  full refit into swap mode's inactive copy, on the daemon) and then
  :func:`~refitd.integrations.vllm.prepared.prepare` (vLLM's post-load processing on
  module twins, into new storage), while vLLM's step loop goes on;
- ``swap``: every rank gathers every rank's answer over vLLM's world group; only if
  all hold the version prepared does each rebind and install; otherwise every rank
  refuses and serves on what it had (mixed versions never serve);
- ``abandon``: drops a finished prefetch.

:func:`inflight_state` (``collective_rpc``) reports each rank's prefetch;
:class:`RefitdWorkerExtension` names it for ``vllm serve``'s ``/collective_rpc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.errors import ConflictError
from refitd.integrations.vllm.postload import Reprocessing
from refitd.integrations.vllm.prepared import Prepared, prepare

__all__ = [
    "PHASES",
    "InflightWorker",
    "RankPrefetch",
    "RefitdWorkerExtension",
    "asked",
    "inflight_state",
    "new_background",
]

logger = logging.getLogger(__name__)

PHASES = ("refit", "prefetch", "swap", "abandon")


@dataclass
class RankPrefetch:
    """One rank's in-flight prefetch: ``state`` running, ready or failed."""

    asked: int | None
    started: float
    future: Future[None] | None = None
    state: str = "running"
    error: str = ""
    version: int | None = None
    stats: RefitStats | None = None
    prepared: Prepared | None = None
    pulled_s: float = 0.0
    prepare_s: float = 0.0


class InflightWorker:
    """The in-flight phases of the refitd worker engine (module docstring). The engine
    sets the attributes below; ``_background`` is its prefetch thread."""

    receiver: DaemonReceiver | None
    parallel_config: Any
    vllm_config: Any
    model: torch.nn.Module
    last_stats: dict[str, Any] | None
    history: list[dict[str, Any]]
    _init_info: Any
    _prefetch: RankPrefetch | None
    _background: ThreadPoolExecutor
    _reprocess: Reprocessing
    _dest_names: dict[int, str]

    def _run_here(self, coro: Any) -> Any:
        raise NotImplementedError

    def _rank(self) -> int:
        return int(getattr(self.parallel_config, "rank", 0))

    def _start_prefetch(self, version: int | None) -> None:
        """Start pulling ``version`` into the inactive copy on the receiver's thread and
        return at once (the engine serves on)."""
        assert self._init_info is not None
        if self._init_info.mode != "swap":
            raise ConflictError(
                f"refitd: prefetch of {asked(version)} refused: it needs mode='swap' "
                f"(a second copy to pull into while serving), this engine runs "
                f"{self._init_info.mode!r}"
            )
        if int(getattr(self.parallel_config, "data_parallel_size", 1)) > 1:
            raise ConflictError(
                f"refitd: prefetch of {asked(version)} refused: data parallel engines "
                "are not agreed on across replicas yet; refit instead"
            )
        pf = self._prefetch
        if pf is not None and pf.state == "running":
            raise ConflictError(
                f"refitd: prefetch of {asked(version)} refused on rank {self._rank()}: "
                f"the prefetch of {asked(pf.asked)} still runs"
            )
        pf = self._prefetch = RankPrefetch(version, time.perf_counter())
        pf.future = self._background.submit(self._prefetch_job, pf)

    def _prefetch_job(self, pf: RankPrefetch) -> None:
        """On the receiver's thread: prefetch the version, then prepare its processing."""
        from vllm.config import set_current_vllm_config

        assert self.receiver is not None
        info = self._init_info
        _background_priority(int(getattr(info, "prefetch_nice", 19)))
        threads = int(getattr(info, "prefetch_threads", 0))
        if threads:  # OpenMP's thread count is the calling thread's: the engine keeps its own
            torch.set_num_threads(threads)
        pace = _pacer(float(getattr(info, "prefetch_duty", 1.0)))
        try:
            pf.stats = self._run_here(self.receiver.prefetch(pf.asked))
            pf.version = pf.stats.version
            pf.pulled_s = time.perf_counter() - pf.started
            t0 = time.perf_counter()
            inactive = self.receiver.inactive()
            names = self._dest_names
            with set_current_vllm_config(self.vllm_config):
                pf.prepared = prepare(
                    self._reprocess,
                    self.model,
                    lambda t: inactive[names[id(t)]],
                    self.receiver.pulled_into,
                    pace,
                )
            pf.prepare_s = time.perf_counter() - t0
            pf.state = "ready"
        except Exception as exc:  # any failure is this prefetch's: reported, never raised
            self.receiver.prefetched = None
            pf.error = f"{type(exc).__name__}: {exc}"
            pf.state = "failed"
            logger.warning("refitd: prefetch of %s failed: %s", asked(pf.asked), pf.error)

    def inflight_state(self) -> dict[str, Any]:
        """This rank's prefetch: ``state`` none, running, ready or failed."""
        pf = self._prefetch
        if pf is None:
            return {"rank": self._rank(), "state": "none", "version": None, "error": ""}
        return {
            "rank": self._rank(),
            "state": pf.state,
            "version": pf.version if pf.version is not None else pf.asked,
            "error": pf.error,
            "pulled_s": pf.pulled_s,
            "prepare_s": pf.prepare_s,
            # perf_counter marks (CLOCK_MONOTONIC on Linux: comparable across the
            # host's processes), so a bench can tell the pull's window from processing's
            "started_at": pf.started,
            "bytes": pf.stats.bytes if pf.stats is not None else 0,
        }

    def _why_not(self, version: int | None) -> str:
        """Why this rank cannot swap ``version`` in ("" when it can)."""
        pf = self._prefetch
        if pf is None:
            return "no prefetch"
        if pf.state == "failed":
            return f"its prefetch of {asked(pf.asked)} failed ({pf.error})"
        if pf.state == "running":
            return f"its prefetch of {asked(pf.asked)} still runs"
        if version is not None and pf.version != version:
            return f"it holds v{pf.version}, not v{version}"
        return ""

    def _agree(self, mine: str) -> tuple[list[str], bool]:
        """Every rank's :meth:`_why_not`, gathered over the engine's ranks (each rank
        runs this same call: vLLM sends one update to all of them), and whether this
        rank is the last of them."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return [mine], True
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        if group.world_size == 1:
            return [mine], True
        out: list[Any] = [None] * group.world_size
        dist.all_gather_object(out, mine, group=group.cpu_group)
        return [str(x) for x in out], group.rank_in_group == group.world_size - 1

    def _swap(self, version: int | None) -> None:
        """Swap the prefetched version in, on every rank or on none.

        On a refusal no rank swaps, and only the last rank raises: vLLM 0.32's
        multiprocess executor stops reading the ranks' replies at the first error, in
        rank order, so an error from any earlier rank would leave the later ranks'
        replies to answer the engine's next call. The other ranks return without
        swapping (vLLM's session stays open on them: the driver closes it)."""
        assert self.receiver is not None
        reasons, last = self._agree(self._why_not(version))
        pf = self._prefetch
        if any(reasons) or pf is None:
            why = "; ".join(f"rank {r}: {w}" for r, w in enumerate(reasons) if w)
            message = (
                f"refitd: swap to {asked(version)} refused on every rank, which serve "
                f"on the version they had: {why}"
            )
            if not last:
                logger.warning("%s", message)
                return
            raise ConflictError(message)
        assert pf.prepared is not None and pf.version is not None and pf.stats is not None
        t0 = time.perf_counter()
        self.receiver.swap_prefetched(pf.version)
        pf.prepared.apply()
        swap_s = time.perf_counter() - t0
        self._prefetch = None
        forget = getattr(self.receiver, "forget_base", None)
        if forget is not None:
            forget()  # the engine holds a version no delta base recorded
        st = pf.stats
        self.last_stats = {
            "version": st.version,
            "replayed": st.replayed,
            "bytes": st.bytes,
            "descriptors": st.descriptors,
            "plans": self.receiver.plans,
            "manifest_s": st.manifest_s,
            "plan_s": st.plan_s,
            "pull_s": st.pull_s,
            "install_s": st.install_s,
            "process_s": pf.prepare_s,
            "swap_s": swap_s,
            "total_s": pf.pulled_s + pf.prepare_s + swap_s,
            "kind": "inflight",
            "reason": "",
        }
        self.history.append(self.last_stats)
        logger.info("refitd: in-flight refit %s", self.last_stats)

    def _abandon(self) -> None:
        pf = self._prefetch
        if pf is not None and pf.state == "running":
            raise ConflictError(
                f"refitd: abandon refused on rank {self._rank()}: the prefetch of "
                f"{asked(pf.asked)} still runs (it cannot be stopped mid-pull); ask "
                "again once it ended"
            )
        self._prefetch = None
        if self.receiver is not None:
            self.receiver.prefetched = None


def new_background() -> ThreadPoolExecutor:
    """The prefetch thread: one, at the lowest CPU priority."""
    return ThreadPoolExecutor(
        1, thread_name_prefix="refitd-prefetch", initializer=_background_priority
    )


def inflight_state(worker: Any) -> dict[str, Any] | None:
    """``collective_rpc(inflight_state)``: each rank's in-flight prefetch, or ``None``
    when the worker has no refitd engine."""
    engine = getattr(worker, "weight_transfer_engine", None)
    state = getattr(engine, "inflight_state", None)
    return state() if state is not None else None


class RefitdWorkerExtension:
    """vLLM's ``--worker-extension-cls`` for ``vllm serve``: a worker method by name,
    so ``POST /collective_rpc {"method": "refitd_inflight_state"}`` (dev mode, as the
    RL routes) returns every rank's prefetch (:func:`inflight_state`)."""

    def refitd_inflight_state(self) -> dict[str, Any] | None:
        return inflight_state(self)

    def refitd_refit_lora(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """``POST /collective_rpc {"method": "refitd_refit_lora", "args": [info]}``:
        refit one LoRA adapter (:func:`refitd.integrations.vllm.lora.refit_lora`)."""
        from refitd.integrations.vllm.lora import refit_lora

        return refit_lora(self, update_info)


def _background_priority(nice: int = 19) -> None:
    """The prefetch thread, and the OpenMP team its processing starts (threads inherit
    it), at CPU priority ``nice`` (Linux sets it per thread; raising it back needs the
    privilege to, else it stays). 19, the lowest, by default: on a busy host the
    engine's steps come first and the prefetch takes what they leave; but the thread
    holds Python's GIL at times, and one descheduled while holding it holds the
    engine's step loop up too (docs/vllm.md)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def _pacer(duty: float) -> Callable[[float], None] | None:
    """What the prefetch's processing calls after each module, with the seconds that
    module took: a rest that keeps its work to ``duty`` of the wall time (None at 1:
    it never rests). The engine's steps then meet it on a core only that share of
    the time, however long the processing as a whole."""
    if duty >= 1.0:
        return None
    rest = 1.0 / duty - 1.0
    return lambda took: time.sleep(took * rest)


def asked(version: int | None) -> str:
    return "the newest version" if version is None else f"v{version}"
