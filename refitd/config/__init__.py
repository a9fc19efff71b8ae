"""The daemon's configuration: one schema, declared once, loaded strictly.

A :class:`Config` is built from four layers, each overriding the one before it:

    1. the defaults declared in `schema` (and documented in ``config/refitd.toml``);
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

Modules:

- `schema`: the sections and their keys, declared once, and the rules across them
- `loading`: the four layers read, merged and checked; every refusal names its key
- `values`: the values the config names, parsed one way for every layer: peer URLs,
  model tables, token files, loopback hosts, groups

Every public name of the three is re-exported here: import from :mod:`refitd.config`.
"""

from __future__ import annotations

from refitd.config.loading import (
    ENV_CONFIG_PATH,
    ENV_PREFIX,
    env_name,
    load_config,
    parse_overrides,
)
from refitd.config.schema import (
    Config,
    DataPlaneConfig,
    LimitsConfig,
    LoggingConfig,
    MetricsConfig,
    MirrorsConfig,
    ModelsConfig,
    PeersConfig,
    PullsConfig,
    RegistryConfig,
    ServerConfig,
)
from refitd.config.values import (
    ANY_PORT,
    is_loopback_host,
    normalize_peer,
    parse_model_table,
    read_token,
    resolve_group,
)

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
    "ModelsConfig",
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
