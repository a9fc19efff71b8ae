"""The user's manual (README.md and docs/) stays true: its snippets run as written, and
every link, module, test, command and route it names exists.

Snippets that need vLLM, a service install or a daemon's expert pools are run by the
tests of those areas (each page says which); this module runs the rest and checks the
manual as a whole.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from support.docs import DOCS, ROOT, code_blocks, pages, python_blocks, section
from vllm_models import readme_blocks

from refitd.cli import BENCHES, COMMANDS, main
from refitd.client.http import RefitClient
from refitd.client.spawn import spawn_daemon

pytestmark = pytest.mark.timeout(120)

README_MAX_LINES = 300
# Dotted names the manual cites that are not Python objects.
NOT_MODULES = {
    "refitd.transports",  # the entry-point group transports register under
    "refitd.sources",  # a logger
}


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def inline_code(text: str) -> list[str]:
    """The `inline code` spans of ``text``'s prose."""
    return re.findall(r"`([^`\n]+)`", prose(text))


def manual() -> dict[Path, str]:
    return {page: page.read_text() for page in pages()}


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", prose(text), re.M)}


# ------------------------------------------------------------------------ snippets


async def test_the_readme_quickstart_publishes_and_refits_a_custom_engine(secret_file: str) -> None:
    publisher_block, receiver_block = readme_blocks(
        "## Using refitd from your own trainer and engine"
    )
    ns: dict[str, Any] = {}
    exec(publisher_block + "\n" + receiver_block, ns)
    full = torch.arange(64, dtype=torch.float32).view(8, 8)
    async with spawn_daemon(secret_file=secret_file) as d, RefitClient(d.url) as client:
        pub = await ns["publish_two_blocks"](client, full)
        engine = ns["Engine"]()
        await ns["refit_engine"](client, engine)
        assert torch.equal(engine.w, full[2:6])
        await pub.close()


def test_the_expert_residency_snippets_plan_copy_and_prefetch_as_written() -> None:
    from refitd.experts import HostExpertRows

    first, prefetch = python_blocks("# MoE expert residency (`refitd.experts`)", "docs/experts.md")[
        :1
    ] + python_blocks("## Prefetch", "docs/experts.md")
    gate, up, down = 64, 64, 32
    ns: dict[str, Any] = {
        "gate": gate,
        "up": up,
        "down": down,
        "layer": 0,
        "routed": [3, 17, 21, 9, 5, 8, 30, 12],
        "predicted": [7, 3, 12, 19, 4, 31, 2, 25],
        "host_rows": HostExpertRows(48, 128, (gate, up, down)),
    }
    exec(first, ns)
    try:
        assert len(set(ns["plan"].slots)) == 8
        assert ns["cache"].stats().misses == 8
        exec(prefetch, ns)  # the first step again (all hits), then layer 1's prefetch
        assert ns["cache"].stats().hits == 8
        assert ns["cache"].stats().prefetched == 8
        ns["slots"].wait_for(ns["pre"].copy.dst_slots)
        assert ns["slots"].poll() == ()
    finally:
        ns["device"].close()


def test_the_documented_config_check_refusals_are_what_refitd_config_check_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (console,) = code_blocks(section("docs/operations.md", "## Configuration"), "console")
    pairs = re.findall(r"^\$ (refitd .*)\n([^$].*)$", console, re.M)
    assert len(pairs) == 2, console
    monkeypatch.chdir(ROOT)
    for key in [k for k in os.environ if k.startswith("REFITD_")]:
        monkeypatch.delenv(key)
    for command, printed in pairs:
        with pytest.raises(SystemExit) as exit_info:
            raise SystemExit(main(shlex.split(command)[1:]))
        assert exit_info.value.code == 1, command
        out = capsys.readouterr()
        assert printed.strip() in (out.out + out.err).splitlines(), command


# ------------------------------------------------------------------ the manual as a whole


def test_the_readme_opens_with_the_two_commands_and_fits_in_300_lines() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    first = code_blocks(text, "bash")[0].splitlines()
    assert [line.split()[:2] for line in first] == [["make", "demo"], ["make", "test"]]
    assert text.index("make demo") < text.index("\n## ")


def test_the_readme_links_every_reference_page() -> None:
    text = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", text))
    assert linked == {f"docs/{p.name}" for p in DOCS.glob("*.md")}


def test_every_relative_link_in_the_manual_reaches_a_file_and_heading() -> None:
    texts = manual()
    broken = []
    for page, text in texts.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_every_test_the_manual_names_exists() -> None:
    tests = ROOT / "tests"
    defined = set()
    for f in tests.rglob("*.py"):
        defined.add(f.stem)
        defined.update(re.findall(r"^\s*(?:async )?def (test_\w+)", f.read_text(), re.M))
    missing = [
        f"{page.name}: {name}"
        for page, text in manual().items()
        for name in inline_code(text)
        if re.fullmatch(r"test_\w+", name) and name not in defined
    ]
    assert missing == []


def test_every_path_the_manual_names_exists() -> None:
    missing = []
    for page, text in manual().items():
        for code in inline_code(text):
            path = code.split()[0] if code.startswith(("python ", "tests/")) else code
            path = path.removeprefix("python ").strip()
            if not re.fullmatch(r"(refitd|transports|tests|systemd|config|docs)/[\w./*-]*", path):
                continue
            if not any(ROOT.glob(path.rstrip("/"))):
                missing.append(f"{page.name}: {path}")
    assert missing == []


def test_the_readme_layout_names_every_package_and_only_paths_that_exist() -> None:
    (block,) = code_blocks(section("README.md", "## Layout"), "")
    paths = [line.split()[0] for line in block.splitlines() if line.strip() and line[0] != " "]
    assert [p for p in paths if not (ROOT / p).exists()] == []
    packages = {
        f"{init.parent.relative_to(ROOT)}/"
        for top in ("refitd", "transports")
        for init in (ROOT / top).glob("*/__init__.py")
    }
    listed = {p for p in paths if p.endswith("/")}
    # transports/ names its sub-packages (tcp/, ucx/) in one line of its own.
    assert sorted(packages - listed - {"transports/tcp/", "transports/ucx/"}) == []


def _module_defines(dotted: str) -> bool:
    """Whether ``dotted`` (``refitd.x.y.Name``) names a module of this tree, or a name
    that such a module defines or re-exports (read as text: nothing is imported)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.is_dir() and (base / "__init__.py").exists():
            source = (base / "__init__.py").read_text()
        elif base.with_suffix(".py").exists():
            source = base.with_suffix(".py").read_text()
        elif any(base.parent.glob(f"{base.name}.*.so")) or base.with_suffix(".c").exists():
            return n == len(parts)
        else:
            continue
        rest = parts[n:]
        return not rest or re.search(rf"\b{re.escape(rest[0])}\b", source) is not None
    return False


def test_every_module_and_name_the_manual_cites_exists() -> None:
    missing = []
    for page, text in manual().items():
        for code in inline_code(text):
            m = re.match(r"((?:refitd|transports)(?:\.\w+)+)", code)
            if m and m.group(1) not in NOT_MODULES and not _module_defines(m.group(1)):
                missing.append(f"{page.name}: {m.group(1)}")
    assert missing == []


def _documented_commands(text: str) -> set[tuple[str, ...]]:
    """``("bench", "plan")`` or ``("status",)`` for every refitd command line of
    ``text``: inline code and code-block lines that start with ``refitd ``."""
    lines = inline_code(text)
    for lang in ("bash", "console"):
        lines += [ln.removeprefix("$ ") for b in code_blocks(text, lang) for ln in b.splitlines()]
    out = set()
    for line in lines:
        words = re.findall(r"[\w-]+", line.split("#")[0]) if line.startswith("refitd ") else []
        if len(words) >= 2:
            out.add(tuple(words[1:3]) if words[1] == "bench" and len(words) > 2 else (words[1],))
    return out


def test_every_refitd_command_is_documented_and_every_documented_one_exists() -> None:
    everything = "\n".join(manual().values())
    documented = _documented_commands(everything)
    benches = _documented_commands((DOCS / "benchmarks.md").read_text())
    assert {(name,) for name in COMMANDS} - documented == set()
    assert {("bench", name) for name in BENCHES} - benches == set()
    unknown = {
        c
        for c in documented
        if not (c[0] in COMMANDS or (c[0] == "bench" and (len(c) == 1 or c[1] in BENCHES)))
        and not c[-1].startswith("-")
    }
    assert unknown == set()


async def test_the_api_reference_lists_exactly_the_routes_the_daemon_serves(
    secret_file: str,
) -> None:
    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^\| (GET|POST|PUT|PATCH|DELETE) \| `([^`]+)` \|", text, re.M))
    async with (
        spawn_daemon(secret_file=secret_file) as d,
        aiohttp.ClientSession() as http,
        http.get(f"{d.url}/v1/openapi.json") as resp,
    ):
        doc = await resp.json()
    served = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert sorted(served - documented) == []
    assert sorted(documented - served) == []
