"""The configuration's schema: every section and its keys, declared once, with the
defaults ``config/refitd.toml`` documents, and the rules across sections
(:meth:`Config.__post_init__`). Loaded by :mod:`refitd.config.loading`; every name is
re-exported by :mod:`refitd.config`.

Units are in the key names: ``*_bytes`` are bytes, ``*_s`` are seconds.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from refitd.config.values import is_loopback_host, normalize_peer, parse_model_table
from refitd.errors import ConfigError, ProtocolError

__all__ = [
    "Config",
    "DataPlaneConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "MirrorsConfig",
    "ModelsConfig",
    "PeersConfig",
    "PullsConfig",
    "RegistryConfig",
    "ServerConfig",
]

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
    #: A version still pending (parts missing) this many seconds after its first part
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
