"""The parameters of each route, declared once: a frozen Struct per route (or per kind
of route) whose fields are its path and query parameters, each with its type, its
default and its bounds.

A route of :mod:`refitd.wire.routes` names its Struct as ``args``. The daemon's edge
decodes the request's path and query into it (:func:`decode_args`) before the handler
runs, so a handler gets one typed argument and reads no raw parameter; the OpenAPI
document lists each field as a parameter with its schema and default; the client
checks the query names it sends against the fields.

A field named in the route's path template is a path parameter (always present);
every other field is a query parameter, optional when it has a default. Each is read
from its text as its type says, then checked against its bounds:

- ``int``: an optional minus and decimal digits (``1e3``, ``3.0``, ``0x10`` are refused);
- ``float``: a finite decimal number. NaN and the infinities are refused whatever the
  bounds: a NaN deadline never compares as passed, so a wait on one would never end
  and a lease renewed with one would never expire;
- ``bool``: a flag, exactly ``0``, ``1``, ``false`` or ``true``: anything else is
  refused (400), so a typo never reads as "no";
- ``str``: as sent;
- a union tries its members in order (``int | Literal["latest"]``: a version number
  or ``latest``); ``None`` is never spelled, only defaulted to.

A value off its type or bounds, or a required parameter missing, is refused with a
:class:`~refitd.errors.ProtocolError` (400) naming the parameter and what it must be.
A query parameter no field declares is ignored. Of a parameter given twice, the first
counts.

A long poll's wait (:data:`Wait`) is cut to :data:`MAX_WAIT_S` once decoded: a client
asking for longer is answered then, and asks again.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
from msgspec import inspect as mi

from refitd.errors import ProtocolError
from refitd.wire.fields import INT64_MAX, Int64, NonNeg
from refitd.wire.leases import MAX_LEASE_TTL_S

__all__ = [
    "FLAG",
    "FLAG_SPELLINGS",
    "MAX_WAIT_S",
    "Args",
    "ClusterNextArgs",
    "DeltaInfoArgs",
    "DrainArgs",
    "GcArgs",
    "LeaseAt",
    "LeaseCheckArgs",
    "MirrorReadArgs",
    "MirrorStateArgs",
    "ModelAt",
    "PeerDropArgs",
    "PeerRegionsArgs",
    "PoolAt",
    "PullAt",
    "PullWaitArgs",
    "RegionAt",
    "RenewArgs",
    "Seconds",
    "VersionAt",
    "Wait",
    "WaitReadyArgs",
    "decode_args",
    "describe",
    "spell",
]

MAX_WAIT_S = 60.0
"""The longest a long poll holds its request, s (a longer :data:`Wait` is cut to it): a
client waiting longer asks again."""

#: The spellings of a flag (a ``bool`` parameter), and what each reads as.
FLAG_SPELLINGS: dict[str, bool] = {"0": False, "1": True, "false": False, "true": True}
#: How the client spells a flag.
FLAG: dict[bool, str] = {False: "0", True: "1"}

#: A duration in seconds: finite (as every float parameter), ``>= 0``.
Seconds = Annotated[float, msgspec.Meta(ge=0, description="seconds")]
#: A long poll's wait in seconds: finite, ``>= 0``, cut to :data:`MAX_WAIT_S`.
Wait = Annotated[
    float, msgspec.Meta(ge=0, description=f"seconds; a longer wait is cut to {MAX_WAIT_S:g}")
]
#: A lease's time to live in seconds, as a lease request's ``ttl_s``.
Ttl = Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_TTL_S, description="seconds")]

A = TypeVar("A", bound="Args")


class Args(msgspec.Struct, frozen=True, kw_only=True):
    """The base of every route's parameters. ``waits`` names the fields that are a
    long poll's wait, cut to :data:`MAX_WAIT_S` once decoded."""

    waits: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self.waits:
            msgspec.structs.force_setattr(self, name, min(getattr(self, name), MAX_WAIT_S))


# ---------------------------------------------------------------- path parameters alone


class RegionAt(Args, frozen=True, kw_only=True):
    region_id: NonNeg


class ModelAt(Args, frozen=True, kw_only=True):
    model: str


class VersionAt(ModelAt, frozen=True, kw_only=True):
    """A version of a model, or its newest (``latest``: READY, or complete in the
    cluster registry)."""

    version: NonNeg | Literal["latest"]

    @property
    def number(self) -> int | None:
        """The version's number (None: ``latest``)."""
        return None if self.version == "latest" else self.version


class LeaseAt(Args, frozen=True, kw_only=True):
    lease_id: str


class PullAt(Args, frozen=True, kw_only=True):
    pull_id: str


class PoolAt(Args, frozen=True, kw_only=True):
    pool: str


# ---------------------------------------------------------------- with query parameters


class GcArgs(Args, frozen=True, kw_only=True):
    #: list what would be freed, free nothing
    dry_run: bool = False


class WaitReadyArgs(VersionAt, frozen=True, kw_only=True):
    waits = ("timeout",)
    timeout: Wait = 30.0


class DrainArgs(VersionAt, frozen=True, kw_only=True):
    """A drain waits as long as it asks (it is counted as a long poll, not cut)."""

    timeout: Seconds = 60.0
    #: refuse new leases first
    retire: bool = False


class LeaseCheckArgs(LeaseAt, frozen=True, kw_only=True):
    model: str = ""
    version: NonNeg


class RenewArgs(LeaseAt, frozen=True, kw_only=True):
    ttl: Ttl = 30.0


class PullWaitArgs(PullAt, frozen=True, kw_only=True):
    waits = ("timeout",)
    timeout: Wait = 30.0


class DeltaInfoArgs(ModelAt, frozen=True, kw_only=True):
    """``wait``: how long to wait for a comparison still running (0: answer now)."""

    waits = ("wait",)
    version: NonNeg
    wait: Wait = 0.0


class PeerRegionsArgs(Args, frozen=True, kw_only=True):
    """Which regions' records (``ids``, comma-separated; absent: every one), and, for
    a pull, the lease (with its model and version) that scopes them."""

    ids: str | None = None
    lease: str | None = None
    model: str = ""
    version: NonNeg | None = None

    def region_ids(self) -> list[int] | None:
        """``ids`` as integers (None: absent, every region)."""
        if self.ids is None:
            return None
        ids = [x for x in self.ids.split(",") if x]
        if not all(_INT.fullmatch(x) for x in ids):  # the one spelling of an integer
            raise ProtocolError(f"ids must be comma-separated integers, got {self.ids!r}")
        return [int(x) for x in ids]

    def leased_version(self) -> int:
        """The version a lease's records are asked for (refused when not given)."""
        if self.version is None:
            raise ProtocolError("query parameter version is required with lease")
        return self.version


class PeerDropArgs(RegionAt, frozen=True, kw_only=True):
    lease: str = ""


class ClusterNextArgs(ModelAt, frozen=True, kw_only=True):
    """Wait for a complete version newer than ``after`` (-1: any)."""

    waits = ("timeout",)
    after: Int64 = -1
    timeout: Wait = 30.0


class MirrorReadArgs(ModelAt, frozen=True, kw_only=True):
    """A mirrored version, read under a lease on it."""

    version: NonNeg
    lease: str = ""


class MirrorStateArgs(MirrorReadArgs, frozen=True, kw_only=True):
    """``after``: wait until more than this many chunks are complete (-1: answer now)."""

    waits = ("timeout",)
    after: Int64 = -1
    timeout: Wait = 0.0


# ---------------------------------------------------------------- spelling and decoding


def spell(value: str | int | float | bool) -> str:
    """A parameter's text, as the client sends it: a flag as ``0``/``1``, a number as
    Python writes it (which :func:`decode_args` reads back)."""
    return FLAG[value] if isinstance(value, bool) else str(value)


#: An integer as the client writes one: ASCII digits, an optional minus, at most 20
#: digits (past int64 either way, so its bounds refuse it; ``int`` refuses over 4300).
_INT = re.compile(r"-?[0-9]{1,20}")
#: A finite decimal number: ASCII digits, no blanks, underscores or other digits.
_FLOAT = re.compile(r"-?([0-9]{1,400}(\.[0-9]{0,400})?|\.[0-9]{1,400})([eE][-+]?[0-9]{1,4})?")
#: every wire integer is an int64 (:mod:`refitd.wire.fields`): its ends go unsaid
_INT64_ENDS = (-(2**63), INT64_MAX)


class _Refused(ValueError):
    pass


def _read(t: mi.Type, text: str) -> Any:
    """``text`` as a value of ``t`` (bounds are msgspec's to check), or :class:`_Refused`."""
    if isinstance(t, mi.Metadata):
        return _read(t.type, text)
    if isinstance(t, mi.IntType):
        if not _INT.fullmatch(text):
            raise _Refused
        return int(text)
    if isinstance(t, mi.FloatType):
        if not _FLOAT.fullmatch(text):
            raise _Refused
        value = float(text)
        if not math.isfinite(value):
            raise _Refused
        return value
    if isinstance(t, mi.BoolType):
        if text not in FLAG_SPELLINGS:
            raise _Refused
        return FLAG_SPELLINGS[text]
    if isinstance(t, mi.StrType):
        return text
    if isinstance(t, mi.LiteralType):
        if text not in t.values:
            raise _Refused
        return text
    if isinstance(t, mi.UnionType):
        for member in t.types:
            if isinstance(member, mi.NoneType):
                continue
            try:
                return _read(member, text)
            except _Refused:
                continue
        raise _Refused
    raise TypeError(f"a route parameter of type {t!r} is not read from text")


def _bounds(t: mi.IntType | mi.FloatType | mi.StrType) -> str:
    if isinstance(t, mi.StrType):
        sizes = [f"at least {t.min_length}" if t.min_length else ""]
        sizes.append(f"at most {t.max_length}" if t.max_length is not None else "")
        length = " and ".join(p for p in sizes if p)
        return f" of {length} characters" if length else ""
    said = [
        f"{op} {bound:g}" if isinstance(bound, float) else f"{op} {bound}"
        for op, bound in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le))
        if bound is not None and bound not in _INT64_ENDS
    ]
    return (" " + " and ".join(said)) if said else ""


def describe(t: mi.Type) -> str:
    """What a parameter of type ``t`` must be, in words (for a refusal)."""
    if isinstance(t, mi.Metadata):
        return describe(t.type)
    if isinstance(t, mi.IntType):
        int64 = t.ge in _INT64_ENDS or t.le in _INT64_ENDS
        return "an integer" + _bounds(t) + (" (int64)" if int64 else "")
    if isinstance(t, mi.FloatType):
        return "a finite number" + _bounds(t)
    if isinstance(t, mi.BoolType):
        return "one of " + ", ".join(FLAG_SPELLINGS)
    if isinstance(t, mi.StrType):
        return "text" + _bounds(t)
    if isinstance(t, mi.LiteralType):
        return " or ".join(repr(v) for v in t.values)
    if isinstance(t, mi.UnionType):
        return " or ".join(describe(m) for m in t.types if not isinstance(m, mi.NoneType))
    return repr(t)


@functools.cache
def fields_of(cls: type[Args]) -> tuple[mi.Field, ...]:
    """The fields of ``cls``, as :mod:`msgspec.inspect` describes them (cached)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


def decode_args(
    cls: type[A], path: Mapping[str, str], query: Mapping[str, str], what: str = ""
) -> A:
    """``cls`` decoded from a request's ``path`` parameters and ``query`` (read as the
    module says); a refusal (:class:`ProtocolError`) names the parameter, where it was
    (``what``: the request, for the message) and what it must be."""
    values: dict[str, Any] = {}
    prefix = f"{what}: " if what else ""
    for f in fields_of(cls):
        where = "path" if f.name in path else "query"
        text = path.get(f.name, query.get(f.name))
        if text is None:
            if f.required:
                raise ProtocolError(
                    f"{prefix}query parameter {f.name} is required: {describe(f.type)}"
                )
            continue
        try:
            values[f.name] = _read(f.type, text)
        except _Refused:
            raise ProtocolError(
                f"{prefix}{where} parameter {f.name} must be {describe(f.type)}; got {text!r}"
            ) from None
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as exc:  # read, but off its bounds
        name = str(exc).rpartition("$.")[2].rstrip("`")
        field = next((f for f in fields_of(cls) if f.name == name), None)
        if field is None:
            raise ProtocolError(f"{prefix}parameters refused: {exc}") from None
        where = "path" if name in path else "query"
        raise ProtocolError(
            f"{prefix}{where} parameter {name} must be {describe(field.type)}; "
            f"got {(path.get(name) or query.get(name))!r}"
        ) from None
