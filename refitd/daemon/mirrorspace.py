"""The memory a daemon's host mirrors take: what they hold, and making room.

Host mirrors are memory the daemon makes on its own behalf for the engines that pull
through it, charged to no tenant's cap, so they are bounded by a host-wide budget
(``[mirrors] max_bytes``, default half of the shared-memory filesystem). A mirror's
bytes count from before its regions are made. To fit a new one, the daemon first
releases the mirrors whose version is retired here and unleased, then evicts
complete mirrors nobody leases, least recently completed first: such a mirror is a
cache entry (its version is retired here first, so no lease can be taken on it
again; its later pulls read their source). A version that still does not fit is not
mirrored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from refitd.daemon.mirror import Mirror
from refitd.errors import NotFoundError, RefitError
from refitd.wire import VersionState
from transports.segments import SHM_DIR

if TYPE_CHECKING:
    from refitd.daemon.node import Daemon

__all__ = ["half_of_shm", "held_bytes", "make_room", "release"]

log = logging.getLogger("refitd.mirrors")


def half_of_shm() -> int:
    """Half of the shared-memory filesystem's size, bytes (the default budget)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize // 2


def held_bytes(mirrors: Iterable[Mirror]) -> int:
    """Bytes the mirrors hold, or are about to make."""
    return sum(m.nbytes for m in mirrors)


async def release(
    d: Daemon,
    by_key: dict[tuple[str, str, int], Mirror],
    gone: Callable[[Mirror], None],
) -> list[int]:
    """Delete the regions of every mirror whose version is retired here (or that
    failed) and is no longer leased, and tell ``gone`` of each mirror left with no
    region (whoever else keeps it, e.g. the table of reads held on it, forgets it);
    returns the region ids freed."""
    freed: list[int] = []
    for key, m in list(by_key.items()):
        if not m.finished:
            continue
        try:
            info = d.registry.version(m.model, m.version)
        except NotFoundError:
            continue
        if info.state is not VersionState.RETIRED and not m.error:
            continue
        if d.registry.active_leases(m.model, m.version):
            continue
        for r in list(m.regions.values()):
            try:
                await d.delete_region(r.region_id)
            except RefitError:
                continue  # a pull still reads it: the next sweep frees it
            freed.append(r.region_id)
            m.regions = {k: v for k, v in m.regions.items() if v is not r}
        if not m.regions:
            del by_key[key]
            gone(m)
    if freed:
        log.info("released mirror regions %s", freed)
    return freed


async def make_room(
    d: Daemon,
    by_key: dict[tuple[str, str, int], Mirror],
    need: int,
    budget: int,
    new: Mirror,
    gone: Callable[[Mirror], None],
) -> bool:
    """Whether ``need`` more bytes fit ``budget`` (``new``, the mirror asking, not
    counted), after releasing retired mirrors and evicting idle complete ones (each
    released one told to ``gone``, as :func:`release` does)."""

    def fits() -> bool:
        return held_bytes(x for x in by_key.values() if x is not new) + need <= budget

    if fits():
        return True
    await release(d, by_key, gone)
    idle = sorted(
        (
            x
            for x in by_key.values()
            if x is not new and x.complete and not d.registry.active_leases(x.model, x.version)
        ),
        key=lambda x: x.completed_at,
    )
    for x in idle:
        if fits():
            break
        if d.registry.active_leases(x.model, x.version):
            continue  # leased while an earlier one was released
        log.info("evicting the idle mirror of %r version %d to make room", x.model, x.version)
        d.registry.retire(x.model, x.version)  # no lease on it from now on
        await release(d, by_key, gone)
    return fits()
