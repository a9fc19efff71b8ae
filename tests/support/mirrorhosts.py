"""Two daemons that authenticate their clients: a source (the trainer's) and a mirror
host that reads it, as another host would.

The mirror and trust tests attack a mirror host through tenants with tokens; the
tenants are ``a`` and ``b``, and ``peer`` is the token the mirror host's daemon presents
to the source. :func:`tokened_hosts` serves both daemons (each checks tokens as
``refitd serve`` does) and hands back ``peer``'s client at the source and ``a``'s at the
mirror host.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from refitd.client.http import RefitClient
from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from support.daemons import served, token_file

__all__ = ["TOKENS", "TokenedHosts", "tokened_hosts"]

TOKENS = {"a": "token-of-a", "b": "token-of-b", "peer": "token-of-peer"}
"""Principal -> bearer token, as the daemons' token file lists them."""


@dataclass(frozen=True)
class TokenedHosts:
    source_url: str
    mirror_url: str
    sc: RefitClient  # the mirror host's daemon's token (``peer``) at the source
    mc: RefitClient  # tenant ``a`` at the mirror host


@contextlib.asynccontextmanager
async def tokened_hosts(
    directory: Path, source: Daemon, mirror: Daemon
) -> AsyncIterator[TokenedHosts]:
    """Serve ``source`` and ``mirror`` on 127.0.0.1:0 for the block, both requiring the
    tokens of :data:`TOKENS` (their file written in ``directory``); the mirror host
    presents ``peer``'s token to the source and trusts it as a peer."""
    access = ServerConfig(port=0, token_file=token_file(directory, TOKENS))
    async with (
        served(source, access=access) as s,
        served(mirror, access=access, token=TOKENS["peer"]) as m,
        RefitClient(s.url, token=TOKENS["peer"]) as sc,
        RefitClient(m.url, token=TOKENS["a"]) as mc,
    ):
        mirror.peers.replace("test", [s.url])
        yield TokenedHosts(s.url, m.url, sc, mc)
