"""A streamed delta, the engine side: ``POST /v1/deltas/stream`` read frame by frame.

The source cuts the plan's stream into chunks and sends each chunk's changed units
as soon as they are encoded, while it encodes the next (docs/delta.md). This
module reads the frames (:func:`open_stream`) and checks that they are the chunks
the engine asked for, in order, of the sizes a chunk can have, before any is
placed. A stream that breaks, or a chunk the source failed, raises
:class:`StreamBroken` naming the chunk: the receiver then puts back every unit it
placed (its undo log) and holds its base.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import numpy as np
import numpy.typing as npt

from refitd.client.session import ApiSession, refusal
from refitd.delta.stream import PAGE, chunking
from refitd.errors import ProtocolError, RefitError
from refitd.wire import (
    MSGPACK,
    DeltaChunk,
    DeltaStreamHead,
    DeltaStreamRequest,
    DescriptorTable,
)
from refitd.wire import routes as api

__all__ = ["MAX_FRAME_BYTES", "Encoded", "StreamBroken", "chunk_bound", "open_stream"]

MAX_FRAME_BYTES = 1 << 16
"""A head or chunk frame (without its payload) larger than this is refused."""


class StreamBroken(RefitError):
    """A streamed delta stopped before its last chunk (``chunk``: the first chunk
    that did not arrive whole); nothing after it was placed."""

    status = 502

    def __init__(self, message: str, chunk: int) -> None:
        super().__init__(message)
        self.chunk = chunk


def chunk_bound(units: int, unit: int) -> int:
    """The most payload bytes a chunk of ``units`` units can take: every unit an
    exception (its position, its escaped difference and the unit), plus page
    counts and each part's alignment."""
    return units * (2 + unit) + units // PAGE + 4 * 64 + 64


class _Frames:
    def __init__(self, resp: aiohttp.ClientResponse, url: str) -> None:
        self.resp, self.url = resp, url

    async def frame(self, type_: type[Any], what: str) -> Any:
        head = await self.resp.content.readexactly(4)
        size = int.from_bytes(head, "big")
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"delta stream of {self.url}: {what} of {size} bytes refused")
        return msgspec.msgpack.decode(await self.resp.content.readexactly(size), type=type_)


@contextlib.asynccontextmanager
async def open_stream(
    client: ApiSession, req: DeltaStreamRequest, nbytes: int, plan: str = ""
) -> AsyncIterator[tuple[DeltaStreamHead, AsyncIterator[tuple[DeltaChunk, npt.NDArray[np.uint8]]]]]:
    """The head of the delta ``req`` asks for and its chunks, each with its payload,
    for an engine whose plan streams ``nbytes`` bytes. With ``plan``, the name the
    source answered ``req``'s plan with before, the request names it instead of
    sending the plan, and sends it only if the source no longer keeps it (404). A
    refusal before the head raises the daemon's error by its class (409: no delta
    from that base); a head that does not describe that stream, in chunks of
    ``req.chunk_bytes``, a :class:`ProtocolError`; a chunk out of order, too large,
    failed at the source or cut short, :class:`StreamBroken`."""
    path = api.DELTA_STREAM.url()
    url = f"{client.base_url}{path}"
    named = msgspec.structs.replace(req, descriptors=DescriptorTable(b""), pack_specs=[], plan=plan)

    def post(body: DeltaStreamRequest) -> Any:
        data = msgspec.msgpack.encode(body)
        headers = {"Content-Type": MSGPACK}
        return client.open().post(url, data=data, headers=headers, allow_redirects=False)

    try:
        async with contextlib.AsyncExitStack() as stack:
            resp = await stack.enter_async_context(post(named if plan else req))
            if resp.status == 404 and plan:  # not kept there any more: send it
                await stack.aclose()
                resp = await stack.enter_async_context(post(req))
            if resp.status != 200:
                raise refusal(resp.status, await resp.read(), f"POST {path}: HTTP {resp.status}")
            frames = _Frames(resp, url)
            head: DeltaStreamHead = await frames.frame(DeltaStreamHead, "a head")
            unit = max(head.unit, 1)
            per, n = chunking(head.stream_units, req.chunk_bytes, unit)
            if (head.stream_units * unit, head.chunk_units, head.chunks) != (nbytes, per, n):
                raise ProtocolError(
                    f"delta stream of {url} refused: its head describes {head.chunks} chunks "
                    f"of {head.chunk_units} units of {head.unit} bytes of a stream of "
                    f"{head.stream_units} units; this plan streams {nbytes} bytes in chunks "
                    f"of {req.chunk_bytes}"
                )
            yield head, _chunks(frames, head)
    except aiohttp.ClientError as exc:
        raise StreamBroken(f"delta stream of {url} failed: {exc}", -1) from exc


async def _chunks(
    frames: _Frames, head: DeltaStreamHead
) -> AsyncIterator[tuple[DeltaChunk, npt.NDArray[np.uint8]]]:
    for k in range(head.chunks):
        what = f"delta stream of {frames.url}: chunk {k} of {head.chunks}"
        try:
            chunk: DeltaChunk = await frames.frame(DeltaChunk, f"chunk {k}'s frame")
            if chunk.error:
                raise StreamBroken(f"{what} failed at the source: {chunk.error}", k)
            units = min(head.chunk_units, head.stream_units - k * head.chunk_units)
            if chunk.index != k or not 0 <= chunk.nbytes <= chunk_bound(units, head.unit):
                raise StreamBroken(
                    f"{what} refused: the source sent chunk {chunk.index} of "
                    f"{chunk.nbytes} bytes (at most {chunk_bound(units, head.unit)})",
                    k,
                )
            payload = await frames.resp.content.readexactly(chunk.nbytes)
        except asyncio.IncompleteReadError as exc:
            raise StreamBroken(f"{what} was cut short: the stream ended", k) from exc
        except (aiohttp.ClientError, msgspec.DecodeError, ProtocolError) as exc:
            raise StreamBroken(f"{what} failed: {exc}", k) from exc
        yield chunk, np.frombuffer(payload, np.uint8)


@dataclass(frozen=True)
class Encoded:
    """A chunk of a streamed delta as the receiver's apply reads it: the
    encoded parts' sizes, and which units of the plan's stream it covers."""

    index: int
    pages: int
    changed: int
    exceptions: int
    diff_bits: int
    unit: int
    base_version: int
    first: int
    units: int

    @staticmethod
    def of(chunk: DeltaChunk, head: DeltaStreamHead) -> Encoded:
        first = chunk.index * head.chunk_units
        units = min(head.chunk_units, head.stream_units - first)
        return Encoded(
            chunk.index, chunk.pages, chunk.changed, chunk.exceptions, chunk.diff_bits,
            head.unit, head.base_version, first, units,
        )  # fmt: skip
