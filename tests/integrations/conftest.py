"""Fixtures shared by the vLLM integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def vllm_daemon_url(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A real ``refitd serve`` for one test, and vLLM's environment (offline, the worker's
    cache, ``REFITD_URL``) pointed at it: yields the daemon's
    URL. The daemon stops after the test, once a collection has let go of the engines
    the test dropped, so their workers never outlive it."""
    from support.vllm_world import vllm_daemon

    with vllm_daemon(tmp_path_factory, "daemon", mp=monkeypatch) as url:
        yield url
