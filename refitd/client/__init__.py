"""refitd's Python client: the async :class:`RefitClient` (one method per API v1
endpoint), :class:`SyncRefitClient`, the trainer's :class:`Publisher`, the engine's
:class:`DaemonReceiver` (and :class:`ClusterReceiver`, for a version spread over
several hosts' daemons), and :class:`LeaseKeeper` (renews a lease while a long
operation runs). Refusals raise the same :mod:`refitd.errors` classes the daemon
raised.

Modules:

- `http`: `RefitClient`: the async client, one method per API v1 endpoint
- `sync`: `SyncRefitClient`: a small blocking face of it
- `publisher`: `Publisher`: the trainer side, place tensors and publish versions
- `receiver`: `DaemonReceiver`: the engine side, a thin adapter over `ReshardReceiver`
- `multihost`: `ClusterReceiver`: refit from a version spread over several hosts
- `leases`: `LeaseKeeper`: keep a lease alive while a long operation runs
- `spawn`: start a ``refitd serve`` child and learn its address
"""

from __future__ import annotations

from refitd.client.http import RefitClient
from refitd.client.leases import LeaseKeeper
from refitd.client.multihost import ClusterReceiver
from refitd.client.publisher import Publisher
from refitd.client.receiver import DaemonReceiver, RefitStats
from refitd.client.sync import SyncRefitClient

__all__ = [
    "ClusterReceiver",
    "DaemonReceiver",
    "LeaseKeeper",
    "Publisher",
    "RefitClient",
    "RefitStats",
    "SyncRefitClient",
]
