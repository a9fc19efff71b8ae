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

A new version of a model takes over the regions of the mirror of the version before
it (:func:`take_over`) when nothing reads that one any more and its regions have the
new version's sizes: a refit loop then makes its mirror's memory once, not once per
step (making it backs every byte, a page at a time: 64 MiB took 0.08-0.23 s on a
loaded 2-core host, and the time grows with the bytes), and
its regions stay registered with every data plane. The
bytes left in them are never read: a mirror serves a chunk only once its own read
filled it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from refitd.daemon.mirror.chunks import Mirror
from refitd.errors import NotFoundError, RefitError
from refitd.wire import RegionInfo, VersionState
from transports.segments import SHM_DIR

if TYPE_CHECKING:
    from refitd.daemon.state.registry import Registry
    from refitd.daemon.state.store import RegionStore

__all__ = ["half_of_shm", "held_bytes", "make_room", "release", "take_over"]

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
    registry: Registry,
    store: RegionStore,
    by_key: dict[tuple[str, str, int], Mirror],
    gone: Callable[[Mirror], None],
) -> list[int]:
    """Delete the regions (in ``store``) of every mirror whose version is retired in
    ``registry`` (or that failed) and is no longer leased, and tell ``gone`` of each
    mirror left with no region (whoever else keeps it, e.g. the table of reads held on
    it, forgets it); returns the region ids freed."""
    freed: list[int] = []
    for key, m in list(by_key.items()):
        if not m.finished:
            continue
        try:
            retired = registry.version(m.model, m.version).state is VersionState.RETIRED
        except NotFoundError:
            # Its record was forgotten (retired, unleased, among a model's older
            # records: registry.KEEP_RETIRED): nothing can lease it again.
            retired = True
        if not retired and not m.error:
            continue
        if registry.active_leases(m.model, m.version):
            continue
        for r in list(m.regions.values()):
            try:
                await store.delete(r.region_id)
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


def take_over(
    registry: Registry,
    store: RegionStore,
    by_key: dict[tuple[str, str, int], Mirror],
    new: Mirror,
    sizes: dict[int, int],
    gone: Callable[[Mirror], None],
) -> dict[int, RegionInfo]:
    """The regions of an earlier mirror of ``new``'s model and source, one per source
    region of ``sizes`` (source region id -> bytes), taken over for ``new``; empty
    when no earlier mirror can give them. A mirror gives its regions only when it is
    finished (complete or failed), no lease on its version is live in ``registry``, no
    running pull reads or writes them (``store``), and their sizes are exactly those
    wanted. Its version is retired first (no lease can be taken on it again), it leaves
    ``by_key`` and is told to ``gone``. Synchronous: nothing can lease it between the checks and the
    retirement."""
    want = sorted(sizes.items(), key=lambda kv: (kv[1], kv[0]))
    for key, old in sorted(by_key.items(), key=lambda kv: -kv[1].version):
        if old is new or (old.source, old.model) != (new.source, new.model):
            continue
        if old.version >= new.version or not old.finished or not old.regions:
            continue
        if registry.active_leases(old.model, old.version):
            continue
        if any(store.busy(r.region_id) for r in old.regions.values()):
            continue
        have = sorted(old.regions.items(), key=lambda kv: (kv[1].nbytes, kv[0]))
        if [n for _, n in want] != [r.nbytes for _, r in have]:
            continue
        # Same source region ids where the sizes allow (a trainer that publishes
        # every version from the same regions), else paired by size.
        same = {
            s: old.regions[s] for s, n in want if s in old.regions and old.regions[s].nbytes == n
        }
        rest = iter(r for s, r in have if r not in same.values())
        taken = {s: same[s] if s in same else next(rest) for s, _ in want}
        with contextlib.suppress(NotFoundError):
            registry.retire(old.model, old.version)
        del by_key[key]
        old.regions = {}
        old.nbytes = 0
        gone(old)
        log.info(
            "mirror of %r version %d takes over the regions of version %d: %s",
            new.model, new.version, old.version, sorted(r.region_id for r in taken.values()),
        )  # fmt: skip
        return taken
    return {}


async def make_room(
    registry: Registry,
    store: RegionStore,
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
    await release(registry, store, by_key, gone)
    idle = sorted(
        (
            x
            for x in by_key.values()
            if x is not new and x.complete and not registry.active_leases(x.model, x.version)
        ),
        key=lambda x: x.completed_at,
    )
    for x in idle:
        if fits():
            break
        if registry.active_leases(x.model, x.version):
            continue  # leased while an earlier one was released
        log.info("evicting the idle mirror of %r version %d to make room", x.model, x.version)
        registry.retire(x.model, x.version)  # no lease on it from now on
        await release(registry, store, by_key, gone)
    return fits()
