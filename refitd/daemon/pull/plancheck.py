"""The bounds check every pull passes first, before any byte moves.

Pure: :func:`validate_plan` checks a whole plan (descriptors and pack specs) against
the region sizes of two daemons' records before any byte moves. Both are rows of one layout, ``(src_region,
src_offset, dst_region, dst_offset, nbytes)``: a pack spec's row reads the span of
the source region its elements cover and writes its packed bytes. The checks are
the data plane's own (:func:`transports.batch.validate_batch`, bounds and the one
overlap check), vectorised with numpy so 100k descriptors check in milliseconds;
the refusal names the *first* offending descriptor or pack spec by index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from refitd.daemon.access.trust import pack_span
from refitd.errors import ProtocolError, RequestTooLarge
from refitd.wire import DescriptorTable, PackSpec
from transports.batch import rows_as_batch, validate_batch
from transports.interface import ReadRefused

__all__ = [
    "check_runs",
    "pack_rows",
    "plan_runs",
    "runs_of",
    "validate_descriptors",
    "validate_plan",
]


#: the daemon's words for each check of :func:`transports.batch.validate_batch`
_WHY = {
    "remote_unknown": "its source region is not recorded",
    "local_unknown": "its destination region is not recorded",
    "negative": "it has a negative offset or size",
    "remote_range": "its source range ends past the source region",
    "local_range": "its destination range ends past the destination region",
}
_WHY_PACK = {
    **_WHY,
    "remote_range": "its elements reach outside the source region",
    "local_range": "its packed bytes end past the destination region",
}


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _pack_why(exc: ReadRefused) -> str:
    if exc.why == "negative remote offset":  # a negative stride reaching back too far
        return "its elements reach outside the source region, before its start"
    return _WHY_PACK.get(exc.check, exc.why)


def pack_rows(specs: list[PackSpec]) -> tuple[np.ndarray, np.ndarray]:
    """Each pack spec as a plan row ``(src_region, lo, dst_region, dst_offset, nbytes)``
    and the length ``hi - lo`` of the source span ``[lo, hi)`` its elements cover
    (bytes; ``lo`` below ``src_offset`` where a stride is negative). Refuses
    (:class:`ProtocolError`) the first spec whose shape and strides disagree."""
    rows = np.zeros((len(specs), 5), dtype=np.int64)
    spans = np.zeros(len(specs), dtype=np.int64)
    for i, p in enumerate(specs):
        if len(p.shape) != len(p.strides) or any(s < 0 for s in p.shape):
            raise ProtocolError(
                f"{_pack_name(i, p)} refused: shape {p.shape} and strides {p.strides} "
                "disagree; nothing was transferred"
            )
        lo, hi = pack_span(p)
        row = (p.src_region, lo, p.dst_region, p.dst_offset, p.nbytes)
        if any(not _INT64_MIN <= v <= _INT64_MAX for v in (*row, hi - lo, hi)):
            raise ProtocolError(
                f"{_pack_name(i, p)} refused: its size or the span of its elements "
                f"([{lo}, {hi}), {p.nbytes} bytes) does not fit in 64 bits, so no region "
                "holds it; nothing was transferred"
            )
        rows[i] = row
        spans[i] = hi - lo
    return rows, spans


def runs_of(p: PackSpec) -> int:
    """How many contiguous runs spec ``p``'s elements make in packed order, counted
    from its shape and strides in O(rank), never by listing them: the size of the
    table any path that expands a spec run by run (a pull's direct reads, a device
    pack, a delta's stream) would build. Shape and strides must agree in length."""
    if any(n == 0 for n in p.shape):
        return 0
    dims = [(n, st) for n, st in zip(p.shape, p.strides, strict=True) if n != 1]
    run = 1  # elements in one run: the trailing dims that are dense
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    return math.prod(n for n, _ in dims)


def plan_runs(specs: list[PackSpec], what: str) -> int:
    """The runs of every spec together (:func:`runs_of`); refuses (400) the first spec
    whose shape and strides differ in length or whose shape has a negative extent,
    naming it and ``what`` was asked."""
    total = 0
    for i, p in enumerate(specs):
        if len(p.shape) != len(p.strides) or any(s < 0 for s in p.shape):
            raise ProtocolError(
                f"{what} refused: {_pack_name(i, p)} has shape {p.shape} and strides "
                f"{p.strides}, which disagree; nothing was transferred"
            )
        total += runs_of(p)
    return total


def check_runs(n_rows: int, specs: list[PackSpec], limit: int, what: str) -> int:
    """Refuse (413, nothing expanded) a plan of ``n_rows`` descriptors and ``specs``
    whose runs together exceed ``limit`` (``limits.max_plan_runs``): the most a path
    that expands it run by run may list for one request, counted before any list is
    built. A spec of a few bytes (a stride-0 block, say) otherwise expands into one
    run per element, hundreds of times the request's and its version's bytes.
    Returns the runs."""
    runs = n_rows + plan_runs(specs, what)
    if runs <= limit:
        return runs
    raise RequestTooLarge(
        f"{what} refused: its {n_rows} descriptors and {len(specs)} pack specs make "
        f"{runs} contiguous runs, more than limits.max_plan_runs = {limit}; a plan "
        "reads its bytes in longer runs (or in several requests)"
    )


def _pack_name(i: int, p: PackSpec) -> str:
    return f"pack spec {i} ({p.src_region!r}+{p.src_offset} -> {p.dst_region!r}+{p.dst_offset})"


def validate_plan(
    rows: np.ndarray,
    specs: list[PackSpec],
    src_sizes: Mapping[int, int],
    dst_sizes: Mapping[int, int],
) -> None:
    """Check descriptor ``rows`` (``(n, 5)`` int64) and pack ``specs`` together, once.

    ``src_sizes``/``dst_sizes`` map region id to size in bytes, from the daemons' own
    records. Refused (:class:`ProtocolError` naming the first bad descriptor by index,
    or pack spec as ``pack spec j``): a region not recorded, a negative offset or
    size, a byte range leaving its region (checked as ``offset <= size - nbytes`` so
    nothing overflows; a pack spec's source range is the span its elements cover), or
    two writes to one destination byte (the copies run concurrently, so which lands
    would be chance). Zero-length reads inside a region, including at its very end,
    pass and overlap nothing. Nothing is read or written by this function.
    """
    packed, spans = pack_rows(specs)
    plan = np.concatenate([rows.reshape(-1, 5), packed]) if len(specs) else rows.reshape(-1, 5)
    if plan.shape[0] == 0:
        return
    n_desc = rows.shape[0]
    try:
        validate_batch(
            rows_as_batch(plan),
            dict(dst_sizes),
            dict(src_sizes),
            np.concatenate([plan[:n_desc, 4], spans]),
        )
    except ReadRefused as exc:
        i = exc.index

        def name(k: int) -> str:
            return f"descriptor {k}" if k < n_desc else f"pack spec {k - n_desc}"

        if exc.check == "overlap" and exc.other is not None:
            a, b = plan[exc.other], plan[i]
            raise ProtocolError(
                f"{name(exc.other)} and {name(i)} refused: their destination ranges overlap "
                f"in region {int(b[2])} at byte {max(int(a[3]), int(b[3]))}; a plan writes "
                "each destination byte once; nothing was transferred"
            ) from None
        r = [int(x) for x in plan[i]]
        if i < n_desc:
            raise ProtocolError(
                f"descriptor {i} refused: read {r[4]} bytes from region {r[0]}+{r[1]} "
                f"(of {src_sizes.get(r[0], '?')} bytes) into region {r[2]}+{r[3]} "
                f"(of {dst_sizes.get(r[2], '?')} bytes): {_WHY.get(exc.check, exc.why)}; "
                "nothing was transferred"
            ) from None
        j = i - n_desc
        raise ProtocolError(
            f"{_pack_name(j, specs[j])} refused: its elements span bytes "
            f"[{r[1]}, {r[1] + int(spans[j])}) of region {r[0]} (of "
            f"{src_sizes.get(r[0], '?')} bytes) and land as {r[4]} bytes in region "
            f"{r[2]}+{r[3]} (of {dst_sizes.get(r[2], '?')} bytes): "
            f"{_pack_why(exc)}; nothing was transferred"
        ) from None


def validate_descriptors(
    d: DescriptorTable, src_sizes: Mapping[int, int], dst_sizes: Mapping[int, int]
) -> np.ndarray:
    """:func:`validate_plan` of a descriptor table alone; returns its ``(n, 5)`` rows."""
    rows = d.rows()
    validate_plan(rows, [], src_sizes, dst_sizes)
    return rows
