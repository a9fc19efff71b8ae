"""The user's manual as test input: README.md and the reference pages in docs/.

Tests that run a documented snippet find it here, by page and section heading, so a
snippet that moves or breaks fails its test instead of going stale.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DOCS", "ROOT", "code_blocks", "pages", "python_blocks", "section"]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then every page of docs/, in name order."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def section(page: str, heading: str) -> str:
    """The text of ``page`` (relative to the repository root) from the line ``heading``
    (e.g. ``"## Running as a service"``) to the next heading of the same or a higher
    level; a heading that is not there raises ``ValueError``, naming it."""
    text = (ROOT / page).read_text()
    lines = text.split("\n")
    if heading not in lines:
        raise ValueError(f"{page} has no heading {heading!r}")
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = len(lines)
    fence = False
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("```"):
            fence = not fence
        m = re.match(r"(#+) ", lines[i])
        if not fence and m and len(m.group(1)) <= level:
            end = i
            break
    return "\n".join(lines[start:end])


def code_blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced ```lang blocks of ``text``, in order."""
    return re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", text, re.S | re.M)


def python_blocks(heading: str, page: str = "README.md") -> list[str]:
    """The ```python blocks of the section ``heading`` of ``page``, in order."""
    return code_blocks(section(page, heading), "python")
