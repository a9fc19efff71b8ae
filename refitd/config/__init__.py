"""The daemon's configuration: one schema, declared once, loaded strictly.

A :class:`Config` is built from four layers, each overriding the one before it:

    1. the defaults declared below (and documented in ``config/refitd.toml``);
    2. the TOML file (``--config FILE``, else ``$REFITD_CONFIG``, else none);
    3. environment variables ``REFITD_<SECTION>_<KEY>``, e.g. ``REFITD_SERVER_PORT=7071``;
    4. command-line overrides, ``--set section.key=value`` (and the few dedicated flags
       such as ``refitd serve --port``), which win over everything.

Unknown sections and keys are refused, in the file, in ``REFITD_<SECTION>_...``
variables and in ``--set``: a typo never silently falls back to a default. Every
refusal is a :class:`~refitd.errors.ConfigError` whose message names the key
(``server.port``), where the value came from, and the form that was expected.

Units are in the key names: ``*_bytes`` are bytes, ``*_s`` are seconds.

The daemon calls ``load_config(path, os.environ, overrides)`` once at start-up and
passes the frozen :class:`Config` around; nothing re-reads the file.

Modules: this one (the schema and its loading) and ``values`` (the values the
config names, parsed one way for every layer: peer URLs, model tables, token files).
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from refitd.config.values import ANY_PORT, normalize_peer, parse_model_table, read_token
from refitd.errors import ConfigError, ProtocolError

__all__ = [
    "ANY_PORT",
    "ENV_CONFIG_PATH",
    "ENV_PREFIX",
    "Config",
    "DataPlaneConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "MirrorsConfig",
    "PeersConfig",
    "PullsConfig",
    "RegistryConfig",
    "ServerConfig",
    "env_name",
    "is_loopback_host",
    "load_config",
    "normalize_peer",
    "parse_model_table",
    "parse_overrides",
    "read_token",
    "resolve_group",
]

ENV_PREFIX = "REFITD_"
#: Names the config file when no path is passed to :func:`load_config`.
ENV_CONFIG_PATH = "REFITD_CONFIG"

_MiB = 1 << 20

Port = Annotated[int, msgspec.Meta(ge=0, le=65535, description="a TCP port, 0..65535")]
PositiveBytes = Annotated[int, msgspec.Meta(ge=1, description="a byte count (integer >= 1)")]
Bytes = Annotated[int, msgspec.Meta(ge=0, description="a byte count (integer >= 0)")]
GraceSeconds = Annotated[float, msgspec.Meta(ge=0, description="seconds (number >= 0)")]
Scheme = Annotated[
    str,
    msgspec.Meta(
        pattern="^[a-z][a-z0-9_-]*$",
        description="a data-plane mode: 'auto', 'shm' or a transport scheme registered in "
        "transports, e.g. 'ucx'",
    ),
]
Uid = Annotated[int, msgspec.Meta(ge=0, description="a numeric user id")]
GroupName = Annotated[
    str,
    msgspec.Meta(
        pattern="^[A-Za-z0-9_][A-Za-z0-9_.-]*$", description="a group name or numeric gid"
    ),
]


# Every section is frozen, keyword-only and refuses unknown keys. (Spelled out on each
# class rather than inherited: mypy reads inherited Struct options as non-frozen.)
_Section = msgspec.Struct


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The HTTP control plane: where it listens and who may talk to it."""

    #: Address of the TCP listener. Anything but loopback needs ``token_file``.
    host: str = "127.0.0.1"
    #: TCP port; 0 asks the kernel for a free one (tests).
    port: Port = 7450
    #: Also listen on this Unix socket path; peers are checked by uid (SO_PEERCRED).
    unix_socket: str | None = None
    #: Uids allowed on the Unix socket besides root and the daemon's own uid.
    allowed_uids: tuple[Uid, ...] = ()
    #: File of bearer tokens, one per line (``NAME TOKEN`` or ``TOKEN``); mode 0600.
    token_file: str | None = None
    #: Bearer token this daemon presents to peer daemons it pulls from (a file whose
    #: first token is used; one of the peers' ``token_file`` lines). Unset: none.
    peer_token_file: str | None = None
    #: File holding the deployment's peer-record secret (>= 16 bytes), the same on
    #: every daemon that reads from another; unset: a random per-process secret.
    secret_file: str | None = None
    #: Name of this daemon in peer records and logs; empty: ``<hostname>-<pid>``.
    node_id: str = ""
    #: Requests with a larger body are refused with 413 before they are read.
    max_request_bytes: PositiveBytes = 64 * _MiB
    #: Group (name or gid) that may map the daemon's shared-memory regions: segments
    #: are then created 0660 with this group instead of 0600, and segments of this
    #: group from other users may be attached. Unset: only the daemon's own user.
    shm_group: GroupName | None = None


class DataPlaneConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How bytes move between daemons."""

    #: ``auto`` (a peer proven on this host is read through its shared-memory
    #: segments; any other through UCX where both hosts have RDMA, else through
    #: ``tcp``, refitd's own lanes of plain TCP), ``shm`` (same-host reads only) or a
    #: scheme registered in ``transports`` (``tcp``, ``ucx``: every other-host peer
    #: through it); the daemon refuses an unknown scheme at start.
    transport: Scheme = "auto"
    #: Deadline of one batch of UCX reads from a peer daemon: a peer that hangs fails
    #: the pulls reading from it after this long, and only those (its reading process
    #: is stopped; pulls from other peers go on).
    pull_timeout_s: Annotated[float, msgspec.Meta(gt=0, description="seconds (number > 0)")] = 120.0
    #: TCP connections ("lanes") per peer of the ``tcp`` data plane, each serviced on
    #: its own: a large read is spread across them, so one stalled lane holds up no other.
    lanes: Annotated[int, msgspec.Meta(ge=1, le=64, description="lanes (1..64)")] = 4
    #: Port of the ``tcp`` data server (on ``server.host``); 0: any free one (peers learn it).
    tcp_port: Port = 0
    max_pinned_bytes: Bytes | None = None  # host bytes locked for GPU copies (docs/gpu.md)


class MirrorsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Host mirrors and relay (see :mod:`refitd.daemon.mirror.mirrors` and docs/fanout.md)."""

    #: When this daemon holds one copy of a remote version for its local engines (and
    #: relays it to other hosts): ``never`` (every pull reads its source), ``always``
    #: (the first pull of a remote version makes the mirror), ``shared`` (once two or
    #: more leases on one remote version pull through this daemon).
    policy: Literal["never", "always", "shared"] = "never"
    #: Bytes all mirrors may hold together (a version that does not fit is read from
    #: its source). Unset: half of the shared-memory filesystem's size.
    max_bytes: Bytes | None = None


class PeersConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which peer daemons this daemon may read from (and send its peer token to)."""

    #: Base URLs (``http(s)://host:port``) of trusted peer daemons. A pull whose
    #: ``source`` is not listed here is refused with 400 before any connection.
    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for url in self.allow:
            try:
                normalize_peer(url, pattern=True)
            except ProtocolError as exc:
                raise ConfigError(
                    f"peers.allow: {exc}; expected base URLs like 'http://10.0.0.7:7450'"
                ) from None


class ModelsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who owns each model and who may read it (see ``refitd.daemon.access.owners``)."""

    #: ``MODEL=PRINCIPAL`` entries: a model listed here belongs to those principals
    #: (token names, ``uid:<n>``) only: they publish, drain and retire its versions.
    #: A model not listed belongs to the principal that first publishes it.
    owners: tuple[str, ...] = ()
    #: ``MODEL=PRINCIPAL`` entries: a model listed here is leased and read only by
    #: those principals and its owners. A model not listed: by everyone.
    readers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_model_table(self.owners, "models.owners")
        parse_model_table(self.readers, "models.readers")


class PullsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Pull execution and shutdown."""

    #: On shutdown, how long in-flight pulls may finish before they are cancelled.
    shutdown_grace_s: GraceSeconds = 10.0
    #: Hold each model's newest version as the next one's delta base (docs/delta.md).
    deltas: bool = False
    #: Bytes of daemon memory the delta records of all models may hold together
    #: ((8 + 2 x unit) per changed unit); a version whose changes would go past it
    #: keeps none, and its engines refit in full. 0: a quarter of the host's memory.
    delta_max_bytes: Bytes = 0


Count = Annotated[int, msgspec.Meta(ge=1, description="a count (integer >= 1)")]


class LimitsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one principal, or one request, may cost the daemon. A principal is a
    token's name, or ``loopback`` for every unauthenticated client together."""

    #: Live leases one principal may hold at once (429 past it).
    max_leases_per_principal: Count = 4096
    #: Regions (created or attached) one principal may hold at once (429 past it).
    max_regions_per_principal: Count = 4096
    #: Bytes of shared memory the daemon makes for one principal at once: its
    #: regions, staging packed for its leases, its pools (429 past it; 0: no cap but
    #: /dev/shm itself). Attached segments are the client's own memory, not counted.
    max_region_bytes_per_principal: Bytes = 0
    #: Pulls of one principal queued or running at once (429 past it).
    max_pulls_per_principal: Count = 256
    #: Shards one published manifest may list, over all its tensors (400 past it).
    max_manifest_shards: Count = 1 << 20
    #: Bytes of daemon memory the manifests one principal published may hold at once
    #: (pending, READY, or retired while leased), charged per shard and tensor each
    #: lists (docs/trust.md; 429 past it, before the manifest is read).
    max_manifest_bytes_per_principal: PositiveBytes = 1 << 30
    #: Models one principal may publish into, for the daemon's life (429 past it).
    max_models_per_principal: Count = 1024
    #: Ended pulls of one principal whose results stay queryable (the oldest go
    #: first); each keeps its result, not its plan (at most 1,024 suspect ranges).
    max_ended_pulls_per_principal: Count = 256
    #: Bytes of daemon memory the bookkeeping of one principal's expert pools may
    #: keep (64 a layer's expert, 192 a slot, 384 a layer; besides their regions;
    #: 429 past it, before a region is made).
    max_pool_bookkeeping_bytes_per_principal: PositiveBytes = 256 * _MiB
    #: Bytes of daemon memory the plans of one principal's running pulls may keep
    #: (256 a run, counted at submit; 429 past it).
    max_plan_bytes_per_principal: PositiveBytes = 1 << 30
    #: Long polls one principal may hold open at once (429 past it): each holds a
    #: connection, a descriptor and a task of the daemon until answered.
    max_long_polls_per_principal: Count = 64
    #: Contiguous runs one request's plan may make (its descriptors, and each pack
    #: spec's runs counted from its shape and strides before any is listed): a pull,
    #: a peer pack or a delta pack past it is refused (413). A path that lists a
    #: plan run by run holds about 40 bytes a run while it serves the request.
    max_plan_runs: Count = 1 << 22
    #: A version still pending (slots missing) this many seconds after its first slot
    #: was published expires: it is forgotten and its memory freed.
    pending_ttl_s: Annotated[float, msgspec.Meta(gt=0, description="seconds (number > 0)")] = 3600.0


class LoggingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Log output (stderr; journald picks it up under systemd)."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    #: One JSON object per line instead of human-readable text.
    json: bool = False


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prometheus metrics."""

    #: Serve ``GET /metrics``.
    enabled: bool = True


class RegistryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where daemons find each other and each other's versions."""

    #: ``static``: this daemon alone (one host). ``etcd``: register in etcd, publish
    #: sources there, and trust (read from) exactly the daemons registered there.
    kind: Literal["static", "etcd"] = "static"
    #: etcd client endpoints, ``http://HOST:PORT`` (tried in turn).
    endpoints: tuple[str, ...] = ()
    #: Key prefix shared by the daemons of one deployment.
    prefix: Annotated[
        str, msgspec.Meta(pattern="^/[A-Za-z0-9_./-]*$", description="a key prefix like /refitd")
    ] = "/refitd"
    #: TTL of this daemon's etcd lease: a daemon that dies leaves the registry (and
    #: pulls reading from it fail) within this many seconds.
    lease_ttl_s: Annotated[float, msgspec.Meta(ge=2, description="seconds (number >= 2)")] = 10.0
    #: The URL other daemons reach this one at; empty: the listener's own URL.
    advertise_url: str = ""


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole configuration. Build it with :func:`load_config`."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    data_plane: DataPlaneConfig = msgspec.field(default_factory=DataPlaneConfig)
    pulls: PullsConfig = msgspec.field(default_factory=PullsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    peers: PeersConfig = msgspec.field(default_factory=PeersConfig)
    mirrors: MirrorsConfig = msgspec.field(default_factory=MirrorsConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    registry: RegistryConfig = msgspec.field(default_factory=RegistryConfig)

    def __post_init__(self) -> None:
        # Cross-field rules; each names the keys involved.
        if not is_loopback_host(self.server.host) and self.server.token_file is None:
            raise ConfigError(
                f"server.host is {self.server.host!r}, which is not loopback, and "
                "server.token_file is unset; expected a bearer-token file path "
                "(refusing to serve a non-loopback address unauthenticated)"
            )
        if self.registry.kind == "etcd" and not self.registry.endpoints:
            raise ConfigError(
                "registry.kind is 'etcd' and registry.endpoints is empty; expected a list of "
                'etcd client URLs such as ["http://10.0.0.5:2379"]'
            )


def resolve_group(group: str) -> int:
    """The gid of ``server.shm_group`` (a name or a number) on this host."""
    import grp

    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"server.shm_group {group!r} names no group on this host; expected an "
            "existing group name or a numeric gid (e.g. the 'refitd' group of the unit)"
        ) from None


def is_loopback_host(host: str) -> bool:
    """True when ``host`` names only this machine (``localhost``, 127/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _sections() -> dict[str, type[_Section]]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in msgspec.structs.fields(Config)}


def _field_types(section: type[_Section]) -> dict[str, Any]:
    hints = typing.get_type_hints(section, include_extras=True)
    return {f.name: hints[f.name] for f in msgspec.structs.fields(section)}


def env_name(section: str, key: str) -> str:
    """The environment variable that overrides ``section.key``."""
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def _describe(tp: Any) -> str:
    """The expected form of a value of type ``tp``, for error messages."""
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        for meta in extras:
            if isinstance(meta, msgspec.Meta) and meta.description:
                return str(meta.description)
        return _describe(base)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        parts = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in parts) + " (or unset)"
    if origin in (list, tuple):
        item = _describe(typing.get_args(tp)[0]).removeprefix("a ").removeprefix("an ")
        return f"a list of {item}s"
    return {str: "a string", bool: "true or false", int: "an integer", float: "a number"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _is_list(tp: Any) -> bool:
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return typing.get_origin(tp) in (list, tuple)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (types.UnionType, typing.Union) and type(
        None
    ) in typing.get_args(tp)


def _coerce_text(key: str, text: str, tp: Any, source: str) -> Any:
    """Convert an override given as text (env, command line) to the field's type."""
    if text == "" and _is_optional(tp):
        return None
    raw: Any = [p.strip() for p in text.split(",") if p.strip()] if _is_list(tp) else text
    try:
        return msgspec.convert(raw, tp, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            f"{key} = {text!r} (from {source}) is invalid: expected {_describe(tp)}"
            f" ({_strip_path(str(exc))})"
        ) from None


def _strip_path(message: str) -> str:
    return message.split(" - at `", 1)[0]


_AT = re.compile(r" - at `\$((?:\.\w+|\[\d+\])*)`$")


def _explain(exc: msgspec.ValidationError, origins: Mapping[str, str]) -> ConfigError:
    """Turn msgspec's ``... - at `$.a.b``` into a message that leads with the key."""
    message = str(exc)
    match = _AT.search(message)
    path = match.group(1).lstrip(".") if match else ""
    reason = message[: match.start()] if match else message
    unknown = re.match(r"Object contains unknown field `(\w+)`", reason)
    sections = _sections()
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        if path in sections:
            known = ", ".join(_field_types(sections[path]))
            expected = f"one of the keys of [{path}]: {known}"
        else:
            expected = "one of the sections " + ", ".join(f"[{s}]" for s in sections)
        return ConfigError(
            f"{key}: unknown key (from {origins.get(key, 'file')}); expected {expected}"
        )
    key = re.sub(r"\[\d+\]$", "", path)
    section, _, name = key.partition(".")
    expected = ""
    if section in sections and name in _field_types(sections[section]):
        expected = f"; expected {_describe(_field_types(sections[section])[name])}"
    elif key in sections:
        expected = f"; expected a table [{key}]"
    return ConfigError(f"{key or 'config'}: {reason} (from {origins.get(key, 'file')}){expected}")


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """Parse ``--set section.key=value`` items into ``{"section.key": "value"}``."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected the form section.key=value")
        out[key.strip()] = value.strip()
    return out


def _apply(
    merged: dict[str, Any],
    origins: dict[str, str],
    key: str,
    value: Any,
    source: str,
) -> None:
    sections = _sections()
    section, _, name = key.partition(".")
    if section not in sections:
        raise ConfigError(
            f"{key}: unknown section (from {source}); expected one of " + ", ".join(sections)
        )
    fields = _field_types(sections[section])
    if name not in fields:
        raise ConfigError(
            f"{key}: unknown key (from {source}); expected one of the keys of "
            f"[{section}]: " + ", ".join(fields)
        )
    if isinstance(value, str):
        value = _coerce_text(key, value, fields[name], source)
    table = merged.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: expected a table [{section}], got {type(table).__name__}")
    table[name] = value
    origins[key] = source


def _env_overrides(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``REFITD_<SECTION>_<KEY>`` variables as ``(dotted key, value, variable)``.

    Variables that start with a section's prefix but match no key are refused as
    typos; other ``REFITD_*`` variables (``REFITD_CONFIG`` and any tool's own) are
    not configuration and are left alone.
    """
    sections = _sections()
    known = {
        env_name(section, key): f"{section}.{key}"
        for section, tp in sections.items()
        for key in _field_types(tp)
    }
    # Longest prefix first so that e.g. DATA_PLANE_ is not read as a DATA section.
    prefixes = sorted((f"{ENV_PREFIX}{s.upper()}_" for s in sections), key=len, reverse=True)
    found: list[tuple[str, str, str]] = []
    for var in sorted(env):
        if var in known:
            found.append((known[var], env[var], var))
        elif section := next((p for p in prefixes if var.startswith(p)), ""):
            raise ConfigError(
                f"environment variable {var} names no configuration key; expected one of "
                + ", ".join(sorted(v for v in known if v.startswith(section)))
            )
    return found


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults < file < environment < ``overrides``.

    ``path`` is the TOML file; when None, ``env["REFITD_CONFIG"]`` names it, and
    without that only defaults apply. ``env`` defaults to ``os.environ``; pass ``{}``
    to ignore the environment. ``overrides`` maps dotted keys (``"server.port"``) to
    values: typed values are used as they are, strings are converted like
    environment values (so ``parse_overrides(args.set)`` can be passed directly).
    Raises :class:`ConfigError` naming the key for any unknown key or invalid value.
    """
    env = os.environ if env is None else env
    if path is None and env.get(ENV_CONFIG_PATH):
        path = env[ENV_CONFIG_PATH]
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if path is not None:
        merged = _read_toml(Path(path))
    for key, value, var in _env_overrides(env):
        _apply(merged, origins, key, value, f"environment {var}")
    for key, value in (overrides or {}).items():
        _apply(merged, origins, key, value, "command line")
    try:
        return msgspec.convert(merged, Config)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):  # raised by Config.__post_init__
            raise ConfigError(str(cause)) from None
        raise _explain(exc, origins) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
