"""GPU tests: each skips, naming the reason, where this machine cannot use CUDA.

They run on a GPU machine prepared with ``device-pack`` through
``tests/gpu/run-on-device.sh``; everywhere else they are collected and skipped, so
``make test`` and CI pass unchanged without a GPU.
"""

from __future__ import annotations

import os

import pytest

# Before CUDA starts (as refitd bench gpu does): cuBLAS picks the same kernels for the
# same shapes, so a refitted model's logits compare bit for bit with a fresh one's.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from refitd.bench.gpu import missing_gpu


@pytest.fixture(scope="session")
def gpu() -> None:
    """Skip the test (with the reason) where no CUDA device can be used here."""
    why = missing_gpu()
    if why is not None:
        pytest.skip(f"needs a CUDA device: {why}")
