"""Loading the configuration: defaults < file < environment < command line, strictly.

:func:`load_config` reads the four layers (the package docstring), checks every key
against the schema (:mod:`refitd.config.schema`) and names the key, where its value
came from and the form expected in every refusal. Every name is re-exported by
:mod:`refitd.config`.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from refitd.config.schema import Config
from refitd.errors import ConfigError

__all__ = [
    "ENV_CONFIG_PATH",
    "ENV_PREFIX",
    "env_name",
    "load_config",
    "parse_overrides",
]

ENV_PREFIX = "REFITD_"
#: Names the config file when no path is passed to :func:`load_config`.
ENV_CONFIG_PATH = "REFITD_CONFIG"


def _sections() -> dict[str, type[msgspec.Struct]]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in msgspec.structs.fields(Config)}


def _field_types(section: type[msgspec.Struct]) -> dict[str, Any]:
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
