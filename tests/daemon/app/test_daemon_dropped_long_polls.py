"""Long polls whose clients go away (issue 36's open item).

A long poll (``/ready``, a pull's ``/wait``, a delta's ``wait``, a cluster's ``next``)
counts against its principal's :data:`~refitd.daemon.app.waits.MAX_WAITS_PER_PRINCIPAL`
while it waits. A client that drops the connection must give its place back at
once, not when the wait times out: otherwise a tenant that opens and drops long
polls in a loop holds the cap for a minute after each drop, and a principal whose
engine restarts finds its own waits refused (429) until then.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from support.tenants import headers, two_tenants, until

from refitd.daemon.app.waits import MAX_WAIT_S, MAX_WAITS_PER_PRINCIPAL, WAITS
from refitd.wire import ManifestIn, ShardEntry, TensorEntry

pytestmark = pytest.mark.timeout(120)

ELEMS = 1024


async def test_long_polls_dropped_by_their_client_give_their_places_back(
    tmp_path: Path,
) -> None:
    """b fills its cap with ``/ready`` long polls on a's pending version, then drops
    every connection. The daemon counts none of them soon after (long before a wait's
    own timeout), b's next long poll is held again (not 429), and a's version still
    becomes READY and answers it."""
    async with two_tenants(tmp_path, node_id="dropped-polls") as t:
        a = t.a
        region = (await a.create_region(4 * ELEMS, label="am")).region_id
        part = [TensorEntry("w", (ELEMS,), "bfloat16", [ShardEntry((0,), (ELEMS,), region, 0)])]
        await a.publish(ManifestIn("am", 1, 0, 2, part))  # one part of two: pending
        url = t.served.url + f"/v1/sources/am/versions/1/ready?timeout={MAX_WAIT_S:g}"
        waits = t.served.app[WAITS]

        dropped = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        polls = [
            asyncio.ensure_future(dropped.get(url, headers=headers("b")))
            for _ in range(MAX_WAITS_PER_PRINCIPAL)
        ]
        await until(lambda: waits.open("b") == MAX_WAITS_PER_PRINCIPAL)
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        await dropped.close()  # every connection closed: b is gone

        await until(lambda: waits.open("b") == 0)

        async with aiohttp.ClientSession() as http:
            again = asyncio.ensure_future(http.get(url, headers=headers("b")))
            await until(lambda: waits.open("b") == 1 or again.done())
            assert not again.done(), (await again).status  # held, not refused
            await a.publish(ManifestIn("am", 1, 1, 2, part))  # the last part: READY
            async with await again as r:
                assert r.status == 200, await r.text()
                assert (await r.json(content_type=None))["state"] == "ready"
        assert waits.open("b") == 0
