"""Refusals on the wire: the :class:`ErrorBody` every refusal travels as, and the map
between :class:`~refitd.errors.RefitError` branches and HTTP statuses.

:data:`STATUS_OF` maps each branch to its one HTTP status (the daemon's error
middleware answers with it) and :data:`ERROR_OF_STATUS` maps a status back to a class
(the client raises it when a body names no known class).
"""

from __future__ import annotations

import msgspec

from refitd.errors import (
    AccessDenied,
    AccessError,
    ConfigError,
    ConflictError,
    InsufficientStorage,
    NotFoundError,
    PlanError,
    ProtocolError,
    QuotaExceeded,
    RefitError,
    RequestTooLarge,
    TransportError,
    Unauthenticated,
)

__all__ = ["ERROR_OF_STATUS", "STATUS_OF", "ErrorBody", "status_of"]


class ErrorBody(msgspec.Struct, frozen=True):
    """Every refusal: ``error`` is the RefitError class name, ``detail`` says what and why."""

    error: str
    detail: str


# Most specific first: the first isinstance match wins.
STATUS_OF: list[tuple[type[RefitError], int]] = [
    (RequestTooLarge, 413),
    (ProtocolError, 400),
    (Unauthenticated, 401),
    (AccessError, 403),
    (NotFoundError, 404),
    (ConflictError, 409),
    (PlanError, 422),
    (QuotaExceeded, 429),
    (InsufficientStorage, 507),
    (TransportError, 502),
    (ConfigError, 500),
    (RefitError, 500),
]


def status_of(exc: RefitError) -> int:
    """The HTTP status a refusal is answered with: the first match in ``STATUS_OF``."""
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return 500


#: Status code back to the error class, for a refusal whose body names no class.
ERROR_OF_STATUS: dict[int, type[RefitError]] = {
    400: ProtocolError,
    401: Unauthenticated,
    403: AccessDenied,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLarge,
    422: PlanError,
    429: QuotaExceeded,
    500: RefitError,
    502: TransportError,
    503: TransportError,
    507: InsufficientStorage,
}
