"""One home for the vLLM tests' world: a daemon with vLLM's environment pointed at it,
engines in the test's own process, and their teardown.

- :func:`vllm_daemon`: a real ``refitd serve`` (``--set`` settings of the test's
  choosing) and vLLM's environment (:func:`vllm_env`) for the block; at its end a
  collection lets go of the engines dropped, then the daemon stops and the
  environment is restored. :func:`vllm_environment` alone serves a daemon the test
  runs itself (one in a thread of its process, with a fake of its own).
- :func:`running`: an engine for the block, then stopped (:func:`stop_engine`) and
  collected, before the next one starts (vLLM keeps per-process state).
- :func:`refit_engine`: an ``LLM`` with refitd as its weight-transfer backend;
  :func:`fresh_serving`: what a fresh ``LLM`` of a checkpoint serves, the engine
  stopped before it returns (the truth a refit is judged against).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

__all__ = [
    "AMX_OFF",
    "cpu_llm",
    "fresh_serving",
    "refit_engine",
    "running",
    "stop_engine",
    "vllm_daemon",
    "vllm_env",
    "vllm_environment",
]

T = TypeVar("T")

AMX_OFF = Path(__file__).resolve().parents[1] / "integrations" / "amx_off"
"""A folder whose ``sitecustomize`` reports AMX absent to torch (see its docstring)."""


def vllm_env(mp: Any, temp: Any, url: str) -> None:
    """Offline vLLM, and the daemon at ``url``, set through the monkeypatch ``mp`` so
    nothing leaks into other tests' environment.

    - vLLM's cache is one per test worker, under the run's base temporary directory
      (``temp``, pytest's ``tmp_path_factory``): every test of a worker shares what
      vLLM learnt inspecting an architecture (seconds a model class), and no two
      workers write one cache.
    - The engine runs in the test's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
      a mode vLLM supports): the same engine core, worker and refitd backend, without
      the two spawned interpreters that made an engine cost 35-50 s to start here
      instead of 2-4 s. A test about that boundary sets
      ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` itself (``test_vllm_serve``, ``test_vllm_tp2``).
    - AMX is reported absent, in this process and in every process started from here
      on (vLLM's engine core and workers): its kernels make the workers die at random
      with SIGILL on the test machines. Any worker death still fails the test; nothing
      retries.

    Engines in this process would otherwise step on each other, as vLLM keeps some
    state once per process:
    - the environment, frozen once an engine core has started: unfrozen here, so a
      later test's settings are read afresh;
    - the collector's permanent generation, where an engine core moves every object
      alive when it starts: left alone, so an engine dropped is freed;
    - the parallel groups, which an engine core destroys when it shuts down: a test
      ends each engine with :func:`stop_engine`, not by dropping it (a dropped one
      shuts down at whatever later collection frees it, under the engine serving
      then).

    And vLLM inspects each model architecture it has not cached in a fresh
    interpreter, so that the process serving never initializes CUDA: 11-12 s an
    architecture here, paid by every test worker for each family it meets. With no
    CUDA device there is nothing to protect, and the inspection runs in this process
    (it imports the model's module, which the engine imports anyway)."""
    import vllm.envs
    import vllm.v1.engine.core
    from vllm.model_executor.models import registry

    vllm.envs.disable_envs_cache()
    mp.setattr(vllm.v1.engine.core, "freeze_gc_heap", lambda: None)
    if not torch.cuda.is_available():
        mp.setattr(registry, "_run_in_subprocess", lambda fn: fn())
    mp.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    path = os.environ.get("PYTHONPATH", "")
    mp.setenv("PYTHONPATH", os.pathsep.join([str(AMX_OFF), *filter(None, [path])]))
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(temp.getbasetemp() / "vllm-cache"),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "REFITD_URL": url,  # the engine's workers find their daemon here
    }.items():
        mp.setenv(key, value)


def stop_engine(llm: Any) -> None:
    """Shut ``llm``'s engine down now (once: a second call, or the collection that
    frees it later, does nothing). In the test's process, it destroys vLLM's parallel
    groups then, before the next engine makes its own."""
    llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def vllm_environment(
    temp: pytest.TempPathFactory, url: str, mp: pytest.MonkeyPatch | None = None
) -> Iterator[None]:
    """:func:`vllm_env` for the block, pointed at the daemon at ``url``, restored
    after; through the test's own ``mp`` if given (restored with it, so a test that
    sets the same variables again through it is undone in order)."""
    own = mp is None
    mp = pytest.MonkeyPatch() if mp is None else mp
    try:
        vllm_env(mp, temp, url)
        yield
    finally:
        if own:
            mp.undo()


@contextlib.contextmanager
def vllm_daemon(
    temp: pytest.TempPathFactory,
    name: str,
    *settings: str,
    mp: pytest.MonkeyPatch | None = None,
) -> Iterator[str]:
    """A real ``refitd serve`` (its files under a fresh ``name`` folder, ``settings``
    its ``--set`` overrides, e.g. ``"pulls.deltas=true"``) and vLLM's environment
    pointed at it (:func:`vllm_environment`, ``mp`` as there), for the block; yields
    its URL. The daemon stops once a collection has let go of the engines dropped,
    so their workers never outlive it."""
    from refitd.bench.vllm import start_daemon

    daemon, url = start_daemon(temp.mktemp(name), *settings)
    try:
        with vllm_environment(temp, url, mp):
            yield url
    finally:
        gc.collect()
        daemon.terminate()
        daemon.wait(30)


@contextlib.contextmanager
def running(llm: Any) -> Iterator[Any]:
    """``llm`` for the block, then stopped (:func:`stop_engine`) and collected."""
    try:
        yield llm
    finally:
        stop_engine(llm)
        del llm
        gc.collect()


def cpu_llm(model_dir: Path, **kwargs: Any) -> Any:
    """An in-process ``LLM`` of ``model_dir`` with the tests' CPU settings."""
    from vllm import LLM

    from refitd.bench.vllm import LLM_CPU_KWARGS

    return LLM(model=str(model_dir), **LLM_CPU_KWARGS, **kwargs)


def refit_engine(model_dir: Path) -> contextlib.AbstractContextManager[Any]:
    """An engine of ``model_dir`` with refitd as its weight-transfer backend, for the
    block (:func:`running`)."""
    return running(cpu_llm(model_dir, weight_transfer_config={"backend": "refitd"}))


def fresh_serving(model_dir: Path, observe: Callable[[Any], T]) -> T:
    """What a fresh engine of ``model_dir`` serves, as ``observe(llm)`` reads it; the
    engine is stopped before this returns (one in-process engine at a time)."""
    with running(cpu_llm(model_dir)) as fresh:
        return observe(fresh)
