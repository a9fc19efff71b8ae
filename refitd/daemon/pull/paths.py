"""Which data path a daemon runs, and which one reads each peer: the one place that decides,
and the one module of the daemon that names a scheme (a mode of the config, what
``auto`` starts, a key of a peer's advertisements). Everywhere else the daemon asks a
transport what it can do (:class:`~transports.interface.Capabilities`).

Modes (``data_plane.transport``):

- ``auto`` (default): the ``tcp`` transport always (refitd's own lanes of plain
  TCP); UCX as well only when the UCX this host loads offers an RDMA transport
  (``ucx_info -d`` lists ``rc_verbs``, ``rc_mlx5``, ``dc_mlx5``, ...). Per source
  peer: ``shm`` when the peer is proven to share this host's memory (same kernel
  boot, every segment the very file its record names); else a transport with RDMA
  (``ucx``) when both ends run it; else the first other transport both run (``tcp``).
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
from collections.abc import Callable, Iterable, Mapping

from refitd.errors import TransportError
from refitd.wire import MemoryKind, PeerRegions
from transports.interface import Capabilities, LeaseScope, PeerInfo, TransportOptions
from transports.tcp import TcpOptions

__all__ = [
    "AUTO",
    "SHM_ONLY",
    "SHM_SCHEME",
    "TCP_SCHEME",
    "UCX_SCHEME",
    "advert_of",
    "choose_remote",
    "has_rdma",
    "lease_scope",
    "peer_paths",
    "probes_ucx",
    "rdma_devices",
    "transport_options",
    "transport_schemes",
]

AUTO = "auto"
RESOLVE_TTL_S = 60.0
"""How long the tcp data server's admission keeps the trusted peers' resolved addresses."""
SHM_SCHEME = "shm"
"""The same-host transport's scheme: the key of its advertisement in a peer's records."""
SHM_ONLY = SHM_SCHEME
"""The mode that runs the same-host path only (a peer on another host is refused)."""
TCP_SCHEME = "tcp"
"""What ``auto`` always starts; the one transport built with a data server's options."""
UCX_SCHEME = "ucx"
"""What ``auto`` starts beside ``tcp`` where this host's UCX offers RDMA."""


def probes_ucx(mode: str) -> bool:
    """Whether a daemon in ``mode`` may run UCX, and so asks what this host's UCX can
    use (``auto``, ``ucx``)."""
    return mode in (AUTO, UCX_SCHEME)


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
    if mode == SHM_ONLY:
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


def advert_of(peer: PeerRegions, scheme: str) -> PeerInfo:
    """``peer``'s grant on its ``scheme`` transport, as its signed records carry it;
    :class:`TransportError` when they carry none (records are given one only under a
    lease)."""
    raw = peer.adverts.get(scheme)
    if raw:
        return PeerInfo.decode(raw)
    if peer.advert:
        info = PeerInfo.decode(peer.advert)
        if info.scheme == scheme:
            return info
    what = "same-host" if scheme == SHM_SCHEME else scheme
    raise TransportError(
        f"the records of {peer.node_id!r} carry no {what} advertisement (records are "
        "given one only under a lease)"
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
    mode: str, mine: Mapping[str, Capabilities], peer: PeerRegions, why_not_shm: str
) -> tuple[str, str]:
    """``(scheme, why)``: the transport a pull from other-host ``peer`` reads through,
    for a daemon in ``mode`` running the transports ``mine`` (their capabilities by
    scheme, in start order): in ``auto`` one with RDMA where both ends run it, else
    the first both run. :class:`TransportError` (nothing moved) when none fits."""
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
        both = [s for s in mine if s in theirs]
        rdma = [s for s in both if mine[s].rdma]
        if rdma:
            return rdma[0], f"both ends run {rdma[0]} with RDMA; not shm because {why_not_shm}"
        if both:
            return both[0], (
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
    """What a pull's lease lets it read from ``peer``, which the source's same-host
    grant must name (:meth:`transports.shm.ShmTransport.check_grant`): ``peer``'s host
    regions, each limited to the byte ranges of the lease scope. GPU memory is never
    granted: it is read through the source's staging."""
    ranges = {
        r.region_id: peer.scope.get(r.region_id, [])
        for r in peer.regions
        if r.kind is MemoryKind.HOST
    }
    return LeaseScope(peer.lease_id, ranges)


def peer_paths(
    mode: str,
    mine: Mapping[str, Capabilities],
    trusted: Iterable[str],
    seen: dict[str, tuple[str, str]],
) -> dict[str, str]:
    """For ``refitd status``: per known peer (``trusted`` URLs, and peers pulls read
    from), the path a pull from it takes (``seen``: decided by a pull) or would
    take, and why, for a daemon in ``mode`` running the transports ``mine`` (their
    capabilities by scheme, in start order)."""
    out = {node: f"{path}: {why}" for node, (path, why) in seen.items()}
    if mode == SHM_ONLY:
        default = "shm: this daemon runs the same-host path only"
    elif mode == AUTO:
        rdma = [s for s, caps in mine.items() if caps.rdma]
        remote = (rdma or list(mine) or [TCP_SCHEME])[0]
        why = (
            "this host's UCX offers RDMA (if the peer's does too)"
            if rdma
            else "this host's UCX offers no RDMA"
        )
        default = f"shm if proven on this host at pull time, else {remote}: {why}"
    else:
        default = f"{mode}: forced (--transport {mode})"
    for url in trusted:
        out.setdefault(url, default)
    return out
