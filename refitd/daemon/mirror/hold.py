"""Which bytes of this daemon's mirrors still filling are complete, for its data plane
and for the records it signs.

A downstream relay reads its upstream's mirror ahead of it over ``tcp``: it asks for
chunks not complete there yet, and the upstream's data server holds each such read
until its chunk is complete (`transports.tcp.held`), so a chunk goes on to the next
host as soon as it lands, with no round trip after it. What the data server asks is
:class:`FillingMirrors`: keyed on the memory (this daemon's region ids of each mirror
still filling), a chunk complete only once :meth:`~refitd.daemon.mirror.chunks.Mirror.mark`
marked it (after the read that filled it returned).

The records this daemon signs for a lease (its grants, its feed's frames, the packs it
makes) ask the same table what a lease on a mirror still filling may read:
:meth:`FillingMirrors.limit_scope`, only its complete chunks. So the one rule of "only
complete chunks are read" has one owner, whichever path reads them. The table is one of
the daemon's parts (:class:`~refitd.daemon.app.node.Daemon` makes it, its lease rules
read it); the host mirrors (:class:`~refitd.daemon.mirror.mirrors.Mirrors`) are built
with it and are the only ones that change it (:meth:`~FillingMirrors.add`,
:meth:`~FillingMirrors.remove`, :meth:`~FillingMirrors.changed`): no hook is set on the
daemon after it is built.

A mirror stays here from before its version is published (no lease, so no read, before
it) until it is complete, or, failed, until its regions are deleted: a read of a
failed mirror's incomplete bytes is refused, never answered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from refitd.wire.fields import INT64_MAX
from transports.batch import within_spans
from transports.tcp.held import Completion

if TYPE_CHECKING:
    from refitd.daemon.mirror.chunks import Mirror
    from transports.interface import Scope

__all__ = ["FillingMirrors"]


class _Region:
    """One region of a mirror still filling: its chunks in offset order."""

    def __init__(self, m: Mirror, source_region: int) -> None:
        rows = np.flatnonzero(m.chunks[:, 0] == source_region)
        rows = rows[np.argsort(m.chunks[rows, 1], kind="stable")]
        self.mirror = m
        self.chunks = rows  # the mirror's chunk indexes
        self.starts = m.chunks[rows, 1]
        self.ends = self.starts + m.chunks[rows, 2]

    def pending(self, offset: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]) -> bool:
        """Whether any read ``[offset, offset + nbytes)`` shares a byte with a chunk not
        complete yet (a zero-byte read: lies strictly inside one). Asked as the one
        range rule (:func:`transports.batch.within_spans`): a read is clear iff it lies
        in one gap between the chunks still filling. The gaps are ``[0, the first such
        chunk)``, those between two of them (zero bytes wide where they touch, so a
        zero-byte read there is clear) and ``[the last one's end, 2**63 - 1)``. A read
        at a negative offset, of a negative size or past ``2**63 - 1`` lies in none: it
        is pending, never complete (its grant refuses it before it could be held)."""
        todo = ~self.mirror.done[self.chunks]
        starts = np.concatenate(([0], self.ends[todo])).astype(np.int64)
        ends = np.concatenate((self.starts[todo], [INT64_MAX])).astype(np.int64)
        return not bool(within_spans(offset, nbytes, starts, ends)[1].all())


class FillingMirrors(Completion):
    """The data plane's view of this daemon's mirrors still filling (a
    :class:`~transports.tcp.held.Completion`, which does the waiting). Its
    :meth:`why_held` runs in the data server's threads; :meth:`add`, :meth:`remove`
    and :meth:`changed` in the daemon's loop."""

    def __init__(self) -> None:
        super().__init__()
        # region id here -> its chunks; replaced whole, never changed in place, so a
        # server thread always reads one consistent table
        self._regions: dict[int, _Region] = {}

    def add(self, m: Mirror) -> None:
        """``m``'s regions are filling from now on (before its version is published)."""
        table = dict(self._regions)
        for s, r in m.regions.items():
            table[r.region_id] = _Region(m, s)
        self._regions = table
        self.changed()

    def remove(self, m: Mirror) -> None:
        """``m`` is complete, or its regions are gone: nothing of it is held any more."""
        self._regions = {k: v for k, v in self._regions.items() if v.mirror is not m}
        self.changed()

    def limit_scope(self, model: str, version: int, scope: Scope) -> Scope:
        """What a lease on ``model`` ``version`` may read of ``scope`` (its version's
        shard ranges): of a mirror still filling (or failed, until its regions go),
        only its complete chunks, every region still listed; ``scope`` itself for
        any other version, and for a mirror complete already."""
        for r in self._regions.values():
            m = r.mirror
            if (m.model, m.version) != (model, version):
                continue
            if m.complete or not m.regions:
                return scope
            done = m.done_extents()
            return {rid: done.get(rid, []) for rid in scope}
        return scope

    def why_held(
        self,
        region: npt.NDArray[np.int64],
        offset: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
    ) -> str | None:
        """None when every byte read is complete (or of no mirror filling); "" when
        some are still filling; why, when their mirror failed."""
        table = self._regions
        if not table:
            return None
        held: str | None = None
        for rid in np.unique(region).tolist():
            r = table.get(int(rid))
            if r is None:
                continue
            m = r.mirror
            if m.error:
                return f"its mirror of {m.model!r} version {m.version} failed: {m.error}"
            rows = region == rid
            if r.pending(offset[rows], nbytes[rows]):
                held = ""
        return held
