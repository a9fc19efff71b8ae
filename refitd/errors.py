"""The refitd exception tree, drawn once.

    RefitError                      root: everything refitd raises on purpose
    ├── ConfigError                 the operator must fix a setting or a file
    ├── PlanError                   the caller's plan or model cannot be served
    │   └── (refitd.reshard.types.UnsupportedReshard subclasses this)
    ├── TransportError              bytes could not be moved; the data plane says why
    ├── ProtocolError               a request or peer record is malformed or forged
    │   └── RequestTooLarge         the body exceeds the daemon's size limit (413)
    ├── AccessError                 the caller lacks rights: it must present better ones
    │   ├── Unauthenticated         no valid credential was presented (401)
    │   └── AccessDenied            the principal may not act on this object (403)
    ├── ConflictError               the state moved on: stale version, lease, incarnation
    ├── NotFoundError               a named region, version, lease or pull is unknown
    └── ResourceExhausted           the node cannot take more now: free something first
        ├── InsufficientStorage     shared memory is full (507)
        └── QuotaExceeded           the principal reached a configured cap (429)

HTTP maps each branch to one status code in a single middleware; the client maps
status codes back to the same classes, so a caller catches the same exception
whether it called in-process or over HTTP.
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "AccessError",
    "ConfigError",
    "ConflictError",
    "InsufficientStorage",
    "NotFoundError",
    "PlanError",
    "ProtocolError",
    "QuotaExceeded",
    "RefitError",
    "RequestTooLarge",
    "ResourceExhausted",
    "TransportError",
    "Unauthenticated",
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


class RequestTooLarge(ProtocolError):
    """A request body is larger than the daemon accepts (``server.max_request_bytes``)."""


class AccessError(RefitError):
    """The caller lacks the rights for the request; the message says which it needs."""


class Unauthenticated(AccessError):
    """No valid credential: a bearer token is missing or unknown."""


class AccessDenied(AccessError):
    """The caller is known but may not act on this object (another principal's region,
    or a uid the Unix socket does not admit)."""


class ConflictError(RefitError):
    """The request raced the state: a stale version, an expired lease, a changed incarnation."""


class NotFoundError(RefitError):
    """A named object (region, version, lease, pull) does not exist."""


class ResourceExhausted(RefitError):
    """The node cannot take this request now: memory or a cap is used up. Nothing
    was done; the caller may retry once something is freed."""


class InsufficientStorage(ResourceExhausted):
    """Shared memory ran out: a region's bytes could not be reserved (507)."""


class QuotaExceeded(ResourceExhausted):
    """The principal holds as many leases, regions or pulls as its cap allows (429);
    the message names the cap and its setting."""
