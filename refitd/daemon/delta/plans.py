"""The plans a source keeps for its delta readers, so a warm delta refit names its
plan instead of uploading it.

An engine's delta request carries its whole compiled plan (every descriptor and pack
spec); a refit repeats every step with the same geometry, so the source keeps the
plans each principal sent last (every rank of its engines, each double-buffered
placement), under the digest of their bytes, and answers that digest in the
stream's head. The next request names it (``plan``) with no descriptors; one the
source no longer keeps (a daemon restarted, the plan pushed out) is refused (404,
nothing read), and the engine sends its plan again.

What is kept is the principal's own and bounded per principal, in plans
(:data:`KEEP_PER_PRINCIPAL`) and in bytes (:data:`KEEP_BYTES_PER_PRINCIPAL`, the
oldest pushed out first; a plan larger than that is not kept, and is sent each
time). A plan is found only under the principal that sent it, and every request is
checked against its lease's scope as a sent plan is (:meth:`DeltaBook.selection`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from typing import TypeVar

import msgspec

from refitd.errors import NotFoundError, ProtocolError
from refitd.wire import DeltaPackRequest, DescriptorTable, PackSpec

__all__ = ["KEEP_PER_PRINCIPAL", "Plans", "plan_digest"]

KEEP_PER_PRINCIPAL = 64
"""Plans kept per principal: each engine rank's, for each of a double-buffering
trainer's two placements."""
KEEP_BYTES_PER_PRINCIPAL = 256 << 20
"""Bytes of plans kept per principal (four requests at ``server.max_request_bytes``)."""
OFF_LOOP_BYTES = 1 << 20
"""A plan of more descriptor bytes than this is digested off the event loop."""

R = TypeVar("R", bound=DeltaPackRequest)


def plan_digest(descriptors: DescriptorTable, specs: list[PackSpec]) -> str:
    """The name of a plan: a digest of its descriptor table and pack specs."""
    h = hashlib.blake2b(descriptors.table, digest_size=16)
    h.update(msgspec.msgpack.encode(specs))
    return h.hexdigest()


class Plans:
    """The plans each principal sent with a delta request, by their digest."""

    def __init__(
        self, keep: int = KEEP_PER_PRINCIPAL, keep_bytes: int = KEEP_BYTES_PER_PRINCIPAL
    ) -> None:
        self.keep, self.keep_bytes = keep, keep_bytes
        #: per principal, its plans by name, each with its size (:func:`_size`)
        self._kept: dict[
            str, collections.OrderedDict[str, tuple[DescriptorTable, list[PackSpec], int]]
        ]
        self._kept = {}
        self._bytes: dict[str, int] = {}  # per principal, the sum of its kept plans' sizes

    async def resolve(self, req: R, principal: str) -> tuple[R, str]:
        """``req`` with its plan, and the plan's digest: a request that sends its plan
        keeps it (under ``principal``); one that names a plan with no descriptors gets
        the plan ``principal`` sent under that name (404 when not kept here; 400 for a
        request that names one and sends one too)."""
        kept = self._kept.setdefault(principal, collections.OrderedDict())
        if not req.plan:
            size = _size(req.descriptors, req.pack_specs)
            if size > OFF_LOOP_BYTES:  # its specs' dimensions count, not only its table
                name = await asyncio.to_thread(plan_digest, req.descriptors, req.pack_specs)
            else:
                name = plan_digest(req.descriptors, req.pack_specs)
            old = kept.pop(name, None)
            total = self._bytes.get(principal, 0) - (old[2] if old else 0) + size
            kept[name] = (req.descriptors, req.pack_specs, size)
            while len(kept) > self.keep or total > self.keep_bytes:
                total -= kept.popitem(last=False)[1][2]
            self._bytes[principal] = total
            return req, name if name in kept else ""
        if len(req.descriptors) or req.pack_specs:
            raise ProtocolError(
                f"delta request refused: it names plan {req.plan!r} and sends a plan too; "
                "send one or the other"
            )
        plan = kept.get(req.plan)
        if plan is None:
            raise NotFoundError(
                f"delta request refused: plan {req.plan!r} is not kept on this daemon (it "
                "restarted, or the plan was pushed out); send the plan itself"
            )
        kept.move_to_end(req.plan)
        descriptors, specs, _ = plan
        return msgspec.structs.replace(req, descriptors=descriptors, pack_specs=specs), req.plan


def _size(descriptors: DescriptorTable, specs: list[PackSpec]) -> int:
    """The bytes a kept plan holds, about: its descriptor table, and each pack spec at
    64 bytes and 8 a dimension of its shape and of its strides (a spec of a million
    dimensions is one run to the bounds check, and 16 MB here). Counted once, when the
    plan is sent; the principal's total is kept beside its plans."""
    return len(descriptors.table) + sum(64 + 8 * (len(s.shape) + len(s.strides)) for s in specs)
