"""The daemon asks a transport what it can do and a source what it offers; it never
tests a scheme's name or a source's class to decide what to do.

:mod:`refitd.daemon.pull.paths` is the one module that names a scheme (the modes of
the config, what ``auto`` starts, the key of a peer's same-host advertisement).
Everywhere else a comparison with a scheme's name, or an ``isinstance`` test of a
pull's source, is a rule written twice: a new transport (an entry point) would get
the behaviour of none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DAEMON = ROOT / "refitd" / "daemon"
NAMING = {DAEMON / "pull" / "paths.py"}
SCHEMES = {"shm", "tcp", "ucx"}
SCHEME_NAMES = {"SHM_SCHEME", "TCP_SCHEME", "UCX_SCHEME"}
SOURCES = {"LocalSource", "RemoteSource", "MirroredSource"}


def _names_a_scheme(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in SCHEMES
    if isinstance(node, ast.Name):
        return node.id in SCHEME_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in SCHEME_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_scheme(e) for e in node.elts)
    return False


def scheme_tests(tree: ast.AST) -> list[int]:
    """Lines comparing something with a scheme's name (``==``, ``!=``, ``in``)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(_names_a_scheme(e) for e in [node.left, *node.comparators])
    ]


def source_class_tests(tree: ast.AST) -> list[int]:
    """Lines testing whether a value is one of the pull sources' classes."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id != "isinstance" or len(node.args) != 2:
            continue
        kinds = node.args[1]
        named = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
        if any(isinstance(k, ast.Name) and k.id in SOURCES for k in named):
            out.append(node.lineno)
    return out


def test_the_checks_find_what_they_look_for() -> None:
    tree = ast.parse(
        'if path == "tcp": pass\n'
        "if job.path in (SHM_SCHEME, x): pass\n"
        "if paths.UCX_SCHEME != mode: pass\n"
        "if isinstance(src, LocalSource): pass\n"
        'if caps.holds_reads and name == "local": pass\n'
    )
    assert scheme_tests(tree) == [1, 2, 3]
    assert source_class_tests(tree) == [4]


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(DAEMON.rglob("*.py")) if p not in NAMING],
    ids=lambda p: str(p.relative_to(DAEMON)),
)
def test_the_daemon_decides_nothing_by_a_scheme_name(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    assert scheme_tests(tree) == [], (
        f"{path.relative_to(ROOT)} compares with a scheme's name at the lines listed: ask "
        "the transport (transports.interface.Capabilities) instead"
    )


@pytest.mark.parametrize(
    "path", sorted((DAEMON / "pull").rglob("*.py")), ids=lambda p: str(p.relative_to(DAEMON))
)
def test_a_pull_asks_its_source_not_its_class(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    assert source_class_tests(tree) == [], (
        f"{path.relative_to(ROOT)} tests a source's class at the lines listed: ask the "
        "source (refitd.daemon.pull.sources.Source) instead"
    )
