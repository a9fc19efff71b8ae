"""The cluster registry: which daemons exist, and where each version's parts live.

Two kinds (``[registry] kind``):

- ``static`` (default, one host): the daemon knows only itself; nothing is shared.
- ``etcd`` (:mod:`refitd.cluster.etcd`): every daemon registers a signed
  :class:`~refitd.wire.DaemonRecord` under an etcd lease it keeps alive, and publishes
  a :class:`~refitd.wire.SourceRecord` per version it holds; every daemon watches the
  prefix, so an engine's daemon learns of new versions as they are published (push)
  and of a daemon that stopped refreshing its lease within the lease's TTL.

Either way the registry is one input of the peer allow-list: a daemon registered
here with a record that verifies under the deployment secret is a trusted peer
(:meth:`ClusterRegistry.trusted`), so a pull may read from its URL.

The daemon calls :meth:`~ClusterRegistry.start` once it listens (its URL is known),
:meth:`~ClusterRegistry.publish` whenever a model's versions change here, and
:meth:`~ClusterRegistry.close` at shutdown (an etcd registration is revoked at once,
so peers do not wait out the TTL).

Modules:

- this package: `registry_from_config` (and the names of `registry`)
- `registry`: `ClusterRegistry`, the interface the daemon uses, and the ``static`` kind
- `directory`: what the registry says, held in memory: pure, no I/O
- `etcd`: the ``etcd`` registry, through ``aetcd``
- `etcdserver`: an etcd server for tests and bench hosts (never production)
"""

from __future__ import annotations

from refitd.cluster.registry import ClusterRegistry, StaticRegistry
from refitd.config import RegistryConfig

__all__ = ["ClusterRegistry", "StaticRegistry", "registry_from_config"]


def registry_from_config(cfg: RegistryConfig | None, secret: bytes) -> ClusterRegistry:
    """The registry ``[registry]`` asks for (None: the defaults, ``static``)."""
    cfg = cfg or RegistryConfig()
    if cfg.kind == "etcd":
        from refitd.cluster.etcd import EtcdRegistry

        return EtcdRegistry(list(cfg.endpoints), cfg.prefix, secret, ttl_s=cfg.lease_ttl_s)
    return StaticRegistry(cfg.prefix, secret)
