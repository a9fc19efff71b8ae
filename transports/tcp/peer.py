"""The reading side's connection to one peer's data server: `TcpPeer` (its lanes,
the grants reads are checked against, a batch cut into requests over them) and
`TcpGrant` (one grant read over a shared connection's lanes)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError, TransportError

from ..batch import ReadBatch, as_read_batch, coalesce, split_pieces, suspect_ranges, validate_batch
from ..interface import (
    Peer,
    PeerInfo,
    PeerLost,
    PullFailed,
    ReadRefused,
    TransportClosed,
    UnauthenticatedPeer,
)
from .frames import READ_ROW, Grant, check_scope
from .lanes import BIG, Lane, LaneError, LaneOwner, Request, request_spans

__all__ = [
    "BACKSTOP_S",
    "KEEP_GRANTS",
    "SLICE",
    "PeerOwner",
    "TcpGrant",
    "TcpPeer",
    "parse_address",
]


SLICE = 1 << 20
"""A read longer than this (bytes) is cut into pieces spread over the lanes."""
KEEP_GRANTS = 64
"""Grants a connection remembers for requests still queued (newest first)."""
BACKSTOP_S = 5.0
"""Seconds past a batch's deadline after which its lanes are cut from this side."""


def parse_address(address: bytes) -> tuple[str, int, int]:
    """``(host, port, incarnation)`` of a ``tcp`` record's address."""
    try:
        host, port, incarnation = msgspec.msgpack.decode(address, type=tuple[str, int, int])
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"tcp peer address refused: malformed ({exc})") from None
    return host, port, incarnation


class PeerOwner(LaneOwner, Protocol):
    """What a connection reads of its transport (``TcpTransport``), besides what its
    lanes do: lanes per peer, whether it is closed, its open connections, the sizes
    of its own regions, and its check of a peer's record."""

    @property
    def lanes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def _peers(self) -> set[TcpPeer]: ...

    def local_sizes(self) -> dict[int, int]: ...
    def _check_record(self, info: PeerInfo) -> None: ...


class TcpPeer(Peer):
    """A connection to one peer's data server: ``lanes`` TCP connections.

    ``info`` is the record reads are checked against on both ends: the peer's own
    advertisement, or a lease-scoped grant made from it (`update` replaces it; the
    new grant is sent on each lane before its next request)."""

    def __init__(self, owner: PeerOwner, info: PeerInfo) -> None:
        self.owner = owner
        self.info = info
        self.address = parse_address(info.address)
        self._grants: dict[int, PeerInfo] = {0: info}
        self._number = self._current = 0
        self._check = Grant(info)
        self._closed = False
        self.lanes = [Lane(self, i) for i in range(owner.lanes)]
        self._ids = itertools.count()

    @property
    def incarnation(self) -> int:
        """The source's incarnation this connection is for."""
        return self.address[2]

    def current_grant(self) -> tuple[int, PeerInfo]:
        return self._current, self._grants[self._current]

    def grant(self, number: int) -> PeerInfo:
        """Grant ``number`` (lane threads call this; `LaneError` once forgotten)."""
        info = self._grants.get(number)
        if info is None:
            raise LaneError("refused", f"grant {number} was replaced {KEEP_GRANTS} times since")
        return info

    def with_grant(self, info: PeerInfo) -> TcpGrant:
        """A connection over these lanes whose reads are checked (here and at the
        source) against ``info``, a record of the same peer life (e.g. one pull's
        lease-scoped grant), while other reads go on under theirs."""
        if self._closed:
            raise TransportClosed(f"connection to {self.info.peer_id!r} is closed")
        self.owner._check_record(info)
        if info.address != self.info.address:
            raise ProtocolError(
                f"grant for peer {self.info.peer_id!r} refused: the record is for another "
                "address or another life of it"
            )
        return TcpGrant(self, self._add(info), info)

    async def scoped(self, info: PeerInfo) -> Peer:
        # Each pull reads under its own grant on the shared lanes; the lanes keep
        # the record they were opened with.
        return self.with_grant(info)

    def cut(self) -> None:
        for lane in self.lanes:
            lane.cut()

    def _add(self, info: PeerInfo) -> int:
        self._number += 1
        self._grants[self._number] = info
        self._grants.pop(self._number - KEEP_GRANTS, None)
        return self._number

    async def open(self) -> None:
        """Connect every lane (in parallel), then start their threads."""
        results = await asyncio.gather(
            *(asyncio.to_thread(lane.connect) for lane in self.lanes), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for lane in self.lanes:
                lane._drop()
            first = errors[0]
            who = self.info.peer_id
            if isinstance(first, LaneError) and first.kind == "auth":
                raise UnauthenticatedPeer(f"connect to {who!r} refused: {first}")
            if isinstance(first, LaneError) and first.kind == "busy":
                raise TransportError(f"connect to {who!r} refused: {first}")
            if isinstance(first, LaneError):
                raise TransportError(f"connect to {who!r} failed: {first}")
            raise first
        for lane in self.lanes:
            lane.thread.start()

    async def update(self, info: PeerInfo) -> None:
        if self._closed:
            raise TransportClosed(f"update refused: connection to {self.info.peer_id!r} is closed")
        self.owner._check_record(info)
        if info.address != self.info.address:
            raise ProtocolError(
                f"update of peer {self.info.peer_id!r} refused: the record is for another "
                "address or another life of it"
            )
        check = Grant(info)
        self._current = self._add(info)
        self.info, self._check = info, check

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        await self.read(batch, self._current, self._check)

    async def read(
        self,
        batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]],
        number: int,
        check: Grant,
    ) -> None:
        """`get` under grant ``number`` (whose checks are ``check``)."""
        if self._closed or self.owner.closed:
            raise TransportClosed(f"get refused: connection to {self.info.peer_id!r} is closed")
        reads = as_read_batch(batch)
        validate_batch(reads, self.owner.local_sizes(), check.sizes)
        bad = check_scope(
            check,
            reads["remote_region"],
            reads["remote_offset"],
            reads["nbytes"],
            check.generations,
            check.sizes,
        )
        if bad is not None:
            i, why = bad
            raise ReadRefused(i, tuple(int(v) for v in reads[i].tolist()), why, "scope")  # type: ignore[arg-type]
        live = coalesce(reads)
        if len(live) == 0:
            return
        pieces = split_pieces(live, SLICE)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.owner.pull_timeout
        futures: list[asyncio.Future[None]] = []
        # Small pieces and large ones go in separate requests: the small ones are
        # gathered into one buffer on each end, the large ones move from and into
        # the regions themselves.
        small = pieces["nbytes"] < BIG
        parts = [
            group[lo:hi]
            for group in (pieces[~small], pieces[small])
            for lo, hi in request_spans(group["nbytes"])
        ]
        for part in parts:
            rows = np.empty(len(part), READ_ROW)
            rows["region"], rows["offset"] = part["remote_region"], part["remote_offset"]
            rows["nbytes"] = part["nbytes"]
            fut: asyncio.Future[None] = loop.create_future()
            req = Request(
                rows.tobytes(),
                part["local_region"].copy(),
                part["local_offset"].copy(),
                part["nbytes"].copy(),
                number,
                deadline,
                fut,
                loop,
            )
            lane = min(self.lanes, key=lambda ln: ln.queued)
            lane.queued += 1
            lane.queue.put(req)
            futures.append(fut)
        try:
            async with asyncio.timeout(self.owner.pull_timeout + BACKSTOP_S):
                results = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            for lane in self.lanes:
                lane.cut()
            raise PeerLost(
                f"pull from {self.info.peer_id!r} timed out after {self.owner.pull_timeout} s "
                f"and its lanes did not give up within {BACKSTOP_S} s more: they were cut",
                suspect_ranges(reads),
            ) from None
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise self._failure(errors, reads)

    def _failure(self, errors: list[BaseException], reads: ReadBatch) -> PullFailed:
        who = self.info.peer_id
        first = next((e for e in errors if isinstance(e, LaneError)), None)
        if first is None:
            return PullFailed(f"pull from {who!r} failed: {errors[0]}", suspect_ranges(reads))
        if first.kind == "refused":
            return PullFailed(
                f"pull from {who!r} refused by the source: {first}", suspect_ranges(reads)
            )
        if first.kind == "timeout":
            return PeerLost(
                f"pull from {who!r} failed: {first}; pulls from other peers were not affected",
                suspect_ranges(reads),
            )
        if first.kind == "restarted":
            return PeerLost(f"pull from {who!r} failed: {first}", suspect_ranges(reads))
        return PeerLost(f"pull from {who!r} failed: {first}", suspect_ranges(reads))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.owner._peers.discard(self)
        for lane in self.lanes:
            lane.queue.put(None)
            lane.cut()
        started = [lane.thread for lane in self.lanes if lane.thread.is_alive()]
        if started:

            def join() -> None:
                for t in started:
                    t.join(10)

            await asyncio.to_thread(join)


class TcpGrant(Peer):
    """One grant over a `TcpPeer`'s lanes (see `TcpPeer.with_grant`); closing it
    leaves the lanes to the connection."""

    def __init__(self, base: TcpPeer, number: int, info: PeerInfo) -> None:
        self.base, self.number, self.info = base, number, info
        self._check = Grant(info)
        self._closed = False

    async def get(self, batch: ReadBatch | npt.NDArray[np.int64] | Iterable[Sequence[int]]) -> None:
        if self._closed:
            raise TransportClosed(f"get refused: this grant of {self.info.peer_id!r} is closed")
        await self.base.read(batch, self.number, self._check)

    async def update(self, info: PeerInfo) -> None:
        fresh = self.base.with_grant(info)
        self.number, self.info, self._check = fresh.number, info, fresh._check

    async def scoped(self, info: PeerInfo) -> Peer:
        return self.base.with_grant(info)

    def cut(self) -> None:
        self.base.cut()

    async def close(self) -> None:
        self._closed = True
