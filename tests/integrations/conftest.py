"""Fixtures shared by the vLLM integration tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def vllm_daemon_url(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A real ``refitd serve`` for one test, and vLLM's environment (offline, the worker's
    cache, ``REFITD_URL``) pointed at it: yields the daemon's
    URL. The daemon stops after the test, once a collection has let go of the engines
    the test dropped, so their workers never outlive it."""
    from vllm_models import start_daemon, vllm_env

    daemon, url = start_daemon(tmp_path)
    vllm_env(monkeypatch, tmp_path_factory, url)
    try:
        yield url
    finally:
        gc.collect()
        daemon.terminate()
        daemon.wait(30)
