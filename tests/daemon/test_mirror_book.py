"""The source's holder book chooses who reads from whom: pure, no daemon."""

from __future__ import annotations

from refitd.daemon.mirrorbook import CHAIN_HOLDERS, TREE_DEGREE, HolderBook
from refitd.wire.mirrors import HolderJoin


def join(book: HolderBook, url: str, exclude: list[str] | None = None, rate: float = 0.0) -> str:
    return book.join(HolderJoin("m", 1, url, "n", exclude or [], rate)).upstream


def parents(book: HolderBook) -> dict[str, str]:
    return {u: book.parent("m", 1, u) or "" for u in book.holders("m", 1)}


def test_up_to_four_holders_form_a_chain_from_the_source() -> None:
    book = HolderBook()
    ups = [join(book, f"h{i}") for i in range(1, CHAIN_HOLDERS + 1)]
    assert ups == ["", "h1", "h2", "h3"]


def test_past_four_holders_the_source_builds_a_tree_of_degree_two_and_sends_once() -> None:
    book = HolderBook()
    for i in range(1, 17):
        join(book, f"h{i}")
    tree = parents(book)
    children: dict[str, int] = {}
    for parent in tree.values():
        children[parent] = children.get(parent, 0) + 1
    assert children[""] == 1  # the source's link carries the version once
    assert max(children.values()) == TREE_DEGREE
    assert sum(1 for n in children.values() if n >= 2) >= 2  # a tree, not a chain

    def depth(u: str) -> int:
        return 0 if not u else 1 + depth(tree[u])

    assert max(depth(u) for u in tree) < 16 - 4  # shallower than a chain of 16


def test_a_joiner_keeps_its_upstream_until_it_excludes_it() -> None:
    book = HolderBook()
    join(book, "h1")
    assert join(book, "h2") == "h1"
    assert join(book, "h2", rate=5e7) == "h1"  # a rate report changes nothing
    assert join(book, "h2", ["h1"]) == ""  # h1 left the book: the source
    assert "h1" not in book.holders("m", 1)
    assert join(book, "h3") == "h2"


def test_a_holder_is_never_given_one_of_its_descendants() -> None:
    book = HolderBook()
    for i in range(1, 6):
        join(book, f"h{i}")
    tree = parents(book)
    below = {u for u in tree if tree[u] == "h1"}
    # h1's own upstream fails: it is given another, never one that reads from it
    new = join(book, "h1", [tree["h1"]] if tree["h1"] else ["h0"])
    seen, u = set(), new
    while u:
        assert u != "h1" and u not in seen
        seen.add(u)
        u = book.parent("m", 1, u) or ""
    assert new not in below


def test_the_answer_carries_every_holders_rate_and_upstream() -> None:
    book = HolderBook()
    book.join(HolderJoin("m", 1, "h1", "n", [], 1e8))
    a = book.join(HolderJoin("m", 1, "h2", "n", [], 2e7))
    assert a.rates == {"h1": 1e8, "h2": 2e7}
    assert a.parents == {"h1": "", "h2": "h1"}
