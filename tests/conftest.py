"""Root of the test tree.

pytest imports this file with the tests directory on ``sys.path`` (this tree has no
``__init__.py`` files), which is what lets every area import the shared helpers in
``tests/support`` as ``support``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    """A deployment secret (32 random bytes, hex, mode 0600) in a file of its own under
    ``tmp_path``: its path, as ``spawn_daemon(secret_file=...)`` takes it."""
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


def _cost(item: pytest.Item) -> tuple[bool, float]:
    """How expensive a test says it is: marked ``slow``, then its own timeout (the
    safety net a module sets scales with what it starts: a vLLM engine, simulated hosts)."""
    timeout = item.get_closest_marker("timeout")
    limit = float(timeout.args[0]) if timeout is not None and timeout.args else 0.0
    return item.get_closest_marker("slow") is not None, limit


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the most expensive modules first (a stable sort, so the order inside a module
    and between equals is the collection order). Under ``pytest -n`` with ``--dist
    loadfile --no-loadscope-reorder`` (the test command; without the last flag xdist
    orders modules by their number of tests instead), that is longest-first
    scheduling: the engines and simulated hosts start at once instead of leaving one
    worker busy at the end."""
    module_cost: dict[str, tuple[bool, float]] = {}
    for item in items:
        key = item.nodeid.split("::", 1)[0]
        module_cost[key] = max(module_cost.get(key, (False, 0.0)), _cost(item))
    items.sort(key=lambda it: module_cost[it.nodeid.split("::", 1)[0]], reverse=True)
