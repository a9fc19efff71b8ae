"""The package graph: no import cycle between modules of ``refitd/`` and ``transports/``,
and no module over :data:`MAX_LINES` lines.

The graph is read from the source with :mod:`ast`, not from ``sys.modules``, so an
import that runs only inside a function counts as much as one at the top of a module:
both are an arrow the reader has to follow, and both deadlock the same way when the
two modules are first imported from each other's top level. Imports under
``if TYPE_CHECKING:`` never run, but they count too, in a graph of their own: a
module that names another's type depends on it as much as one that calls it, and a
circle through them is the sign that a low floor takes the daemon (or the client)
rather than the parts it uses.

An arrow goes to the module named, never to its parent packages (``import a.b.c``
is an arrow to ``a.b.c``). ``from pkg import name`` is an arrow to ``pkg.name`` when
that is a module of its own, and to ``pkg`` otherwise.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("refitd", "transports")

#: The most lines a module may have (a reader's few screens; STYLE.md).
MAX_LINES = 500

#: Modules over :data:`MAX_LINES` today, being split (issue 22). A shrinking list: a
#: module leaves it once it is split, and nothing joins it.
OVERSIZED: frozenset[str] = frozenset()

#: Modules in a circle only through ``TYPE_CHECKING`` imports today, being cut
#: (issue 38: the host mirrors and pulls name each other's classes). A shrinking
#: list, like :data:`OVERSIZED`: a circle among them alone passes, any other fails.
TYPE_ONLY_CIRCLES: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Module:
    name: str  # dotted, a package as its own name (``refitd.cluster``)
    path: Path
    is_package: bool


@dataclass
class Graph:
    modules: dict[str, Module]
    #: importer -> imported -> the line of the first such import in the importer
    edges: dict[str, dict[str, int]] = field(default_factory=dict)


def _modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            found[name] = Module(name, path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, types: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere in the tree (functions, ``try``
    blocks, class bodies), except under ``if TYPE_CHECKING:`` (its ``else:`` runs);
    with ``types`` those too."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not types:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _ours(name: str, modules: dict[str, Module]) -> str | None:
    """The deepest of our modules that ``name`` names (``a.b.attr`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(node: ast.Import | ast.ImportFrom, me: Module, modules: dict[str, Module]) -> set[str]:
    if isinstance(node, ast.Import):
        return {t for alias in node.names if (t := _ours(alias.name, modules)) is not None}
    if node.level:
        base = me.name.split(".")
        # A package's __init__ is the package itself: ``from . import x`` there is
        # relative to the package, while in ``pkg.mod`` it is relative to ``pkg``.
        drop = node.level - 1 if me.is_package else node.level
        base = base[: len(base) - drop] if drop else base
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets: set[str] = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        target = submodule if submodule in modules else _ours(source, modules)
        if target is not None:
            targets.add(target)
    return targets


def build_graph(types: bool = False) -> Graph:
    """The import graph: of the imports that run, or with ``types`` of every import
    (``TYPE_CHECKING`` ones too)."""
    modules = _modules()
    graph = Graph(modules)
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        arrows = graph.edges.setdefault(module.name, {})
        for node in _imports(tree, types):
            for target in _targets(node, module, modules):
                if target != module.name:
                    line = arrows.get(target, node.lineno)
                    arrows[target] = min(line, node.lineno)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(graph.edges.get(root, {})))))
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.edges.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as the modules in order
    with the first repeated at the end."""
    start = component[0]
    members = set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.edges.get(node, {})):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {component}")


def describe(graph: Graph, cycle: list[str]) -> str:
    steps = []
    for importer, imported in itertools.pairwise(cycle):
        path = graph.modules[importer].path.relative_to(ROOT)
        steps.append(f"  {importer} -> {imported}  ({path}:{graph.edges[importer][imported]})")
    return "\n".join(steps)


def test_no_module_of_refitd_or_transports_imports_itself_back() -> None:
    graph = build_graph()
    assert len(graph.modules) > 100, sorted(graph.modules)
    components = strongly_connected(graph)
    report = "\n\n".join(
        f"{len(c)} modules import each other ({', '.join(c)}); one cycle:\n"
        + describe(graph, shortest_cycle(graph, c))
        for c in components
    )
    assert not components, f"{len(components)} import cycle(s):\n\n{report}"


def test_no_module_names_a_type_of_a_module_that_imports_it_back() -> None:
    graph = build_graph(types=True)
    components = [c for c in strongly_connected(graph) if not set(c) <= TYPE_ONLY_CIRCLES]
    report = "\n\n".join(
        f"{len(c)} modules import each other, counting TYPE_CHECKING imports "
        f"({', '.join(c)}); one cycle:\n" + describe(graph, shortest_cycle(graph, c))
        for c in components
    )
    assert not components, (
        f"{len(components)} type-only import cycle(s) (take the parts you use, or a "
        f"Protocol of them, not the module that imports you):\n\n{report}"
    )


def test_the_list_of_type_only_circles_only_shrinks() -> None:
    circling = set().union(*strongly_connected(build_graph(types=True)))
    stale = sorted(TYPE_ONLY_CIRCLES - circling)
    assert not stale, f"no longer in a circle: remove from TYPE_ONLY_CIRCLES: {stale}"


#: The bottom floors: what each may import from outside itself. Everything above may
#: import them; they never import back up (the daemon, the client, ops).
FLOORS: dict[str, set[str]] = {
    "refitd.errors": set(),
    "refitd.memory_kinds": set(),
    "refitd.signing": {"refitd.errors"},
    "refitd.config": {"refitd.errors"},
    "refitd.wire": {"refitd.errors", "refitd.signing", "refitd.memory_kinds"},
    "transports": {"refitd.errors", "refitd.signing", "refitd.memory_kinds"},
}


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_the_bottom_floors_import_nothing_above_them(floor: str) -> None:
    graph = build_graph()

    def inside(name: str) -> bool:
        return name == floor or name.startswith(floor + ".")

    reached = {
        (importer, target)
        for importer, arrows in graph.edges.items()
        if inside(importer)
        for target in arrows
        if not inside(target) and target not in FLOORS[floor]
    }
    assert not reached, f"{floor} imports up a floor: {sorted(reached)}"


def _line_counts() -> dict[str, int]:
    return {
        str(module.path.relative_to(ROOT)): len(module.path.read_text().splitlines())
        for module in _modules().values()
    }


def test_no_module_is_over_the_line_limit_except_the_listed_ones_being_split() -> None:
    over = {path: n for path, n in _line_counts().items() if n > MAX_LINES}
    unlisted = {path: n for path, n in over.items() if path not in OVERSIZED}
    assert not unlisted, f"modules over {MAX_LINES} lines (split them): {unlisted}"


def test_the_list_of_oversized_modules_only_shrinks() -> None:
    counts = _line_counts()
    stale = sorted(p for p in OVERSIZED if counts.get(p, 0) <= MAX_LINES)
    assert not stale, f"split or gone: remove from OVERSIZED in {Path(__file__).name}: {stale}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import refitd.daemon.access.auth", {"refitd.daemon.access.auth"}),
        ("import refitd.daemon.access.auth.nothing", {"refitd.daemon.access.auth"}),
        ("from refitd.daemon.access import auth", {"refitd.daemon.access.auth"}),
        ("from refitd.daemon import create_daemon_app", {"refitd.daemon"}),
        ("from . import auth", {"refitd.daemon.access.auth"}),
        ("from .auth import read_token", {"refitd.daemon.access.auth"}),
        ("from ... import errors", {"refitd.errors"}),
        ("from ...cluster import etcd", {"refitd.cluster.etcd"}),
        ("import numpy", set()),
    ],
)
def test_an_import_in_a_module_is_resolved_to_the_module_it_names(
    source: str, expected: set[str]
) -> None:
    modules = _modules()
    me = modules["refitd.daemon.access.trust"]
    (node,) = list(_imports(ast.parse(source)))
    assert _targets(node, me, modules) == expected


def test_a_packages_init_resolves_relative_imports_against_itself() -> None:
    modules = _modules()
    me = modules["refitd.cluster"]
    (node,) = list(_imports(ast.parse("from . import etcd")))
    assert _targets(node, me, modules) == {"refitd.cluster.etcd"}


def test_imports_in_functions_count_and_type_checking_ones_count_apart() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import refitd.wire\n"
        "else:\n"
        "    import refitd.errors\n"
        "def f():\n"
        "    import refitd.config\n"
    )
    modules = _modules()
    me = modules["refitd.daemon.app.handlers"]
    found = set().union(*(_targets(n, me, modules) for n in _imports(ast.parse(source))))
    assert found == {"refitd.errors", "refitd.config"}
    tree = ast.parse(source)
    typed = set().union(*(_targets(n, me, modules) for n in _imports(tree, types=True)))
    assert typed == {"refitd.wire", "refitd.errors", "refitd.config"}


def _named_modules(package: Path) -> list[str]:
    """The modules and subpackages directly in ``package`` (a folder)."""
    mods = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    mods += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(mods)


def _packages() -> list[Path]:
    return sorted(p.parent for name in PACKAGES for p in (ROOT / name).rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_docstring_lists_each_of_its_modules(package: Path) -> None:
    """A newcomer opens a package's ``__init__`` to learn what each module is for: the
    docstring names every module and subpackage (`` `name` ``, `` `name/` `` or
    ``:mod:`~pkg.name```), so one added without a line there fails here."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    dotted = ".".join(package.relative_to(ROOT).parts)
    missing = [
        m
        for m in _named_modules(package)
        if not re.search(rf"`(~?{re.escape(dotted)}\.)?{re.escape(m)}/?`", doc)
    ]
    assert not missing, f"{dotted}'s docstring does not name {missing}"
