"""Which peer daemons this daemon may contact: the one place that decides.

A pull names its source as a URL (``PullRequest.source``). Reading from a source
means opening an HTTP connection to it, sending this daemon's peer bearer token
(``server.peer_token_file``) and trusting the region records it signs. So a source
is contacted only if :class:`PeerPolicy` trusts it; any other is refused with
:class:`~refitd.errors.ProtocolError` (400) *before* a connection is opened, and
the token is never sent to it.

A peer is named by its base URL, compared as ``(scheme, host, port, path)`` after
normalising: scheme ``http`` or ``https`` only (``file://`` and every other scheme
is refused), host lower-cased (no DNS lookup: ``localhost`` and ``127.0.0.1`` are
different names), the scheme's default port filled in, trailing ``/`` dropped;
user info, query and fragment are refused. The empty source means this daemon
itself and needs no trust. An allowed entry may give its port as ``*``
(``http://10.0.0.7:*``): every port of that host is then trusted, i.e. every
process that can listen there, so use it only for a host whose listeners are all
refitd daemons of this deployment.

Trusted peers come from named origins, each a set of URLs that can be replaced as
a whole: ``"config"`` is ``[peers] allow = [...]`` read at start; a registry (or a
test) adds its own origin at run time with :meth:`PeerPolicy.replace` or
:meth:`PeerPolicy.trust`. A peer is trusted while any origin lists it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

from refitd.config import ANY_PORT, normalize_peer
from refitd.errors import ConfigError, ProtocolError

__all__ = ["CONFIG_ORIGIN", "PeerPolicy", "normalize_peer"]

CONFIG_ORIGIN = "config"
"""The origin of the peers listed in ``[peers] allow``."""


def _any_port(peer: str) -> str:
    """``peer`` (canonical) with its port replaced by ``*``."""
    parts = urllib.parse.urlsplit(peer)
    host = parts.netloc.rsplit(":", 1)[0]
    return f"{parts.scheme}://{host}:{ANY_PORT}{parts.path}"


class PeerPolicy:
    """The set of peer daemons this daemon trusts, by origin.

    :meth:`check` is what every outgoing connection to a peer passes first.
    """

    def __init__(self, allow: Iterable[str] = ()) -> None:
        self._origins: dict[str, frozenset[str]] = {}
        try:
            self.replace(CONFIG_ORIGIN, allow)
        except ProtocolError as exc:
            raise ConfigError(f"peers.allow: {exc}") from None

    def replace(self, origin: str, urls: Iterable[str]) -> None:
        """Make ``urls`` the whole set of peers ``origin`` vouches for (an empty set
        forgets the origin). Refuses (nothing changes) if any URL is malformed."""
        normal = frozenset(normalize_peer(u, pattern=True) for u in urls)
        if normal:
            self._origins[origin] = normal
        else:
            self._origins.pop(origin, None)

    def trust(self, url: str, origin: str = "runtime") -> str:
        """Add one peer to ``origin``'s set; returns its canonical URL."""
        peer = normalize_peer(url, pattern=True)
        self._origins[origin] = self._origins.get(origin, frozenset()) | {peer}
        return peer

    def forget(self, url: str, origin: str = "runtime") -> None:
        """Drop one peer from ``origin``'s set (no error if it was not there)."""
        peer = normalize_peer(url, pattern=True)
        left = self._origins.get(origin, frozenset()) - {peer}
        self.replace(origin, left)

    def trusted(self) -> list[str]:
        """Every trusted peer, canonical and sorted."""
        return sorted(set().union(*self._origins.values())) if self._origins else []

    def allows(self, url: str) -> bool:
        """Whether ``url`` names a trusted peer (a malformed URL is not)."""
        try:
            self.check(url)
        except ProtocolError:
            return False
        return True

    def check(self, url: str) -> str:
        """The canonical URL of trusted peer ``url``, or :class:`ProtocolError` (400)
        naming the refused source. Call before opening any connection to it."""
        peer = normalize_peer(url)
        wild = _any_port(peer)
        for urls in self._origins.values():
            if peer in urls or wild in urls:
                return peer
        raise ProtocolError(
            f"source {url!r} refused: it is not a trusted peer of this daemon (trusted: "
            f"{', '.join(self.trusted()) or 'none'}); add its base URL to [peers] allow "
            "in the daemon's config. Nothing was contacted"
        )
