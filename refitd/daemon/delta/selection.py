"""A planned pull's delta at the source: the changes it needs, selected from the
:class:`~refitd.daemon.delta.source.DeltaBook`'s records, and staged for its lease.

:func:`pack_delta` serves ``POST /v1/deltas/pack``: for a lease on the version, the
receiver's full plan, and the base the receiver states (version and digest), the
changed units inside the plan's stream (composed along a chain of at most
:data:`~refitd.daemon.delta.source.MAX_CHAIN` records where that base is older),
staged for the lease (:meth:`~refitd.daemon.state.staging.StagingPool.stage`); the
receiver reads them with one descriptor of an ordinary pull. Refused before anything
is staged: a base that is not exactly the delta's, or a version whose changes were
dropped when it was retired (409); a read outside the lease's version (403, as a
pull's); a stream longer than :data:`STREAM_FACTOR` times the version (413). The
staging region is admitted and counted against the lease's principal (429 past its
caps). :func:`select_delta` is the selection, every check passed, that a streamed
delta (:mod:`refitd.daemon.delta.stream`) encodes instead of staging. The mechanism
and its costs: ``docs/delta.md``; the rules: ``docs/trust.md``.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import numpy.typing as npt

from refitd.daemon.access.trust import check_unchecked_reads
from refitd.daemon.app.waits import MAX_WAIT_S
from refitd.daemon.delta.source import MAX_CHAIN, DeltaBook, DeltaRecord
from refitd.daemon.pull.plancheck import check_runs
from refitd.daemon.state.registry import Lease
from refitd.delta import native
from refitd.delta.compare import Table, composed
from refitd.delta.stream import ChangeIndex, reads_of
from refitd.errors import ConflictError, ProtocolError, RequestTooLarge
from refitd.wire import DeltaPackRequest, DeltaStaged, DeltaState

__all__ = ["STREAM_FACTOR", "pack_delta", "pack_request", "select_delta"]

STREAM_FACTOR = 4
"""A delta pack's stream reads at most this many times its version's bytes. A plan
reads each byte of the version about once (a tied or replicated tensor a few times);
a longer stream only makes the daemon select and stage the same changes again, in
memory that grows with the request, not with the version."""

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def _chain(
    book: DeltaBook, rec: DeltaRecord, base: int, base_digest: str
) -> list[tuple[ChangeIndex, U8, Table | None]] | str:
    """The changes from ``base`` (with ``base_digest``) to ``rec``'s version through
    the records between them, oldest first (each READY with its changes, each
    one's base the one before with the digest that one recorded), at most
    :data:`MAX_CHAIN` of them; or why there is no such chain."""
    links = [rec]
    while links[0].base != base:
        if len(links) >= MAX_CHAIN or links[0].base < base:
            return f"no chain of at most {MAX_CHAIN} deltas from v{base}"
        prev = book.record(rec.model, links[0].base)
        if prev is None or not prev.linkable:
            why = prev.reason if prev is not None else "no record"
            return f"v{links[0].base}'s changes are gone ({why})"
        if prev.digest != links[0].base_digest or prev.unit != rec.unit:
            return f"v{prev.version}'s digest is not the base v{links[0].version} compared with"
        links.insert(0, prev)
    if links[0].base_digest != base_digest:
        return f"v{base}'s digest here is {links[0].base_digest}"
    return [(r.index, r.values, r.table) for r in links]


async def pack_request(book: DeltaBook, req: DeltaPackRequest, caller: str) -> DeltaStaged:
    """``POST /v1/delta/pack`` for principal ``caller``: ``req``'s plan bounded before
    anything reads or lists it (``max_plan_runs``), under its lease (409 for one not
    live on the version), as memory the lease's principal holds (else ``caller``'s:
    429 at its cap already, before any work), the plan ``req`` names resolved
    (:meth:`Plans.resolve`), then :func:`pack_delta`."""
    what = f"delta pack of {req.model!r} v{req.version}"
    check_runs(len(req.descriptors), req.pack_specs, book.max_plan_runs, what)
    lease = book.registry.check(req.lease_id, req.model, req.version)
    who = lease.owner or caller  # whose memory the staging is
    book.store.admit(who, 1)
    req, _ = await book.plans.resolve(req, caller)
    return await pack_delta(book, req, lease, who, caller)


async def pack_delta(
    book: DeltaBook, req: DeltaPackRequest, lease: Lease, principal: str, caller: str
) -> DeltaStaged:
    """Stage the changed units of ``req``'s planned stream for ``lease`` (live, on
    the version), as memory ``principal`` holds: admitted by its region and byte
    caps (429) and counted against it. A wait for the version's comparison is a
    long poll of ``caller`` (429 past its cap; 409 after a minute). Refused,
    nothing staged: without a delta of
    the version against exactly the base ``req`` states (409); a read outside the
    version's shards (403); a stream longer than :data:`STREAM_FACTOR` times the
    version (413)."""
    t0 = time.perf_counter()
    rec, index, values, reads = await select_delta(book, req, caller)
    t1 = time.perf_counter()
    payload, staged = await book.in_pool(
        native.payload_of, rec.unit, index, values, reads, req.nibbles
    )
    t2 = time.perf_counter()
    # The lease may have ended while this waited: nothing is staged for no lease.
    book.registry.check(lease.lease_id, req.model, req.version)
    # Admitted to the principal's caps and counted before its next request is.
    region = await book.staging.stage(payload, lease, principal)
    t3 = time.perf_counter()
    pages, changed, exceptions, units, bits = staged
    return DeltaStaged(
        region,
        len(payload),
        pages,
        changed,
        exceptions,
        rec.unit,
        units,
        rec.base,
        rec.digest,
        bits,
        t1 - t0,
        t2 - t1,
        t3 - t2,
    )


async def select_delta(
    book: DeltaBook, req: DeltaPackRequest, caller: str
) -> tuple[DeltaRecord, ChangeIndex, U8, I64]:
    """(:func:`pack_delta`'s, and a streamed delta's: :mod:`refitd.daemon.delta.stream`.)
    The record of ``req``'s version, its changes from the base ``req`` states
    (composed along a chain where that base is older) and the plan's stream as
    reads, every check of :meth:`pack` passed."""
    what = f"delta of {req.model!r} v{req.version}"
    rec = book.record(req.model, req.version)
    if rec is None:
        raise ConflictError(f"{what} refused: this daemon holds no delta record of it")
    if not rec.done.is_set():  # its comparison runs: a long poll, bounded as one
        with book.waits.held(caller, f"{what}, waiting for its comparison"):
            try:
                async with asyncio.timeout(MAX_WAIT_S):
                    await rec.done.wait()
            except TimeoutError:
                raise ConflictError(
                    f"{what} refused: its comparison still runs after {MAX_WAIT_S:g} s; "
                    "refit in full"
                ) from None
    # One consistent view: a newer version may retire this one (and drop its
    # changes) while the selection below runs in a worker thread.
    state, reason, index, values = rec.state, rec.reason, rec.index, rec.values
    if state != DeltaState.READY:
        raise ConflictError(f"{what} refused: there is none ({reason})")
    chain: list[tuple[ChangeIndex, U8, Table | None]] = [(index, values, rec.table)]
    if (req.base_version, req.base_digest) != (rec.base, rec.base_digest):
        links = _chain(book, rec, req.base_version, req.base_digest)
        if isinstance(links, str):
            raise ConflictError(
                f"{what} refused: it applies to v{rec.base} with digest "
                f"{rec.base_digest}, the engine states v{req.base_version} with digest "
                f"{req.base_digest or '(none)'} ({links}): a full refit is needed"
            )
        chain = links
    rows = req.descriptors.rows()
    scope = book.registry.scope(req.model, req.version)
    check_unchecked_reads(rows, req.pack_specs, scope, f"{req.model!r} version {req.version}")
    stream = int(rows[:, 4].sum()) + sum(p.nbytes for p in req.pack_specs)
    if stream > STREAM_FACTOR * rec.compared:
        raise RequestTooLarge(
            f"{what} refused: the plan's stream reads {stream} bytes, more than "
            f"{STREAM_FACTOR} times the version's {rec.compared} bytes; a plan reads "
            "each byte of its version about once"
        )
    if len(chain) > 1:  # v -> v+k: the records' changes composed, oldest first
        index, values = await book.in_pool(composed, chain, rec.unit)
    reads = await book.in_pool(reads_of, rows, req.pack_specs)
    if len(reads) and ((reads[:, 1] % rec.unit).any() or (reads[:, 2] % rec.unit).any()):
        raise ProtocolError(
            f"{what} refused: a read of the plan does not start and end on a {rec.unit}-byte unit"
        )
    return rec, index, values, reads
