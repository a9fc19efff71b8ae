"""The source's holder book deals each chunk of a version to a seeder: pure, no daemon."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refitd.daemon.mirror.book import DEAL_GRACE_S, MAX_HOLDERS, HolderBook
from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.swarm import holders_of
from refitd.wire.mirrors import FROM_SOURCE, HolderAssign, HolderJoin

CHUNKS = 64


def join(
    book: HolderBook,
    url: str,
    version: int = 1,
    exclude: list[str] | None = None,
    rate: float = 0.0,
    done: bool = False,
    have: np.ndarray | None = None,
    now: float = 0.0,
    shun: list[str] | None = None,
) -> HolderAssign:
    bits = b"" if have is None else np.packbits(have).tobytes()
    j = HolderJoin("m", version, url, "n", exclude or [], rate, done, bits, shun or [])
    return book.join(j, CHUNKS, now)


def dealt_to(a: HolderAssign) -> list[str]:
    """Per chunk, the seeder a deal names ("" the source)."""
    return ["" if d == FROM_SOURCE else a.seeders[d] for d in np.frombuffer(a.deal, dtype=np.uint8)]


async def test_the_first_version_is_dealt_to_the_holders_that_join_within_the_grace() -> None:
    book = HolderBook()
    assert join(book, "h1").deal == b"" and join(book, "h2").deal == b""
    a = await book.wait_dealt("m", 1, 0.0)
    assert a.seeders == ["h1", "h2"] and set(dealt_to(a)) == {"h1", "h2"}


def first(book: HolderBook, *urls: str, version: int = 1) -> HolderAssign:
    """``urls`` join ``version`` (its first), and its deal once made."""
    for u in urls:
        join(book, u, version=version)
    return asyncio.run(book.wait_dealt("m", version, 0.0))


def test_the_next_version_is_dealt_over_the_holders_of_the_one_before_once_they_joined() -> None:
    book = HolderBook()
    first(book, "h1", "h2", "h3", "h4")
    for h in ("h1", "h2", "h3"):
        assert join(book, h, version=2).deal == b""  # h4 has not joined yet: not dealt
    a = join(book, "h4", version=2)
    per = {h: dealt_to(a).count(h) for h in ("h1", "h2", "h3", "h4")}
    assert per == {h: CHUNKS // 4 for h in per}  # an even share each
    # consecutive chunks go to different seeders: every uplink is busy at once
    assert all(x != y for x, y in zip(dealt_to(a), dealt_to(a)[1:], strict=False))


def test_a_holder_that_joins_after_the_deal_reads_only_and_the_deal_never_moves() -> None:
    book = HolderBook()
    a = first(book, "h1")
    b = join(book, "h2")
    assert b.deal == a.deal and b.seeders == ["h1"] and b.holders == ["h1", "h2"]


def test_the_deal_is_made_after_the_grace_when_a_holder_of_the_version_before_never_joins() -> None:
    book = HolderBook()
    first(book, "h1", "gone")
    assert join(book, "h1", version=2, now=10.0).deal == b""
    assert book.due("m", 2, 10.0) == pytest.approx(DEAL_GRACE_S)
    a = asyncio.run(book.wait_dealt("m", 2, 10.0))
    assert a.seeders == ["h1"] and set(dealt_to(a)) == {"h1"}


def test_a_host_that_filled_the_version_before_slowly_is_dealt_nothing() -> None:
    book = HolderBook()
    first(book, "h1", "h2", "slow")
    for h, rate in (("h1", 1e8), ("h2", 1e8), ("slow", 2e7)):
        join(book, h, rate=rate, done=True)
    join(book, "h1", version=2)
    a = join(book, "h2", version=2)  # every holder expected (the slow one is not) joined
    assert a.deal and a.seeders == ["h1", "h2"]
    assert "slow" not in dealt_to(a)


def test_a_failed_seeders_chunks_go_to_a_holder_that_holds_them_else_to_the_others() -> None:
    book = HolderBook()
    first(book, "h1", "h2", "h3")
    for h in ("h1", "h2", "h3"):
        join(book, h, version=2)
    before = dealt_to(join(book, "h1", version=2))
    have = np.zeros(CHUNKS, dtype=bool)
    theirs = [i for i, s in enumerate(before) if s == "h3"]
    have[theirs[:5]] = True  # h2 read five of h3's chunks from it already
    join(book, "h2", version=2, have=have)
    a = join(book, "h1", version=2, exclude=["h3"])
    after = dealt_to(a)
    assert "h3" not in a.holders and "h3" not in after
    assert [after[i] for i in theirs[:5]] == ["h2"] * 5  # the holder that has them
    rest = [after[i] for i in theirs[5:]]
    assert set(rest) == {"h1", "h2"} and abs(rest.count("h1") - rest.count("h2")) <= 1
    # chunks dealt to the others do not move
    assert all(after[i] == s for i, s in enumerate(before) if s != "h3")


def test_with_no_seeder_left_a_chunk_is_read_from_the_source_by_whoever_lacks_it() -> None:
    book = HolderBook()
    first(book, "h1")
    a = join(book, "h2", exclude=["h1"])  # h2 read only; h1 failed
    assert set(dealt_to(a)) == {"h2"}  # h2 brings them now, from the source


def test_the_book_keeps_a_bounded_number_of_holders_and_versions() -> None:
    book = HolderBook()
    first(book, *(f"h{i}" for i in range(MAX_HOLDERS + 10)))
    assert len(book.holders("m", 1)) == MAX_HOLDERS
    for v in range(2, 10):
        join(book, "h0", version=v, now=100.0 * v)
    assert book.holders("m", 1) == [] and book.holders("m", 8) == ["h0"]


@settings(max_examples=200, deadline=None)
@given(
    seeders=st.lists(st.sampled_from(["me", "a", "b", "c", ""]), min_size=1, max_size=5),
    listed=st.sets(st.sampled_from(["me", "a", "b", "c"])),
    excluded=st.sets(st.sampled_from(["a", "b", "c"])),
    deal=st.lists(st.integers(0, 255), min_size=8, max_size=8),
)
def test_a_mirror_reads_each_chunk_from_its_seeder_only_when_that_holder_can_serve_it(
    seeders: list[str], listed: set[str], excluded: set[str], deal: list[int]
) -> None:
    m = Mirror("src", "m", 1, chunks=np.zeros((8, 3), dtype=np.int64))
    a = HolderAssign(seeders, bytes(deal), sorted(listed))
    got = holders_of(m, a, "me", excluded)
    for d, h in zip(deal, got, strict=True):
        s = seeders[d] if d < len(seeders) else ""
        ok = s and s != "me" and s in listed and s not in excluded
        assert h == (s if ok else "")


def test_a_deal_that_cuts_the_version_otherwise_is_not_followed() -> None:
    m = Mirror("src", "m", 1, chunks=np.zeros((8, 3), dtype=np.int64))
    assert holders_of(m, HolderAssign(["a"], bytes(4), ["a"]), "me", set()) == [""] * 8


def test_waiting_for_a_deal_ends_when_the_last_expected_holder_joins() -> None:
    async def run() -> HolderAssign:
        book = HolderBook()
        join(book, "h1")
        join(book, "h2")
        await book.wait_dealt("m", 1, 0.0)
        join(book, "h1", version=2)
        waiting = asyncio.ensure_future(book.wait_dealt("m", 2, 0.0))
        await asyncio.sleep(0)
        join(book, "h2", version=2)
        return await asyncio.wait_for(waiting, DEAL_GRACE_S * 100)

    assert asyncio.run(run()).seeders == ["h1", "h2"]


def test_a_holder_found_slow_in_one_version_is_dealt_nothing_of_the_next() -> None:
    book = HolderBook()
    first(book, "h1", "h2", "h3", "h4")
    join(book, "h1", exclude=["h3"], shun=["h3"])  # h1 found h3 slow (or wrong)
    join(book, "h2", exclude=["h4"])  # h2 found h4 failed, or late: not shunned
    join(book, "h3")  # h3 rejoins the version it was left in: a reader now
    join(book, "h4")
    for h in ("h1", "h2", "h4"):
        join(book, h, version=2)
    a = join(book, "h3", version=2)
    assert a.seeders == ["h1", "h2", "h4"] and "h3" not in dealt_to(a) and "h3" in a.holders
    for h in ("h1", "h2", "h3", "h4"):
        join(book, h, version=3)
    assert "h3" in dealt_to(asyncio.run(book.wait_dealt("m", 3, 0.0)))  # back the next
