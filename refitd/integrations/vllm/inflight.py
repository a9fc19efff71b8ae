"""The trainer side of an in-flight refit: the engine generates while the next version
lands, and pauses only to swap it in (docs/vllm.md).

:func:`inflight_update` drives one update through vLLM's own calls:

1. ``update_weights({"phase": "prefetch", "version": N})`` on every rank (inside
   ``start_weight_update``/``finish_weight_update``, as vLLM asks of any update): each
   worker starts pulling N into its inactive copy on a thread of its own and returns at
   once;
2. wait until every rank holds N prepared, asking each rank's state
   (:func:`~refitd.integrations.vllm.worker.inflight_state`). vLLM's weight-transfer
   calls return nothing and each runs between two engine steps, so the driver asks
   again every ``poll_s`` (one short RPC each) rather than block the step loop on a
   wait; any rank that failed refuses the whole update here, **before any pause**, and
   the engine serves on;
3. ``pause_generation(mode="keep", clear_cache=False)``: requests in flight stay
   queued with their KV cache;
4. ``update_weights({"phase": "swap", "version": N})``: every rank agrees first and
   swaps only if all hold N (the worker's rule), so mixed versions never serve; then
   the engine's version is named (``update_weight_version``, the engine core's own
   call). vLLM's session is opened before the pause and closed after the resume (it
   only marks the workers), so the pause holds one call to the workers;
5. ``resume_generation()``, also when the swap was refused; then
   ``finish_weight_update``.

:class:`AsyncLLMControl` drives an in-process ``AsyncLLM``; :class:`HTTPControl` a
``vllm serve`` over its RL routes (``/pause``, ``/resume``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``; served in vLLM's dev mode) and
``/collective_rpc`` for the ranks' states, which needs
``--worker-extension-cls refitd.integrations.vllm.worker.RefitdWorkerExtension``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from refitd.errors import ConflictError

__all__ = [
    "AsyncLLMControl",
    "EngineControl",
    "HTTPControl",
    "InflightStats",
    "PrefetchRefused",
    "inflight_update",
]


class PrefetchRefused(ConflictError):
    """A rank could not prefetch the version: the update was refused before any pause,
    and the engine serves the version it had on every rank. ``states`` holds each
    rank's report."""

    def __init__(self, message: str, states: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.states = states


class EngineControl(Protocol):
    """What :func:`inflight_update` needs of an engine: vLLM's weight-transfer calls,
    its pause and resume, and every rank's prefetch state."""

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: dict[str, Any]) -> None: ...

    async def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    async def pause(self) -> None:
        """``pause_generation(mode="keep", clear_cache=False)``."""

    async def resume(self) -> None: ...

    async def set_weight_version(self, version: str) -> None:
        """``update_weight_version``: the name the engine tags its outputs with."""

    async def states(self) -> list[dict[str, Any]]:
        """Every rank's :func:`~refitd.integrations.vllm.worker.inflight_state`."""


class AsyncLLMControl:
    """:class:`EngineControl` over an in-process ``vllm.v1.engine.async_llm.AsyncLLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def set_weight_version(self, version: str) -> None:
        await self.llm.update_weight_version(version)

    async def states(self) -> list[dict[str, Any]]:
        from refitd.integrations.vllm.worker import inflight_state

        return list(await self.llm.collective_rpc(inflight_state))


class HTTPControl:
    """:class:`EngineControl` over a ``vllm serve`` at ``base_url`` (dev mode, with
    refitd's worker extension: see the module docstring)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self._session.close()

    async def _post(self, path: str, body: Any = None, **query: str) -> Any:
        url = f"{self.base_url}/{path}"
        async with self._session.post(url, json=body, params=query or None) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise ConflictError(f"vllm serve refused POST /{path}: {resp.status} {text[:500]}")
            return await resp.json() if text else None

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._post("init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(self) -> None:
        await self._post("start_weight_update")

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._post("update_weights", {"update_info": update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        await self._post("finish_weight_update", body)

    async def pause(self) -> None:
        await self._post("pause", mode="keep", clear_cache="false")

    async def resume(self) -> None:
        await self._post("resume")

    async def set_weight_version(self, version: str) -> None:
        await self._post("update_weight_version", {"new_version": version})

    async def states(self) -> list[dict[str, Any]]:
        out = await self._post("collective_rpc", {"method": "refitd_inflight_state"})
        return list(out["results"])


@dataclass(frozen=True)
class InflightStats:
    """One in-flight update, in seconds from its start (``perf_counter`` marks):
    ``prefetch_s`` until every rank held the version prepared; ``pause_s`` the pause
    request to the pause completing; ``swap_s`` the pause completing to the resume
    being asked (refitd's work inside the pause); ``pause_total_s`` the pause request
    to the resume completing; ``refit_s`` the prefetch start to the swap's end."""

    version: int
    prefetch_s: float
    pause_s: float
    swap_s: float
    pause_total_s: float
    refit_s: float
    marks: dict[str, float] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)


async def _session(engine: EngineControl, info: dict[str, Any], version: str | None) -> None:
    await engine.start_weight_update()
    await engine.update_weights(info)
    await engine.finish_weight_update(version)


async def inflight_update(
    engine: EngineControl,
    version: int,
    *,
    poll_s: float = 0.01,
    timeout_s: float = 300.0,
) -> InflightStats:
    """Update ``engine`` to the READY ``version`` in flight (module docstring): the
    engine generates through the pull and its processing, and pauses (keep mode) only
    for the swap. Raises :class:`PrefetchRefused` before any pause when a rank could
    not prefetch; then every rank serves the version it had."""
    t0 = time.perf_counter()
    await _session(engine, {"phase": "prefetch", "version": version}, None)
    states = await _until_settled(engine, version, poll_s, timeout_s)
    failed = [
        s or {"state": "no refitd engine"}
        for s in states
        if s is None or s.get("state") != "ready" or s.get("version") != version
    ]
    if failed:
        with contextlib.suppress(Exception):  # best effort: the refusal says what failed
            await _session(engine, {"phase": "abandon"}, None)
        why = "; ".join(
            f"rank {s.get('rank')}: {s.get('state')} {s.get('error') or ''}".strip() for s in failed
        )
        raise PrefetchRefused(
            f"in-flight refit to v{version} refused before any pause, the engine serves on "
            f"the version it had: {why}",
            states,
        )
    # vLLM's session opens before the pause (it only marks the workers), so the pause
    # holds two calls: the swap, and the session's end with the new version's name.
    await engine.start_weight_update()
    t1 = time.perf_counter()
    try:
        await engine.pause()
    except BaseException:
        with contextlib.suppress(Exception):  # the session closes; the pause's error tells
            await engine.finish_weight_update(None)
        raise
    t2 = time.perf_counter()
    swapped = False
    try:
        # A refused swap ends vLLM's session itself (it does so on any update error).
        await engine.update_weights({"phase": "swap", "version": version})
        swapped = True
        await engine.set_weight_version(str(version))  # the engine core's, no worker call
        t3 = time.perf_counter()
    finally:
        t3b = time.perf_counter()
        await engine.resume()
        t4 = time.perf_counter()
        if swapped:
            await engine.finish_weight_update(None)  # closes the session, after the pause
        else:  # a refused swap leaves the session open on every rank but the last
            with contextlib.suppress(Exception):
                await engine.finish_weight_update(None)
    marks = {"ready": t1, "paused": t2, "swapped": t3, "resume_asked": t3b, "resumed": t4}
    return InflightStats(
        version, t1 - t0, t2 - t1, t3b - t2, t4 - t1, t3 - t0, {"start": t0, **marks}, states
    )


async def _until_settled(
    engine: EngineControl, version: int, poll_s: float, timeout_s: float
) -> list[dict[str, Any]]:
    """Every rank's state once none is still running its prefetch of ``version``."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await engine.states()
        if all(s is None or s["state"] != "running" for s in states):
            return states
        if time.monotonic() > deadline:
            raise ConflictError(
                f"in-flight refit to v{version}: ranks still prefetching after "
                f"{timeout_s:.0f} s (no pause was asked): {states}"
            )
        await asyncio.sleep(poll_s)  # vLLM offers no event to wait on (module docstring)
