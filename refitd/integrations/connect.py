"""Which daemon an integration talks to: the one named, else ``$REFITD_URL``, else
the listener of the refitd configuration (``$REFITD_CONFIG`` or the defaults: the
loopback ``http://127.0.0.1:7450``). A bearer token comes from ``token_file``, else
``$REFITD_TOKEN_FILE``."""

from __future__ import annotations

import os

from refitd.client.http import RefitClient

__all__ = ["daemon_client", "daemon_url"]


def daemon_url(url: str = "") -> str:
    """The base URL of the node's daemon (see the module docstring)."""
    if url:
        return url
    if os.environ.get("REFITD_URL"):
        return os.environ["REFITD_URL"]
    from refitd.config import load_config

    server = load_config().server
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server.port}"


def daemon_client(url: str = "", token_file: str = "") -> RefitClient:
    """A client of the node's daemon, with its bearer token when one is configured."""
    token_file = token_file or os.environ.get("REFITD_TOKEN_FILE", "")
    token = None
    if token_file:
        from refitd.config import read_token

        token = read_token(token_file)
    return RefitClient(daemon_url(url), token=token)
