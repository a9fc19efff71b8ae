"""Fixtures the daemon tests share.

``env``: the daemon the hostile-input tests attack (``support.hostile``), one per test;
it checks, when the test ends, that the daemon still serves a valid pull byte-exact and
that no refused request wrote into the destination.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.hostile import Env, hostile_daemon


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with hostile_daemon() as e:
        yield e
