"""A mirror's feed: its complete chunks, pushed to a downstream relay as they land.

A relay reading from an upstream mirror that still fills must learn which chunks it
may read now. Asking for each (a long-poll, then the records) costs round trips per
chunk; the feed costs one request for the whole version. The downstream opens
``GET /v1/mirrors/{model}/{version}/feed?lease=`` under its lease there, and the
upstream answers a stream of frames (:class:`~refitd.wire.mirrors.MirrorFeed`, each a
4-byte big-endian length and its msgpack): one whenever chunks completed since the
last, and one every ``HEARTBEAT_S`` when none did, so a downstream tells a stopped
upstream from a slow one. Each frame carries the upstream's signed records scoped to
that lease, whose scope is exactly its complete chunks: the downstream reads those
(the data server refuses any other byte) through a grant made from them.

The stream ends after the frame that says the mirror is complete or failed, or when
the lease is no longer live there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import aiohttp
import msgspec
from aiohttp import web

from refitd.client.session import refusal
from refitd.errors import ConflictError, NotFoundError, ProtocolError, RefitError, TransportError
from refitd.wire import MSGPACK, LeaseInfo, PeerRegions
from refitd.wire import routes as api
from refitd.wire.mirrors import MirrorFeed

if TYPE_CHECKING:
    from refitd.daemon.mirror.chunks import Mirror
    from refitd.daemon.pull.peerclient import PeerClient

__all__ = ["HEARTBEAT_S", "MAX_FRAME_BYTES", "LeasedRecords", "follow", "serve_feed"]

HEARTBEAT_S = 2.0
"""Seconds between two frames when no chunk completed (a frame says the upstream
still answers)."""

MAX_FRAME_BYTES = 16 << 20
"""A frame larger than this is refused by the reader (records of 64 regions are a few
KiB)."""


class LeasedRecords(Protocol):
    """What a feed asks of its daemon's lease rules each frame
    (:class:`~refitd.daemon.app.leasing.Leases` is one): nothing else of it."""

    def leased_regions(
        self, ids: list[int] | None, lease_id: str, model: str, version: int
    ) -> PeerRegions:
        """Signed records of ``ids`` read under ``lease_id`` (409: not live on the version)."""
        ...

    def check(self, lease_id: str, model: str, version: int) -> LeaseInfo:
        """The live lease ``lease_id`` on the version (409 otherwise)."""
        ...


def _frame(m: Mirror, d: LeasedRecords, lease_id: str) -> MirrorFeed:
    records = None  # the lease is checked every frame: 409 once it ended
    # Its regions are named once they are all made (they are made one by one): a
    # frame never names part of the layout.
    made = m.ready.is_set() and not m.error
    if made and m.regions:
        ids = [r.region_id for r in m.regions.values()]
        records = d.leased_regions(ids, lease_id, m.model, m.version)
    else:
        d.check(lease_id, m.model, m.version)
    regions = {s: r.region_id for s, r in m.regions.items()} if made else {}
    return MirrorFeed(
        len(m.done), int(m.done.sum()), m.complete, m.error, m.source, regions, records
    )


async def serve_feed(
    request: web.Request, m: Mirror, d: LeasedRecords, lease_id: str
) -> web.StreamResponse:
    """Answer the feed of mirror ``m`` under ``lease_id`` (409 before the stream starts
    when it is not a live lease on its version here), with the records and lease
    checks of ``d``, the daemon's lease rules."""
    first = _frame(m, d, lease_id)
    resp = web.StreamResponse(headers={"Content-Type": MSGPACK})
    await resp.prepare(request)
    frame: MirrorFeed | None = first
    try:
        while frame is not None:
            data = msgspec.msgpack.encode(frame)
            await resp.write(len(data).to_bytes(4, "big") + data)
            if frame.complete or frame.error:
                break
            seen = frame.chunks_done
            loop = asyncio.get_running_loop()
            until = loop.time() + HEARTBEAT_S
            while int(m.done.sum()) == seen and not m.finished and loop.time() < until:
                await m.changed(until - loop.time())
            try:
                frame = _frame(m, d, lease_id)
            except (ConflictError, NotFoundError):
                frame = None  # the lease ended: no more records under it
        await resp.write_eof()
    except ConnectionResetError:
        pass  # its reader has what it came for (its holder's share of the chunks) and left
    return resp


async def follow(
    client: PeerClient, model: str, version: int, lease_id: str, frame_s: float
) -> AsyncIterator[MirrorFeed]:
    """The frames of the feed of ``model`` ``version`` at ``client``'s daemon, under
    ``lease_id`` there; :class:`TimeoutError` when no frame came for ``frame_s``
    seconds, :class:`TransportError` when the stream broke or ended before the mirror
    did, and the daemon's own refusal (by its class) before the first frame."""
    path = api.MIRROR_FEED.url(model=model, version=version)
    url = f"{client.base_url}{path}"
    session = client.open()
    try:
        async with session.get(
            url,
            params={"lease": lease_id},
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=frame_s),
        ) as resp:
            if resp.status != 200:
                raw = await resp.read()
                raise refusal(resp.status, raw, f"GET {path}: HTTP {resp.status}")
            while True:
                async with asyncio.timeout(frame_s):
                    head = await resp.content.readexactly(4)
                    size = int.from_bytes(head, "big")
                    if size > MAX_FRAME_BYTES:
                        raise ProtocolError(f"feed of {url}: a frame of {size} bytes refused")
                    body = await resp.content.readexactly(size)
                frame = msgspec.msgpack.decode(body, type=MirrorFeed)
                yield frame
                if frame.complete or frame.error:
                    return
    except asyncio.IncompleteReadError as exc:
        raise TransportError(f"feed of {url} ended before its mirror did") from exc
    except (aiohttp.ClientError, msgspec.DecodeError) as exc:
        raise TransportError(f"feed of {url} failed: {exc}") from exc
    except RefitError:
        raise
