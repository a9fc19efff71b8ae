"""A route's parameters, declared once as its ``args`` Struct (:mod:`refitd.wire.args`),
read from text the one way the module states, whichever route declares them."""

from __future__ import annotations

from typing import Any

import pytest
from msgspec import inspect as mi
from multidict import MultiDict

from refitd.errors import ProtocolError
from refitd.wire import routes as api
from refitd.wire.args import (
    MAX_WAIT_S,
    DrainArgs,
    GcArgs,
    LeaseCheckArgs,
    MirrorStateArgs,
    PeerRegionsArgs,
    RenewArgs,
    VersionAt,
    WaitReadyArgs,
    decode_args,
    fields_of,
    spell,
)
from refitd.wire.routes import Route


def _is_float(t: mi.Type) -> bool:
    return isinstance(t.type if isinstance(t, mi.Metadata) else t, mi.FloatType)


FLOATS = sorted(
    {
        (r.args, f.name)
        for r in api.ROUTES
        if r.args is not None
        for f in fields_of(r.args)
        if _is_float(f.type)
    },
    key=lambda c: (c[0].__name__, c[1]),
)


def test_the_route_table_declares_float_parameters() -> None:
    assert len(FLOATS) >= 7, FLOATS  # timeouts, waits, the lease ttl


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
@pytest.mark.parametrize(("cls", "name"), FLOATS, ids=lambda c: getattr(c, "__name__", c))
def test_every_float_parameter_refuses_nan_and_the_infinities(
    cls: type[Any], name: str, text: str
) -> None:
    """A NaN deadline never passes: a wait on one would never end."""
    path = {"model": "m", "version": "1", "lease_id": "l", "pull_id": "p"}
    with pytest.raises(ProtocolError, match=f"parameter {name} must be a finite number"):
        decode_args(cls, path, {"version": "1", name: text})


@pytest.mark.parametrize(
    ("text", "value"), [("0", False), ("1", True), ("false", False), ("true", True)]
)
def test_a_flag_reads_its_four_spellings(text: str, value: bool) -> None:
    assert decode_args(GcArgs, {}, {"dry_run": text}).dry_run is value


@pytest.mark.parametrize("text", ["yes", "no", "True", "FALSE", "", "2", " 1"])
def test_a_flag_spelled_otherwise_is_refused_not_read_as_no(text: str) -> None:
    with pytest.raises(ProtocolError, match="dry_run must be one of 0, 1, false, true; got"):
        decode_args(GcArgs, {}, {"dry_run": text})


@pytest.mark.parametrize("text", ["1e3", "3.0", "0x10", " 3", "+3", "1_000", "", "٣"])
def test_an_integer_is_an_optional_minus_and_decimal_digits_alone(text: str) -> None:
    with pytest.raises(ProtocolError, match="query parameter after must be an integer"):
        decode_args(MirrorStateArgs, {"model": "m", "version": "1"}, {"after": text})
    assert decode_args(MirrorStateArgs, {"model": "m", "version": "1"}, {"after": "-1"}).after == -1


def test_a_path_version_is_a_number_or_latest_and_never_negative() -> None:
    assert decode_args(VersionAt, {"model": "m", "version": "latest"}, {}).number is None
    assert decode_args(VersionAt, {"model": "m", "version": "7"}, {}).number == 7
    for text in ("-1", "newest", str(2**63)):
        with pytest.raises(ProtocolError, match=r"path parameter version must be an integer >= 0"):
            decode_args(VersionAt, {"model": "m", "version": text}, {})


@pytest.mark.parametrize(
    ("text", "ok"), [("3600", True), ("0.001", True), ("0", False), ("3600.5", False)]
)
def test_a_bound_holds_as_declared(text: str, ok: bool) -> None:
    """The renewal's ttl is ``> 0`` and ``<= 3600``, as a lease request's."""
    if ok:
        assert decode_args(RenewArgs, {"lease_id": "l"}, {"ttl": text}).ttl == float(text)
    else:
        with pytest.raises(ProtocolError, match=r"ttl must be a finite number > 0 and <= 3600"):
            decode_args(RenewArgs, {"lease_id": "l"}, {"ttl": text})


def test_an_absent_parameter_takes_its_default_and_a_required_one_is_named() -> None:
    assert decode_args(DrainArgs, {"model": "m", "version": "1"}, {}) == DrainArgs(
        model="m", version=1, timeout=60.0, retire=False
    )
    with pytest.raises(ProtocolError, match="query parameter version is required"):
        decode_args(LeaseCheckArgs, {"lease_id": "l"}, {"model": "m"})
    peer = decode_args(PeerRegionsArgs, {}, {})
    assert (peer.region_ids(), peer.lease) == (None, None)  # absent, not empty
    assert decode_args(PeerRegionsArgs, {}, {"ids": ""}).region_ids() == []


def test_a_long_polls_wait_is_cut_to_the_most_a_daemon_waits_and_a_drain_is_not() -> None:
    path = {"model": "m", "version": "1"}
    assert decode_args(WaitReadyArgs, path, {"timeout": "600"}).timeout == MAX_WAIT_S
    assert decode_args(WaitReadyArgs, path, {"timeout": "0.5"}).timeout == 0.5
    assert decode_args(DrainArgs, path, {"timeout": "600"}).timeout == 600.0


def test_an_undeclared_parameter_is_ignored_and_of_a_repeated_one_the_first_counts() -> None:
    query = MultiDict([("dry_run", "1"), ("dry_run", "0"), ("dryrun", "x")])
    assert decode_args(GcArgs, {}, query).dry_run is True


@pytest.mark.parametrize(
    ("value", "field", "cls"),
    [
        (True, "retire", DrainArgs),
        (False, "retire", DrainArgs),
        (0.2, "timeout", DrainArgs),
        (1e-07, "timeout", DrainArgs),
        (1234.5, "timeout", DrainArgs),
        (2**63 - 1, "after", MirrorStateArgs),
        (-1, "after", MirrorStateArgs),
    ],
)
def test_what_the_client_spells_the_edge_reads_back(value: Any, field: str, cls: type[Any]) -> None:
    decoded = decode_args(cls, {"model": "m", "version": "1"}, {field: spell(value)})
    assert getattr(decoded, field) == value


def test_a_route_whose_args_leave_a_path_parameter_undeclared_is_refused() -> None:
    with pytest.raises(TypeError, match=r"its args declare no \['pool'\]"):
        Route("GET", "/v1/things/{pool}", type(None), "A thing", args=GcArgs)
    with pytest.raises(TypeError, match=r"its args declare no \['pool'\]"):
        Route("GET", "/v1/things/{pool}", type(None), "A thing")


def test_the_route_tables_query_names_are_its_args_fields_the_path_does_not_name() -> None:
    assert api.DRAIN.params == ("model", "version")
    assert api.DRAIN.query == ("timeout", "retire")
    assert api.GET_PULL.query == ()
