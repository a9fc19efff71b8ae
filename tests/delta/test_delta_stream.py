"""A streamed delta (``POST /v1/deltas/stream``): the plan's stream cut into chunks,
each encoded by the source and placed by the engine while the next one crosses.

- Hypothesis: source and engine cut the same stream with one function; a delta
  staged and placed chunk by chunk leaves the engine what one whole delta leaves.
- A real daemon, chunks of 4 KiB: every delta lands exact over many chunks.
- A stream broken after its first chunk (a proxy in front of the real daemon cuts
  the connection: the one fault the daemon cannot be made to produce) fails the
  refit naming the chunk, with every unit placed before it put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import torch
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from support.daemons import served, serving_app
from support.deltas import Change, DoubleBuffered, changed
from support.engines import mismatched, zeroed_engine

from refitd.bench.refit import capture_for
from refitd.client.deltarefit import DeltaReceiver
from refitd.client.deltastream import StreamBroken
from refitd.client.http import RefitClient
from refitd.delta import native
from refitd.delta.diff import compare_chunk, unit_dtype
from refitd.delta.stream import ChangeIndex, chunking, cut, layout
from refitd.testing.engines import EngineParallel, ToyEngine, dense_toy_config
from refitd.testing.layouts import full_state, megatron_tp_ep
from refitd.wire import DeltaChunk

pytestmark = [pytest.mark.timeout(120)]

CFG = dense_toy_config(torch.bfloat16)
PAR = EngineParallel(2, 1, 1)


def _place(
    engine: np.ndarray, payload: np.ndarray, st_: tuple[int, ...], part: np.ndarray, unit: int
) -> None:
    pages, changed_, exc, _units, bits = st_
    lay = layout(pages, changed_, exc, unit, bits)
    idx, _old, new = native.place(
        payload[:pages],
        payload[lay.low : lay.low + changed_],
        payload[lay.diff : lay.exceptions].view(np.int8),
        payload[lay.exceptions : lay.exceptions + unit * exc].view(unit_dtype(unit)),
        part,
        engine,
        unit,
        bits,
    )
    native.scatter(engine, idx, new)


@given(
    unit=st.sampled_from([1, 2, 4, 8]),
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=6),
    frac=st.sampled_from([0.0, 0.03, 0.5, 1.0]),
    chunk_units=st.integers(1, 900),
    seed=st.integers(0, 2**32 - 1),
    nibbles=st.booleans(),
)
@settings(max_examples=80, deadline=None)
def test_a_delta_staged_and_placed_chunk_by_chunk_leaves_what_one_whole_delta_leaves(
    unit: int, sizes: list[int], frac: float, chunk_units: int, seed: int, nibbles: bool
) -> None:
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    old = rng.integers(0, 256, total * unit, dtype=np.uint8)
    new = old.copy()
    u = new.view(unit_dtype(unit))
    mask = rng.random(len(u)) < frac
    u[mask] += rng.integers(1, 300, int(mask.sum())).astype(u.dtype)
    at, o, n = compare_chunk(old, new, unit)
    index = ChangeIndex.of({3: at})
    values = np.stack([o.reshape(-1, unit), n.reshape(-1, unit)], axis=1).reshape(-1)
    # The source reads its region in one order, the engine lands each read elsewhere.
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * unit
    order = rng.permutation(len(sizes))
    reads = np.array([(3, starts[i], sizes[i] * unit) for i in order], np.int64).reshape(-1, 3)
    pieces = np.array([(7, starts[i], sizes[i] * unit) for i in order], np.int64).reshape(-1, 3)

    whole = old.copy()
    payload, staged = native.stage(index, values, reads, unit, nibbles)
    _place(whole, payload, staged, pieces, unit)
    assert whole.tobytes() == new.tobytes()

    chunked = old.copy()
    per, chunks = chunking(total, chunk_units * unit, unit)
    for k in range(chunks):
        lo, hi = k * per * unit, min((k + 1) * per, total) * unit
        part_reads, part_pieces = cut(reads, lo, hi), cut(pieces, lo, hi)
        assert part_reads[:, 2].tolist() == part_pieces[:, 2].tolist()
        assert int(part_pieces[:, 2].sum()) == hi - lo
        payload, staged = native.stage(index, values, part_reads, unit, nibbles)
        _place(chunked, payload, staged, part_pieces, unit)
    assert chunked.tobytes() == new.tobytes()


def layout_of(state: dict[str, torch.Tensor]) -> Any:
    return megatron_tp_ep(CFG, 2, 1, state)


def receiver(source: RefitClient, local: RefitClient, **kw: Any) -> DeltaReceiver:
    return DeltaReceiver(
        local=local,
        source=source,
        model="m",
        engine=zeroed_engine(CFG, PAR),
        twin=lambda: ToyEngine(CFG, PAR),
        capture=capture_for(layout_of(full_state(CFG, seed=0))),
        max_reads_per_copy=2,
        chunk_bytes=4096,
        **kw,
    )


async def test_deltas_streamed_in_many_chunks_land_exact() -> None:
    async with served(deltas=True) as s:
        trainer = DoubleBuffered(s.client, "m", layout_of)
        state = full_state(CFG, seed=3)
        await trainer.publish(1, state)
        r = receiver(s.client, s.client)
        await r.refit(1)
        for v in (2, 3, 4):
            state = changed(state, Change("some", 0.1, v))
            await trainer.publish(v, state)
            await r.refit(v)
            assert r.last is not None and r.last.kind == "delta", r.last
            assert r.last.refit.pull.descriptors_total > 2  # the chunks it came in
            assert mismatched(r.engine, CFG, PAR, state) == []
        await r.close()


@contextlib.asynccontextmanager
async def proxy(upstream: str, broken: list[bool]) -> AsyncIterator[str]:
    """A proxy to ``upstream`` that, while ``broken[0]``, cuts a delta stream's
    connection after its head and first chunk and a few bytes of the next."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        keep = ("Authorization", "Content-Type", "Accept")
        headers = {h: request.headers[h] for h in keep if h in request.headers}
        async with session.request(
            request.method,
            upstream + request.path_qs,
            data=await request.read(),
            headers=headers,
            allow_redirects=False,
        ) as up:
            stream = request.path.endswith("/deltas/stream") and up.status == 200
            if not (stream and broken[0]):
                return web.Response(body=await up.read(), status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json")})  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": up.headers["Content-Type"]})
            await resp.prepare(request)
            for frame in range(2):  # the head, then chunk 0 and its payload
                size = await up.content.readexactly(4)
                body = await up.content.readexactly(int.from_bytes(size, "big"))
                await resp.write(size + body)
                if frame == 1:
                    chunk = msgspec.msgpack.decode(body, type=DeltaChunk)
                    await resp.write(await up.content.readexactly(chunk.nbytes))
            await resp.write(await up.content.readexactly(6))
            assert request.transport is not None
            request.transport.close()  # the connection breaks mid-chunk 1
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    try:
        async with serving_app(app) as url:
            yield url
    finally:
        await session.close()


async def test_a_stream_broken_mid_delta_fails_naming_the_chunk_with_every_unit_put_back() -> None:
    broken = [False]
    async with served(deltas=True) as s, proxy(s.url, broken) as url, RefitClient(url) as via:
        trainer = DoubleBuffered(s.client, "m", layout_of)
        state = full_state(CFG, seed=5)
        await trainer.publish(1, state)
        r = receiver(via, via)
        await r.refit(1)
        before = {n: p.detach().clone() for n, p in r.engine.named_parameters()}
        s2 = changed(state, Change("some", 0.3, 2))
        await trainer.publish(2, s2)
        broken[0] = True
        with pytest.raises(StreamBroken, match="chunk 1 of") as err:
            await r.refit(2)
        assert err.value.chunk == 1
        # Chunk 0 was placed, then put back: every parameter holds its v1 bytes.
        for n, p in r.engine.named_parameters():
            assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
        assert r.base_version == 1
        broken[0] = False
        await r.refit(2)  # the base intact (digest included): the same delta lands
        assert r.last is not None and r.last.kind == "delta", r.last
        assert mismatched(r.engine, CFG, PAR, s2) == []
        await r.close()
