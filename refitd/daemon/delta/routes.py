"""The HTTP side of delta refit (:mod:`refitd.daemon.delta.source`): a version's delta record
and the staging of a planned pull's changed units under its lease
(:mod:`refitd.daemon.delta.selection`)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from refitd.daemon.access.auth import principal_of
from refitd.daemon.app.httpio import RouteTable, body, reply
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.waits import WAITS, long_poll
from refitd.daemon.delta.selection import pack_request
from refitd.daemon.delta.source import DeltaBook
from refitd.daemon.delta.stream import opened
from refitd.wire import MSGPACK, DeltaPackRequest, DeltaStreamRequest
from refitd.wire import routes as api
from refitd.wire.args import DeltaInfoArgs

__all__ = ["DELTAS", "routes", "setup_deltas"]

DELTAS: web.AppKey[DeltaBook] = web.AppKey("deltas", DeltaBook)
routes = RouteTable()


@routes.handles(api.DELTA_INFO)
async def delta_info(request: web.Request, args: DeltaInfoArgs) -> web.Response:
    """A version's delta record; ``wait=S`` waits up to S seconds (at most 60) for a
    comparison still running."""
    model, version, who = args.model, args.version, principal_of(request)
    held = long_poll(request, f"waiting for {model!r} v{version}")
    return reply(request, await request.app[DELTAS].info(who, model, version, args.wait, held))


@routes.handles(api.DELTA_PACK)
async def delta_pack(request: web.Request) -> web.Response:
    """Stage a planned pull's changed units under its lease, as ``/v1/peer/pack`` stages
    packed blocks: the staging region counts against the lease's principal."""
    req = await body(request, DeltaPackRequest)
    staged = await pack_request(request.app[DELTAS], req, principal_of(request).name)
    return reply(request, staged, 201)


@routes.handles(api.DELTA_STREAM)
async def delta_stream(request: web.Request) -> web.StreamResponse:
    """A planned pull's changed units under its lease, as ``delta_pack`` selects them,
    streamed chunk by chunk as they are encoded, not staged (docs/delta.md). Every
    refusal comes before the head; a chunk that fails ends the stream with a frame
    saying why."""
    req = await body(request, DeltaStreamRequest)
    async with opened(request.app[DELTAS], req, principal_of(request).name) as (head, chunks):
        resp = web.StreamResponse(headers={"Content-Type": MSGPACK})
        await resp.prepare(request)
        await resp.write(_frame(head))
        async for chunk, payload in chunks:
            # While this chunk crosses, the next one is encoded in the pool.
            await resp.write(_frame(chunk))
            await resp.write(payload.data)
        await resp.write_eof()
    return resp


def _frame(value: msgspec.Struct) -> bytes:
    data = msgspec.msgpack.encode(value)
    return len(data).to_bytes(4, "big") + data


def setup_deltas(app: web.Application, daemon: Daemon) -> DeltaBook:
    """Install the daemon's :class:`DeltaBook` and its routes on ``app``; the book
    hears of the daemon's versions from now on (published, drained)."""
    book = app[DELTAS] = DeltaBook(
        daemon.registry,
        daemon.store,
        daemon.staging,
        daemon.drain,
        daemon.models,
        max_bytes=daemon.config.pulls.delta_max_bytes,
        enabled=daemon.config.pulls.deltas,
        waits=app[WAITS],
        max_plan_runs=daemon.config.limits.max_plan_runs,
    )
    daemon.events.listen(book)

    async def close(_: web.Application) -> None:
        await book.close()

    app.on_shutdown.append(close)
    app.add_routes(routes)
    return book
