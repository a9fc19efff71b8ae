"""The trust model: who may touch which bytes, checked in one place.

Objects and who may act on them
-------------------------------
*Principal* is who sent a request (:mod:`refitd.daemon.access.auth`): a token's name, a
Unix-socket uid, or the single principal ``loopback`` when the daemon runs without
tokens (every local client is then one principal: they share the host's memory
anyway, so ownership between them is recorded but not enforced).

=============== ====================================== ===============================
object          owner                                  who may act on it
=============== ====================================== ===============================
region          its creator (``POST /v1/regions``,     owner: pull into it, publish
                ``/v1/regions/attach``); one memory    from it, delete it, see its
                (device, inode) is one region:         segment name and holder;
                attaching held memory is 409           others: read under a lease only
model           ``[models] owners``, else its first    owners: publish, drain, retire;
                publisher (:mod:`.owners`)             readers (config, default all):
                                                       lease, list, fetch manifest
version         the model's owners                     immutable once READY; retired
                                                       by a newer READY version or by
                                                       drain ``retire``
lease           the principal that acquired it         renew / release / read by its
                                                       id (the id is the capability)
pull            the principal that submitted it        list, read, wait, cancel
staging region  the principal of the lease it was      read: that lease only, only the
                packed for                             bytes packed for it; written by
                                                       the daemon only; never a pull
                                                       destination nor published from
expert pool     its creator, with its two regions      owner: ensure, invalidate,
                                                       delete, pull into the host
                                                       rows; the slot region is
                                                       written by the pool only;
                                                       never published from
=============== ====================================== ===============================

Nothing is published from memory something else rewrites: a staging region, an
expert pool's region, a region a running pull writes (:meth:`Daemon.check_publishable`).

What a lease grants
-------------------
A lease on ``(model, version)`` lets its holder read, until it expires or is
released, exactly the byte ranges the version's shards occupy (every part's shards,
as published) and the staging regions packed for that same lease, nothing else. A
lease also pins the version: while any lease on it is live its regions are neither
written by a pull nor deleted, even if a newer version retired it.

What a peer is trusted with
---------------------------
A peer daemon is one this daemon trusts (:mod:`refitd.daemon.access.peers`): it receives
this daemon's peer token and its signed region records are believed. Region records
travel MAC'd with the deployment secret, and a source daemon hands out records only
for a live lease, scoped to the byte ranges that lease may read (``scope``); the
pulling daemon enforces that scope on every descriptor before any byte moves. A
peer is therefore trusted to enforce the read scope of the records it receives and
not to forge records (it could, holding the secret): the secret is what makes a
daemon part of one deployment.

How each rule is enforced
-------------------------
- *writes*: :class:`~refitd.daemon.pull.listeners.WriteRule` on ``POST /v1/pulls`` before anything else,
  against this daemon's records (owner, staging ids, :meth:`Registry.protected_regions`),
  and :meth:`ExpertPools.admit <refitd.daemon.experts.pools.ExpertPools.admit>` (slot regions);
- *reads*: :func:`check_reads` and :func:`check_pack_reads` against the lease's
  scope, on the pulling daemon (descriptors, pack specs) and on the source daemon
  (pack specs, in :meth:`Leases.pack`); staged offsets are validated as descriptors;
  a delta pack's plan by :func:`check_unchecked_reads` (:mod:`refitd.daemon.delta.selection`);
- *records*: :meth:`Leases.peer_regions` gives records only under a live lease;
- *versions*: :meth:`Registry.publish` refuses a READY or retired version and a
  version number that does not move the model forward; ``POST /v1/sources``
  checks the owner of every region a manifest publishes from;
- *deletes*: :meth:`Daemon.delete_region` and :meth:`Leases.release_staging`;
- *peers*: :meth:`PeerPolicy.check` before a connection to a source opens.

Every refusal names what was refused and why, and happens before any byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from refitd.errors import AccessDenied, ConflictError
from refitd.wire import PackSpec
from transports.batch import merge_ranges
from transports.interface import Scope

__all__ = [
    "Extents",
    "Scope",
    "check_pack_reads",
    "check_reads",
    "check_unchecked_reads",
    "check_writes",
    "merge_extents",
    "pack_span",
]

Extents = list[tuple[int, int]]
"""Sorted, disjoint, non-adjacent byte ranges ``[start, end)`` of one region."""


def merge_extents(ranges: Iterable[tuple[int, int, int]]) -> dict[int, Extents]:
    """``(region, start, end)`` ranges merged per region (touching ranges join)."""
    rows = np.array(list(ranges), dtype=np.int64).reshape(-1, 3)
    out: dict[int, Extents] = {}
    for r in merge_ranges(rows[:, 0], rows[:, 1], rows[:, 2] - rows[:, 1]):
        out.setdefault(r.region, []).append((r.offset, r.offset + r.nbytes))
    return out


def _inside(scope: Scope, region: np.ndarray, start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per range, whether ``[start, start + size)`` of ``region`` lies in one extent of
    ``scope`` (zero-length ranges always do). Offsets must already be in bounds."""
    ok: np.ndarray = size == 0
    for rid in np.unique(region).tolist():
        ext = scope.get(int(rid))
        if not ext:
            continue
        hit = region == rid
        starts = np.fromiter((a for a, _ in ext), dtype=np.int64, count=len(ext))
        ends = np.fromiter((b for _, b in ext), dtype=np.int64, count=len(ext))
        idx = np.searchsorted(starts, start[hit], side="right") - 1
        fits = (idx >= 0) & (start[hit] + size[hit] <= ends[np.maximum(idx, 0)])
        ok[hit] |= fits
    return ok


def check_reads(rows: np.ndarray, scope: Scope, what: str) -> None:
    """Refuse (:class:`AccessDenied`, 403) the first descriptor of ``rows`` (``(n, 5)``
    int64, already in bounds) whose source range is outside ``scope``; ``what`` names
    the lease in the refusal."""
    if rows.shape[0] == 0:
        return
    bad = np.flatnonzero(~_inside(scope, rows[:, 0], rows[:, 1], rows[:, 4]))
    if len(bad):
        i = int(bad[0])
        r = [int(x) for x in rows[i]]
        raise AccessDenied(
            f"descriptor {i} refused: it reads {r[4]} bytes at region {r[0]}+{r[1]}, which "
            f"is not part of {what}; a lease reads only its version's shards and staging "
            "packed for it; nothing was transferred"
        )


def pack_span(p: PackSpec) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of the source region a pack spec's elements span."""
    if p.nbytes == 0:
        return p.src_offset, p.src_offset
    neg = sum(st * (n - 1) for st, n in zip(p.strides, p.shape, strict=True) if st < 0)
    pos = sum(st * (n - 1) for st, n in zip(p.strides, p.shape, strict=True) if st > 0)
    return p.src_offset + p.itemsize * neg, p.src_offset + p.itemsize * (1 + pos)


def check_pack_reads(specs: list[PackSpec], scope: Scope, what: str) -> None:
    """Refuse (:class:`AccessDenied`) the first pack spec (bounds already checked)
    whose source span is not inside one extent of ``scope``."""
    if not specs:
        return
    spans = [pack_span(p) for p in specs]
    region = np.array([p.src_region for p in specs], dtype=np.int64)
    lo = np.array([a for a, _ in spans], dtype=np.int64)
    size = np.array([b - a for a, b in spans], dtype=np.int64)
    bad = np.flatnonzero(~_inside(scope, region, lo, size))
    if len(bad):
        i = int(bad[0])
        raise AccessDenied(
            f"pack spec {i} refused: it reads bytes [{lo[i]}, {lo[i] + size[i]}) of region "
            f"{specs[i].src_region}, which are not part of {what}; nothing was transferred"
        )


_FAR = 1 << 62
"""Offsets and sizes at or past this are past every region (their sums stay int64)."""


def check_unchecked_reads(rows: np.ndarray, specs: list[PackSpec], scope: Scope, what: str) -> None:
    """:func:`check_reads` and :func:`check_pack_reads` of a plan whose bounds nobody
    checked (a delta pack's, checked on the source only against the lease's scope):
    refuse (:class:`AccessDenied`, 403) the first descriptor, then pack spec, that
    reads outside ``scope``, a negative or far-off offset or size included."""
    r = rows[:, [0, 1, 4]]
    far = np.flatnonzero((r[:, 1] < 0) | (r[:, 2] < 0) | (r[:, 1] >= _FAR) | (r[:, 2] >= _FAR))
    if len(far):
        i = int(far[0])
        raise AccessDenied(
            f"descriptor {i} refused: it reads {int(r[i, 2])} bytes at region "
            f"{int(r[i, 0])}+{int(r[i, 1])}, which is not part of {what}; nothing was staged"
        )
    check_reads(rows, scope, what)
    for i, p in enumerate(specs):
        lo, hi = pack_span(p)
        if min(p.shape, default=0) < 0 or lo < 0 or hi >= _FAR or p.nbytes >= _FAR:
            raise AccessDenied(
                f"pack spec {i} refused: it reads bytes [{lo}, {hi}) of region "
                f"{p.src_region}, which are not part of {what}; nothing was staged"
            )
    check_pack_reads(specs, scope, what)


def check_writes(
    dst: Iterable[int],
    protected: Mapping[int, tuple[str, int, str]],
    staging: Iterable[int],
) -> None:
    """Refuse a pull whose destinations include a region a version publishes from
    (``protected``: region -> ``(model, version, why)``; :class:`ConflictError`, 409)
    or a staging region (:class:`AccessDenied`, 403). Owners are checked by the
    caller (they need the request's principal)."""
    targets = sorted(set(dst))
    held = set(staging)
    for rid in targets:
        if rid in held:
            raise AccessDenied(
                f"pull refused: destination region {rid} is a staging region of this daemon, "
                "which only the daemon writes; nothing was transferred"
            )
    for rid in targets:
        if rid in protected:
            model, version, why = protected[rid]
            raise ConflictError(
                f"pull refused: destination region {rid} holds {model!r} version {version}, "
                f"which is {why}; a published version's bytes never change; nothing was "
                "transferred"
            )
