"""The registry's in-memory view (pure): what it trusts and what it calls complete."""

from __future__ import annotations

import msgspec

from refitd.cluster.directory import Directory, daemon_key, source_key
from refitd.wire import DaemonRecord, SourceRecord, VersionState

SECRET = b"k" * 32
P = "/refitd"


def daemon(node: str, incarnation: int = 1, secret: bytes = SECRET) -> tuple[str, bytes]:
    rec = DaemonRecord(node, f"http://{node}:7450", incarnation, "auto").signed(secret)
    return daemon_key(P, node), msgspec.msgpack.encode(rec)


def source(
    node: str, parts: list[int], version: int = 1, incarnation: int = 1
) -> tuple[str, bytes]:
    rec = SourceRecord(
        node, f"http://{node}:7450", incarnation, "m", version, VersionState.PENDING, parts, 4
    ).signed(SECRET)
    return source_key(P, "m", version, node), msgspec.msgpack.encode(rec)


def test_a_version_is_complete_only_when_registered_holders_cover_every_part() -> None:
    d = Directory(P, SECRET)
    d.replace([daemon("a"), daemon("b"), source("a", [0, 1]), source("b", [2])])
    assert not d.version("m", 1).complete
    assert d.latest("m") is None
    d.put(*source("b", [2, 3]))
    found = d.version("m", 1)
    assert found.complete and [h.node_id for h in found.holders] == ["a", "b"]
    # b's registration goes: its parts go with it.
    change = d.delete(daemon_key(P, "b"))
    assert [r.node_id for r in change.gone] == ["b"]
    assert not d.version("m", 1).complete


def test_records_of_another_incarnation_or_secret_or_key_are_not_trusted() -> None:
    d = Directory(P, SECRET)
    d.replace([daemon("a", incarnation=2), source("a", [0, 1, 2, 3], incarnation=1)])
    # The source record is of the daemon's previous incarnation: its regions are gone.
    assert d.holders("m", 1) == []
    d.put(*daemon("evil", secret=b"x" * 32))
    assert d.trusted("http://evil:7450") is None and d.refused == 1
    _, value = daemon("c")
    d.put(daemon_key(P, "d"), value)  # c's record stored under d's key
    assert d.trusted("http://c:7450") is None and d.refused == 2
    assert d.trusted("http://a:7450/") is not None


def test_a_daemon_registering_again_as_a_new_incarnation_is_reported_gone() -> None:
    d = Directory(P, SECRET)
    d.put(*daemon("a", incarnation=1))
    change = d.put(*daemon("a", incarnation=2))
    assert [r.incarnation for r in change.gone] == [1]
    assert d.put(*daemon("a", incarnation=2)).gone == ()
