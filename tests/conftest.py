"""Root of the test tree.

pytest imports this file with the tests directory on ``sys.path`` (this tree has no
``__init__.py`` files), which is what lets every area import the shared helpers in
``tests/support`` as ``support``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


SPREAD = frozenset(
    {"tests/integrations/test_vllm_families.py", "tests/integrations/test_vllm_mla.py"}
)
"""Modules whose parametrized tests are grouped by their parameter, not by module:
``test_vllm_families`` builds one engine per family (a parametrized module-scoped
fixture), ``test_vllm_mla`` two TP 2 engines per family, and their families are
independent, so they may run on different workers."""


def _group(nodeid: str) -> str:
    """The test group a test (by node id) runs in, on one worker: its module, so
    module-scoped fixtures (an engine, a daemon, simulated hosts) are built once; in a
    :data:`SPREAD` module, its module and parameter id."""
    module, _, name = nodeid.partition("::")
    if module in SPREAD and name.endswith("]") and "[" in name:
        return f"{module}[{name.rsplit('[', 1)[1]}"
    return module


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile`` (the test command), schedule by :func:`_group`:
    xdist's file scheduling, but for the :data:`SPREAD` modules."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the most expensive groups first (a stable sort, so the order inside a group
    and between equals is the collection order). Under ``pytest -n`` with ``--dist
    loadfile --no-loadscope-reorder`` (the test command; without the last flag xdist
    orders groups by their number of tests instead), that is longest-first
    scheduling: the engines and simulated hosts start at once instead of leaving one
    worker busy at the end."""
    group_cost: dict[str, tuple[bool, float]] = {}
    for item in items:
        group = _group(item.nodeid)
        group_cost[group] = max(group_cost.get(group, (False, 0.0)), _cost(item))
    items.sort(key=lambda it: group_cost[_group(it.nodeid)], reverse=True)
