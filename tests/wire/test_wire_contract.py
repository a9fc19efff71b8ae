"""The wire contract lives in one module both sides import (``refitd.wire``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refitd import errors, wire


def _modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_the_client_imports_no_daemon_module() -> None:
    loaded = _modules_after("from refitd.client import *")  # every public name, imported
    assert not {m for m in loaded if m.startswith("refitd.daemon")}


@pytest.mark.parametrize("first", ["refitd.daemon.experts.routes", "refitd.daemon.app.handlers"])
def test_the_daemon_handler_modules_import_in_either_order(first: str) -> None:
    other = (
        "refitd.daemon.app.handlers"
        if first == "refitd.daemon.experts.routes"
        else "refitd.daemon.experts.routes"
    )
    loaded = _modules_after(f"import {first}\nimport {other}")
    assert {first, other} <= loaded


def test_every_error_class_has_one_status_that_maps_back_into_its_branch() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        status = wire.status_of(cls("x"))
        back = wire.ERROR_OF_STATUS[status]
        assert issubclass(cls, back) or issubclass(back, cls), (name, status, back)
