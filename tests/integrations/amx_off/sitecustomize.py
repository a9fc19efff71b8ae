"""Report AMX absent in every process that has this folder on ``PYTHONPATH``.

vLLM's CPU workers pick AMX kernels when ``torch.cpu._is_amx_tile_supported()`` is
true, and on the test machines those workers then die at random with SIGILL
(notes on vLLM in the shared docs). The test engines run with AMX reported absent:
when ``torch.cpu`` is imported, that one function is replaced by one that returns
``False``. Torch is not imported here: a process that never imports it pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any


def _amx_absent() -> bool:
    return False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        module._is_amx_tile_supported = _amx_absent  # type: ignore[attr-defined]


class _AmxAbsent(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _AmxAbsent())
