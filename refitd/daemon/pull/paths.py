"""Which data path a daemon runs, and which one reads each peer: the one place that decides.

Modes (``data_plane.transport``):

- ``auto`` (default): the ``tcp`` transport always (refitd's own lanes of plain
  TCP); UCX as well only when the UCX this host loads offers an RDMA transport
  (``ucx_info -d`` lists ``rc_verbs``, ``rc_mlx5``, ``dc_mlx5``, ...). Per source
  peer: ``shm`` when the peer is proven to share this host's memory (same kernel
  boot, every segment the very file its record names); else ``ucx`` when both ends
  run UCX (both have RDMA); else ``tcp``.
- ``shm``: the same-host path only.
- ``tcp`` or ``ucx`` (or any registered scheme): every other-host peer through it
  (a same-host peer still reads through ``shm`` in ``auto`` only).

The ``tcp`` transport of a daemon serves only lease-scoped grants (the source makes
them, `TcpTransport.grant`, and hands them out in its signed, lease-scoped region
records), checks the lease is live at the source before every read, and
answers only hosts of its trusted peers (``[peers] allow`` or the registry) or,
on this host's loopback, the daemon's own uid and root (`transports.tcp.admission`).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable

from refitd.errors import TransportError
from refitd.wire import PeerRegions, RegionKind
from transports.interface import LeaseScope, PeerInfo, TransportOptions
from transports.tcp import TcpOptions

__all__ = [
    "AUTO",
    "TCP_SCHEME",
    "UCX_SCHEME",
    "choose_remote",
    "has_rdma",
    "lease_scope",
    "peer_paths",
    "rdma_devices",
    "transport_options",
    "transport_schemes",
]

AUTO = "auto"
RESOLVE_TTL_S = 60.0
"""How long the tcp data server's admission keeps the trusted peers' resolved addresses."""
SHM_SCHEME = "shm"
TCP_SCHEME = "tcp"
UCX_SCHEME = "ucx"


def has_rdma(ucx_transports: list[str]) -> bool:
    """Whether ``transport/device`` pairs (``ucx_info -d``) include an RDMA transport."""
    if not ucx_transports:
        return False  # UCX was not asked (or offers nothing): load none of its modules
    from transports.ucx.info import RDMA_TRANSPORTS

    return any(p.partition("/")[0] in RDMA_TRANSPORTS for p in ucx_transports)


def rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """This host's RDMA devices (InfiniBand, RoCE, iWARP and soft-RoCE alike: the
    kernel lists each under ``/sys/class/infiniband``). Without one, no UCX here offers
    an RDMA transport (each of them opens such a device), so ``auto`` knows it starts
    ``tcp`` alone without running ``ucx_info``."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def transport_schemes(mode: str, ucx_transports: list[str]) -> list[str]:
    """The transports a daemon in ``mode`` starts, the first one its primary."""
    if mode == SHM_SCHEME:
        return []
    if mode == AUTO:
        return [TCP_SCHEME, *([UCX_SCHEME] if has_rdma(ucx_transports) else [])]
    return [mode]


def _hosts_of(urls: list[str]) -> set[str]:
    """IP addresses of the hosts of trusted peer URLs (names resolved here)."""
    out: set[str] = set()
    for url in urls:
        host = urllib.parse.urlsplit(url.replace(":*", "")).hostname or ""
        try:
            out.add(str(ipaddress.ip_address(host)))
            continue
        except ValueError:
            pass
        try:
            out |= {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
        except OSError:
            continue
    return out


def transport_options(
    scheme: str,
    *,
    secret: bytes,
    node_id: str,
    pull_timeout_s: float,
    lanes: int,
    host: str,
    tcp_port: int,
    advertise_url: str,
    trusted: Callable[[], Iterable[str]],
    is_live: Callable[[str], bool],
    incarnation: int,
) -> TransportOptions:
    """What a daemon builds ``scheme`` with: its secret, node id and pull deadline,
    and for ``tcp`` its ``lanes``, its data server (on ``host``:``tcp_port``,
    advertised at ``advertise_url``'s host when bound to every address) and who may
    use it: the ``trusted`` peers' hosts connect, a lease ``is_live`` reads, on the
    server of this daemon life (``incarnation``)."""
    if scheme != TCP_SCHEME:
        return TransportOptions(secret, node_id, pull_timeout=pull_timeout_s)

    # The data server asks this in its accepting thread, for every connection: the
    # trusted peers' addresses are resolved once per set of peers and TTL, not per
    # connection (a connection must not make the daemon wait on DNS).
    cache: dict[tuple[str, ...], tuple[float, set[str]]] = {}

    def accept(host: str) -> bool:
        try:
            if ipaddress.ip_address(host).is_loopback:
                return True  # which local users: the data server's loopback_uids
        except ValueError:
            return False
        urls = tuple(trusted())
        now = time.monotonic()
        at, hosts = cache.get(urls, (-math.inf, set()))
        if now - at > RESOLVE_TTL_S:
            cache.clear()
            hosts = _hosts_of(list(urls))
            cache[urls] = (now, hosts)
        return host in hosts

    advertise_host = ""
    if host in ("0.0.0.0", "::", "") and advertise_url:
        advertise_host = urllib.parse.urlsplit(advertise_url).hostname or ""
    return TcpOptions(
        secret,
        node_id,
        pull_timeout=pull_timeout_s,
        lanes=lanes,
        host=host,
        port=tcp_port,
        advertise_host=advertise_host,
        accept=accept,
        authorize=is_live,
        require_lease=True,
        incarnation=incarnation,
    )


def adverts(peer: PeerRegions) -> dict[str, PeerInfo]:
    """The data planes ``peer`` serves other hosts, by scheme (from its signed records;
    its same-host ``shm`` advertisement is the ``shm`` transport's to read)."""
    out = {s: PeerInfo.decode(a) for s, a in peer.adverts.items() if s != SHM_SCHEME}
    if peer.advert:
        info = PeerInfo.decode(peer.advert)
        out.setdefault(info.scheme, info)
    return out


def choose_remote(
    mode: str, mine: Collection[str], peer: PeerRegions, why_not_shm: str
) -> tuple[str, str]:
    """``(scheme, why)``: the transport a pull from other-host ``peer`` reads through,
    for a daemon in ``mode`` running the transports ``mine`` (schemes, in start
    order). :class:`TransportError` (nothing moved) when none fits."""
    if not mine:
        raise TransportError(f"pull from {peer.node_id!r} refused: this daemon runs no transport")
    theirs = adverts(peer)
    if not theirs:
        raise TransportError(
            f"pull from {peer.node_id!r} refused before any byte moved: it advertises no "
            f"data plane (it runs {peer.transport!r}), and not the shared-memory path "
            f"because {why_not_shm}"
        )
    if mode == AUTO:
        if UCX_SCHEME in mine and UCX_SCHEME in theirs:
            return UCX_SCHEME, f"both ends run UCX with RDMA; not shm because {why_not_shm}"
        if TCP_SCHEME in mine and TCP_SCHEME in theirs:
            return TCP_SCHEME, (
                "no RDMA between the two (UCX over tcp has no one-sided read); not shm "
                f"because {why_not_shm}"
            )
    elif mode in mine and mode in theirs:
        return mode, f"forced (--transport {mode})"
    raise TransportError(
        f"pull from {peer.node_id!r} refused before any byte moved: it serves "
        f"{', '.join(sorted(theirs))}, this daemon {', '.join(mine)}"
    )


def lease_scope(peer: PeerRegions) -> LeaseScope:
    """What a pull's lease lets it read from ``peer``, for the same-host transport to
    map (:meth:`transports.shm.ShmTransport.credential`): ``peer``'s host regions, each
    limited to the byte ranges of the lease scope. GPU memory is never granted: it is
    read through the source's staging."""
    ranges = {
        r.region_id: peer.scope.get(r.region_id, [])
        for r in peer.regions
        if r.kind is RegionKind.SHM
    }
    return LeaseScope(peer.lease_id, ranges)


def peer_paths(
    mode: str, schemes: Collection[str], trusted: Iterable[str], seen: dict[str, tuple[str, str]]
) -> dict[str, str]:
    """For ``refitd status``: per known peer (``trusted`` URLs, and peers pulls read
    from), the path a pull from it takes (``seen``: decided by a pull) or would
    take, and why, for a daemon in ``mode`` running the transports ``schemes``."""
    out = {node: f"{path}: {why}" for node, (path, why) in seen.items()}
    if mode == SHM_SCHEME:
        default = "shm: this daemon runs the same-host path only"
    elif mode == AUTO:
        remote = UCX_SCHEME if UCX_SCHEME in schemes else TCP_SCHEME
        why = (
            "this host's UCX offers RDMA (if the peer's does too)"
            if remote == UCX_SCHEME
            else "this host's UCX offers no RDMA"
        )
        default = f"shm if proven on this host at pull time, else {remote}: {why}"
    else:
        default = f"{mode}: forced (--transport {mode})"
    for url in trusted:
        out.setdefault(url, default)
    return out
