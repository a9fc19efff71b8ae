"""Bounded work and loose edges: what one request may cost the daemon, and the
refusals at its edges (issue 20, class 4)."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from support.hostile import Env, hostile_daemon

from transports.shm import SHM_DIR

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with hostile_daemon() as e:
        yield e


def _symlink(p: Path) -> None:
    p.symlink_to("/etc/hostname")


def _directory(p: Path) -> None:
    p.mkdir()


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def _fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


@pytest.mark.parametrize("make", [_symlink, _directory, _socket, _fifo])
async def test_attaching_a_name_that_is_not_a_regular_file_is_a_400_in_the_error_shape(
    env: Env, make: Callable[[Path], None]
) -> None:
    name = f"refitd-test-{make.__name__[1:]}-{os.getpid()}"
    path = SHM_DIR / name
    make(path)
    try:
        detail = await env.refused(
            "POST", "/v1/regions/attach", {"handle": name, "nbytes": 64}, status=400
        )
        assert "not a regular file" in detail, detail
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
