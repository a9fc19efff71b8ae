"""refitd's Python client: the async :class:`RefitClient` (one method per API v1
endpoint), :class:`SyncRefitClient`, the trainer's :class:`Publisher`, the engine's
:class:`DaemonReceiver` (and :class:`ClusterReceiver`, for a version spread over
several hosts' daemons), and :class:`LeaseKeeper` (renews a lease while a long
operation runs). Refusals raise the same :mod:`refitd.errors` classes the daemon
raised.

Modules:

- `http`: `RefitClient`: the async client, one method per API v1 endpoint
- `session`: `ApiSession`: the one HTTP session under it and the daemon's peer client
- `sync`: `SyncRefitClient`: a small blocking face of it
- `publisher`: `Publisher`: the trainer side, place tensors and publish versions
- `receiver`: `DaemonReceiver`: the engine side, the refit: lease, plan or replay, pull, install
- `engine`: `EngineMemory`: the engine's parameters moved into regions the daemon writes
  (host or GPU), its scratch and swap mode's shadow
- `lowering`: a bound plan turned into the daemon rows and pack specs of a pull
- `install`: the one install: a finished pull landed in the parameters, host or GPU alike
- `swap`: swap mode: one copy per refit, nothing installed when a pull fails
- `prefetch`: swap mode's inactive copy prefetched while the engine serves, swapped later
- `onerefit`: `OneRefit`: one refit at a time on one engine
- `deltarefit`: delta refit, the engine side: pull only what changed since its base
- `deltastream`: a streamed delta, the engine side: ``POST /v1/deltas/stream`` read frame by frame
- `deltastats`: what a delta refit reports
- `gpu`: GPU memory registered with the node's daemon, once per allocation
- `multihost`: `ClusterReceiver`: refit from a version spread over several hosts
- `leases`: `LeaseKeeper`: keep a lease alive while a long operation runs
- `spawn`: start a ``refitd serve`` child and learn its address
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from refitd.client.http import RefitClient
    from refitd.client.leases import LeaseKeeper
    from refitd.client.multihost import ClusterReceiver
    from refitd.client.publisher import Publisher
    from refitd.client.receiver import DaemonReceiver, RefitStats
    from refitd.client.sync import SyncRefitClient

# Each name is imported from its module on first use: the publisher and the receivers
# bring torch (over a second of CPU), which `refitd status` or a daemon's HTTP client
# never needs.
_MODULE_OF = {
    "ClusterReceiver": "refitd.client.multihost",
    "DaemonReceiver": "refitd.client.receiver",
    "LeaseKeeper": "refitd.client.leases",
    "Publisher": "refitd.client.publisher",
    "RefitClient": "refitd.client.http",
    "RefitStats": "refitd.client.receiver",
    "SyncRefitClient": "refitd.client.sync",
}


def __getattr__(name: str) -> typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = [
    "ClusterReceiver",
    "DaemonReceiver",
    "LeaseKeeper",
    "Publisher",
    "RefitClient",
    "RefitStats",
    "SyncRefitClient",
]
