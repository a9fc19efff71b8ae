"""The ``ucx`` transport: one-sided UCX GETs from supervised data-plane processes.

Modules:

- `transport`: `UcxTransport`, the owner side (never loads UCX): which
  children exist, validation, deadlines, what a child's death costs.
- `pulling`: the owner's pulling side: `UcxPeer`, and one pulling child per peer.
- `supervisor`: one child process: start it, send it requests with a bound, stop it.
- `protocol`: the msgpack frames between the owner and a child.
- `worker`: the child itself (``python -m transports.ucx.worker``): UCX contexts,
  registrations and GETs through the native helper.
- `info`: which UCX transports this host's UCX can use (``ucx_info -d``, parsed).
"""

from __future__ import annotations

from .pulling import BACKSTOP_S, UcxPeer
from .transport import UcxTransport

__all__ = ["BACKSTOP_S", "UcxPeer", "UcxTransport"]
