"""How the host mirrors are wired into their daemon (issue 50): each part is built with
the owners it uses, never the whole daemon, and nothing is set on the daemon or on the
pull manager after they are built.

The daemon's lease rules cut what a lease reads of a mirror still filling with the
daemon's own table of mirrors still filling (:class:`~refitd.daemon.mirror.hold.FillingMirrors`),
which the mirrors are built with; the pull manager is built with the mirrors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from support.daemons import served

from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.daemon.mirror.routes import MIRRORS
from refitd.daemon.pull.pulls import PULLS
from refitd.wire import MemoryKind, RegionInfo

pytestmark = pytest.mark.timeout(60)

ROOM = Path(__file__).resolve().parents[3] / "refitd" / "daemon" / "mirror"
WIRING = {"routes.py", "digestroutes.py"}
"""The modules whose setup functions build the room's parts from a daemon's parts."""


def _mirror(version: int = 1) -> Mirror:
    """A mirror of ``m`` ``version`` over local region 7 (256 bytes, source region 3),
    cut into two chunks of 128 bytes, none complete."""
    m = Mirror("http://source", "m", version)
    m.regions = {3: RegionInfo(7, MemoryKind.HOST, "", 256, 0)}
    m.chunks = np.array([[3, 0, 128], [3, 128, 128]], dtype=np.int64)
    m.done = np.zeros(2, dtype=bool)
    return m


def test_a_lease_on_a_mirror_still_filling_reads_only_its_complete_chunks_until_it_is_complete() -> (
    None
):
    filling = FillingMirrors()
    whole = {7: [(0, 256)]}
    m = _mirror()
    filling.add(m)
    assert filling.limit_scope("m", 1, whole) == {7: []}  # every region still listed
    m.mark(np.array([0]))
    assert filling.limit_scope("m", 1, whole) == {7: [(0, 128)]}
    assert filling.limit_scope("m", 2, whole) == whole  # another version: as it is
    m.error = "its source went away"  # failed, its regions not freed yet: still cut
    assert filling.limit_scope("m", 1, whole) == {7: [(0, 128)]}
    m.error = ""
    m.mark(np.array([1]))
    assert filling.limit_scope("m", 1, whole) == whole
    filling.remove(m)
    assert filling.limit_scope("m", 1, whole) == whole


async def test_the_mirrors_change_the_daemons_table_and_the_pull_manager_is_built_with_them() -> (
    None
):
    """One table of mirrors still filling: the one the daemon made (its lease rules
    read it), given to the mirrors when they were built; and the app's pull manager
    asks the app's mirrors."""
    async with served() as s:
        mirrors = s.app[MIRRORS]
        assert mirrors.filling is s.daemon.filling
        assert s.app[PULLS].mirrors is mirrors


def _keeps_the_daemon(tree: ast.AST) -> list[str]:
    """What in a module keeps or names the daemon: ``self.d``/``self.daemon`` (set or
    read), and any use of the name ``Daemon``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in {"d", "daemon"}:
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                found.append((node.lineno, f"line {node.lineno}: self.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id == "Daemon":
            found.append((node.lineno, f"line {node.lineno}: Daemon"))
    return [what for _, what in sorted(found)]


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(ROOM.glob("*.py")) if p.name not in WIRING],
    ids=lambda p: p.name,
)
def test_no_part_of_the_mirror_room_keeps_or_names_the_daemon(path: Path) -> None:
    assert _keeps_the_daemon(ast.parse(path.read_text())) == []


def test_the_check_finds_a_kept_daemon() -> None:
    tree = ast.parse("class A:\n    def __init__(self, d: Daemon) -> None:\n        self.d = d\n")
    assert _keeps_the_daemon(tree) == ["line 2: Daemon", "line 3: self.d"]
