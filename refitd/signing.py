"""The one signing scheme of refitd: a record MAC'd with the deployment secret.

Every record one process trusts from another carries ``mac``, an HMAC-SHA256 made
with the secret the daemons (and their transports) of one deployment share, over the
record's msgpack encoding with ``mac`` empty: every field is covered, in declaration
order, and a new field is covered without anyone writing a byte layout for it. A
record that does not verify is refused before anything in it is used.

Users: the cluster registry's records and the region records daemons send each other
(:mod:`refitd.wire.records`), and every transport's advertisement
(:class:`transports.interface.PeerInfo`). Imports only :mod:`refitd.errors`, so the
transports (below the daemon) and the wire contract (beside it) share it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING, ClassVar, Self

import msgspec

from refitd.errors import ProtocolError

__all__ = ["Signed"]


class Signed(msgspec.Struct, frozen=True):
    """A record MAC'd with the deployment secret (see the module docstring).

    A subclass declares ``mac: bytes = b""`` as its last field, names itself in a
    refusal through :meth:`_what`, and may raise a narrower :class:`ProtocolError`
    through ``refused``."""

    #: what :meth:`verify` raises: :class:`ProtocolError` (400) or a subclass of it
    refused: ClassVar[type[ProtocolError]] = ProtocolError

    if TYPE_CHECKING:  # a field of each subclass (it must come last)

        @property
        def mac(self) -> bytes: ...

    def _what(self) -> str:
        raise NotImplementedError

    def _digest(self, secret: bytes) -> bytes:
        body = msgspec.msgpack.encode(msgspec.structs.replace(self, mac=b""))
        return hmac.new(secret, body, hashlib.sha256).digest()

    def signed(self, secret: bytes) -> Self:
        """This record with its ``mac`` set for ``secret``."""
        return msgspec.structs.replace(self, mac=self._digest(secret))

    def verify(self, secret: bytes) -> None:
        """Refuse (``refused``) a record whose ``mac`` is not this one's for
        ``secret``: tampered with, or signed outside this deployment."""
        if not hmac.compare_digest(self._digest(secret), self.mac):
            raise self.refused(
                f"{self._what()} refused: MAC does not verify (tampered, or a daemon "
                "outside this deployment)"
            )
