"""The values the configuration names, parsed one way for every layer that reads them
(the daemon, the client, ops): peer URLs, ``MODEL=PRINCIPAL`` tables, token files,
loopback hosts, groups.
:mod:`refitd.config` re-exports them."""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from refitd.errors import ConfigError, ProtocolError

__all__ = [
    "ANY_PORT",
    "is_loopback_host",
    "normalize_peer",
    "parse_model_table",
    "read_token",
    "resolve_group",
]

#: A peer pattern's port that matches every port of its host (``[peers] allow``).
ANY_PORT = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_peer(url: str, *, pattern: bool = False) -> str:
    """The canonical spelling of peer base URL ``url``; :class:`ProtocolError` naming
    what is wrong when it is not an ``http(s)://host[:port][/path]`` URL. With
    ``pattern`` the port may be ``*`` (kept as ``*``)."""
    text = url.strip()
    wild = False
    if pattern:
        head, sep, rest = text.partition("://")
        netloc, slash, path = rest.partition("/")
        if sep and netloc.endswith(":" + ANY_PORT):
            wild = True
            text = f"{head}://{netloc[: -len(ANY_PORT) - 1]}{slash}{path}"
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ProtocolError(f"peer URL {url!r} refused: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ProtocolError(
            f"peer URL {url!r} refused: scheme {parts.scheme or '(none)'!r} is not http or "
            "https; a source is the base URL of a refitd daemon"
        )
    if not parts.hostname:
        raise ProtocolError(f"peer URL {url!r} refused: it names no host")
    if parts.username is not None or parts.password is not None:
        raise ProtocolError(f"peer URL {url!r} refused: user info is not allowed in a peer URL")
    if parts.query or parts.fragment:
        raise ProtocolError(f"peer URL {url!r} refused: a peer URL has no query or fragment")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    path = parts.path.rstrip("/")
    if wild:
        if port is not None:
            raise ProtocolError(f"peer URL {url!r} refused: two ports")
        return f"{scheme}://{host}:{ANY_PORT}{path}"
    return f"{scheme}://{host}:{port if port is not None else _DEFAULT_PORTS[scheme]}{path}"


def parse_model_table(entries: Iterable[str], key: str) -> dict[str, frozenset[str]]:
    """``MODEL=PRINCIPAL`` entries as model -> principals; refuses a malformed entry
    (:class:`ConfigError` naming ``key``)."""
    out: dict[str, set[str]] = {}
    for entry in entries:
        model, sep, who = (part.strip() for part in entry.partition("="))
        if not sep or not model or not who:
            raise ConfigError(
                f"{key} entry {entry!r} refused: expected MODEL=PRINCIPAL, e.g. "
                "'llama=trainer' (a token's name) or 'llama=uid:1000' (a Unix-socket uid)"
            )
        out.setdefault(model, set()).add(who)
    return {m: frozenset(w) for m, w in out.items()}


def read_token(path: str | os.PathLike[str]) -> str:
    """The first token in a token file (``NAME TOKEN`` or ``TOKEN`` lines), for clients
    and for a daemon reading from a peer; refuses an unreadable or empty file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"token file {path} cannot be read ({exc.strerror})") from None
    for raw in text.splitlines():
        parts = raw.split("#", 1)[0].split()
        if parts:
            return parts[-1]
    raise ConfigError(f"token file {path} holds no token; expected a line 'NAME TOKEN' or 'TOKEN'")


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
