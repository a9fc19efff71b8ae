"""The refitd exception tree, drawn once.

    RefitError                      root: everything refitd raises on purpose
    ├── ConfigError                 the operator must fix a setting or a file
    ├── PlanError                   the caller's plan or model cannot be served
    │   └── (refitd.reshard.types.UnsupportedReshard subclasses this)
    ├── TransportError              bytes could not be moved; the data plane says why
    ├── ProtocolError               a request or peer record is malformed or forged
    ├── ConflictError               the state moved on: stale version, lease, epoch
    └── NotFoundError               a named region, version, lease or pull is unknown

HTTP maps each branch to one status code in a single middleware; the client maps
status codes back to the same classes, so a caller catches the same exception
whether it called in-process or over HTTP.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ConflictError",
    "NotFoundError",
    "PlanError",
    "ProtocolError",
    "RefitError",
    "TransportError",
]


class RefitError(Exception):
    """Root of every error refitd raises deliberately."""


class ConfigError(RefitError):
    """A configuration value or file is invalid; the message names the key."""


class PlanError(RefitError):
    """A plan, manifest or model layout cannot be served as asked."""


class TransportError(RefitError):
    """The data plane could not move the bytes; the message names what is suspect."""


class ProtocolError(RefitError):
    """A request, descriptor or peer record is malformed, out of bounds or forged."""


class ConflictError(RefitError):
    """The request raced the state: a stale version, an expired lease, a changed epoch."""


class NotFoundError(RefitError):
    """A named object (region, version, lease, pull) does not exist."""
