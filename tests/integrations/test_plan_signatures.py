"""Attributing loader writes by the memory they land in (issue 48) changes no plan of
a family that refitted before it.

``plan_signatures_before_issue48.json`` holds, for every family of
``test_vllm_families`` at TP 1 and three of them at TP 2 (each rank), what the
planner of the commit before issue 48 planned for the family's first checkpoint:
counts, wire bytes and a digest of every read, full read, pack spec and fill. It
was written by ``python tests/integrations/plan_signatures.py OUT ROOT`` on that
commit. The same module runs here on today's code; every recorded family must plan
exactly what it planned then. (A deliberate planner change rewrites the file the same
way and says so in its commit.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_signatures import TP2_FAMILIES, signatures, write_families

pytestmark = pytest.mark.timeout(600)

RECORDED = Path(__file__).with_name("plan_signatures_before_issue48.json")


def test_every_family_that_refitted_before_plans_the_same_reads_and_wire_bytes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    recorded = json.loads(RECORDED.read_text())
    root = tmp_path_factory.mktemp("signatures")
    cache = tmp_path_factory.getbasetemp() / "vllm-cache"
    folders = write_families(root, sorted({name.split("@")[0] for name in recorded}))
    tp2 = [f for f in folders if f.name in TP2_FAMILIES]
    got = signatures([(folders, 1), (tp2, 2)], cache)
    assert sorted(got) == sorted(recorded)
    changed = {
        name: (recorded[name], got[name]) for name in recorded if got[name] != recorded[name]
    }
    assert changed == {}
