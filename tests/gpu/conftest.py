"""GPU tests: each skips, naming the reason, where this machine cannot use CUDA.

They run on a GPU machine prepared with ``device-pack`` through
``tests/gpu/run-on-device.sh``; everywhere else they are collected and skipped, so
``make test`` and CI pass unchanged without a GPU.
"""

from __future__ import annotations

import pytest

from refitd.bench.gpu import missing_gpu


@pytest.fixture(scope="session")
def gpu() -> None:
    """Skip the test (with the reason) where no CUDA device can be used here."""
    why = missing_gpu()
    if why is not None:
        pytest.skip(f"needs a CUDA device: {why}")
