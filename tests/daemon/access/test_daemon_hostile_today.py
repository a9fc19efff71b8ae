"""Today's surfaces of the daemon, attacked by a hostile tenant (issue 36's standard:
fail closed).

Long polls: one whose client disconnects is cancelled (``waits.long_poll``). Only the
wait may end with it: the pull a ``/wait`` waits for runs on to its end, byte-exact,
and one tenant can neither wait on (so neither cancel the wait of) another's pull,
nor end another tenant's waits by dropping its own. A client that stops waiting for
its own pull cancels it at the daemon, so it writes nothing later.

The lease-scoped same-host record: the reader maps a source's segment whole, and
reads of it stay inside what the lease's version publishes.

Real daemons on 127.0.0.1:0 (two token tenants where tenants matter), real HTTP,
real shared memory; a pull is held mid-copy by :class:`~support.daemons.GatedCopier`
(the daemon's own copy engine behind a gate).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from support.daemons import GatedCopier, daemon_config, serving_daemons
from support.tenants import SAFETY_S, headers, publish_bytes, pull_request, two_tenants, until

from refitd.client.http import RefitClient
from refitd.daemon.app.node import Daemon
from refitd.daemon.app.waits import MAX_WAIT_S, WAITS, Waits
from refitd.errors import AccessDenied
from refitd.wire import PullRequest, PullState
from transports.segments import SharedSegment

pytestmark = pytest.mark.timeout(120)

NBYTES = 4096


@dataclass
class Tenants:
    url: str
    a: RefitClient
    b: RefitClient
    waits: Waits
    copier: GatedCopier
    dst: SharedSegment
    pull_id: str

    def wait_url(self, timeout_s: float = MAX_WAIT_S) -> str:
        return f"{self.url}/v1/pulls/{self.pull_id}/wait?timeout={timeout_s:g}"


@pytest.fixture
async def tenants(tmp_path: Path) -> AsyncIterator[Tenants]:
    """a publishes version 1 of ``am`` (bytes 0x5A) and submits a pull of it into a
    region of its own, held mid-copy at the gate; b is another tenant."""
    copier = GatedCopier()
    daemon = Daemon(daemon_config(node_id="hostile-today", transport="shm"), copier=copier)
    async with two_tenants(tmp_path, daemon) as t:
        a = t.a
        src = await a.create_region(NBYTES, label="src")
        SharedSegment.attach(src.handle, NBYTES).numpy()[:] = 0x5A
        await publish_bytes(a, "am", 1, src.region_id, NBYTES)
        out = await a.create_region(NBYTES, label="dst")
        dst = SharedSegment.attach(out.handle, NBYTES)
        lease = await a.acquire_lease("am", 1)
        rows = [(src.region_id, 0, out.region_id, 0, NBYTES)]
        job = await a.submit_pull(pull_request(lease, rows))
        async with asyncio.timeout(SAFETY_S):
            await copier.entered.wait()  # the pull is mid-copy
        yield Tenants(t.served.url, a, t.b, t.served.app[WAITS], copier, dst, job.pull_id)
        copier.gate.set()


async def test_a_pull_whose_waiter_disconnects_runs_on_to_its_end_byte_exact(
    tenants: Tenants,
) -> None:
    """a waits for its pull in a long poll and drops the connection mid-copy: the wait
    ends and gives its place back, the pull does not: it is still running, and once
    the copy goes on it ends DONE with every byte."""
    t = tenants
    dropped = aiohttp.ClientSession()
    poll = asyncio.ensure_future(dropped.get(t.wait_url(), headers=headers("a")))
    await until(lambda: t.waits.open("a") == 1)
    poll.cancel()
    await asyncio.gather(poll, return_exceptions=True)
    await dropped.close()
    await until(lambda: t.waits.open("a") == 0)

    assert (await t.a.pull_status(t.pull_id)).state is PullState.RUNNING
    t.copier.gate.set()
    async with asyncio.timeout(SAFETY_S):
        done = await t.a.wait_pull(t.pull_id)
    assert done.state is PullState.DONE
    assert (t.dst.numpy() == 0x5A).all()


async def test_another_tenant_can_neither_wait_on_a_pull_nor_end_its_owners_wait(
    tenants: Tenants,
) -> None:
    """b asks to wait on a's pull (refused, 4xx, holding no place), then opens long
    polls of its own and drops them all: a's wait on its pull is still held, the pull
    still runs, and a's wait is answered DONE when the copy goes on."""
    t = tenants
    async with (
        aiohttp.ClientSession() as http,
        http.get(t.wait_url(), headers=headers("b")) as r,
    ):
        assert r.status in (403, 404), await r.text()
        assert "error" in await r.json(content_type=None)
    assert t.waits.open("b") == 0

    owners = asyncio.ensure_future(t.a.wait_pull(t.pull_id, interval_s=MAX_WAIT_S))
    await until(lambda: t.waits.open("a") == 1)
    dropped = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    ready = f"{t.url}/v1/sources/am/versions/2/ready?timeout={MAX_WAIT_S:g}"
    polls = [asyncio.ensure_future(dropped.get(ready, headers=headers("b"))) for _ in range(8)]
    await until(lambda: t.waits.open("b") == len(polls))
    for p in polls:
        p.cancel()
    await asyncio.gather(*polls, return_exceptions=True)
    await dropped.close()
    await until(lambda: t.waits.open("b") == 0)

    assert not owners.done()
    assert t.waits.open("a") == 1
    assert (await t.a.pull_status(t.pull_id)).state is PullState.RUNNING
    t.copier.gate.set()
    async with asyncio.timeout(SAFETY_S):
        done = await owners
    assert done.state is PullState.DONE
    assert (t.dst.numpy() == 0x5A).all()


async def test_a_client_pull_whose_wait_ends_before_the_pull_cancels_it_at_the_daemon(
    tenants: Tenants,
) -> None:
    """a's ``pull`` stops waiting while its pull is held mid-copy (its progress
    callback raises): the client cancels the pull at the daemon before it re-raises,
    so it writes nothing later; a's other pull, still waited for, runs on to DONE."""
    t = tenants
    out = await t.a.create_region(NBYTES, label="dst2")
    second = SharedSegment.attach(out.handle, NBYTES)
    second.numpy()[:] = 0xA5
    src = next(r for r in await t.a.regions() if r.label == "src")
    lease = await t.a.acquire_lease("am", 1)
    rows = [(src.region_id, 0, out.region_id, 0, NBYTES)]

    def gave_up(_: object) -> None:
        raise RuntimeError("the caller stopped waiting")

    with pytest.raises(RuntimeError, match="stopped waiting"):
        await t.a.pull(pull_request(lease, rows), on_progress=gave_up)
    states = {p.pull_id: p.state for p in await t.a.pulls()}
    assert states.pop(t.pull_id) is PullState.RUNNING
    assert list(states.values()) == [PullState.CANCELLED]
    t.copier.gate.set()
    async with asyncio.timeout(SAFETY_S):
        done = await t.a.wait_pull(t.pull_id)
    assert done.state is PullState.DONE
    assert (second.numpy() == 0xA5).all()  # the cancelled pull wrote nothing


async def test_a_same_host_pull_never_reads_the_part_of_a_mapped_region_its_version_does_not_publish() -> (
    None
):
    """A reader's daemon maps a same-host source's segment whole (``shm``), but the
    version publishes only its first half: a pull of a byte of the other half, under
    a live lease on that version, is refused (403) before any byte moves, and the
    first half's bytes still arrive."""
    secret = b"k" * 32
    src_d = Daemon(daemon_config(node_id="src"), secret=secret)
    dst_d = Daemon(daemon_config(node_id="dst"), secret=secret)
    async with serving_daemons(src_d, dst_d) as (cs, cd):
        info = await cs.create_region(2 * NBYTES, label="half")
        seg = SharedSegment.attach(info.handle, info.nbytes)
        seg.numpy()[:NBYTES] = 0x11
        seg.numpy()[NBYTES:] = 0x99  # in the segment, in no version
        await publish_bytes(cs, "h", 1, info.region_id, NBYTES)
        lease = await cs.acquire_lease("h", 1)
        out = await cd.create_region(NBYTES, label="dst")
        dst = SharedSegment.attach(out.handle, NBYTES)
        dst.numpy()[:] = 0xA5

        def req(offset: int) -> PullRequest:
            return pull_request(lease, [(info.region_id, offset, out.region_id, 0, 8)], cs.base_url)

        with pytest.raises(AccessDenied):
            await cd.submit_pull(req(NBYTES))
        with pytest.raises(AccessDenied):
            await cd.submit_pull(req(NBYTES - 4))  # straddles the edge
        assert (dst.numpy() == 0xA5).all()
        assert (await cd.pull(req(0))).state is PullState.DONE
        assert (dst.numpy()[:8] == 0x11).all()
        assert dst_d.seen_paths["src"][0] == "shm"  # read through the whole mapping


async def test_a_non_reader_is_refused_a_version_and_its_manifest_alike_whether_it_exists(
    tmp_path: Path,
) -> None:
    """With ``[models] readers`` naming a alone for ``rm``, b asks for v1 (READY), v9
    (never published) and ``latest``: its state and its manifest, as JSON and as
    msgpack. Every answer is the same 403 in the error shape, so b learns neither the
    bytes' layout nor which versions exist; a reads v1."""
    async with two_tenants(tmp_path, node_id="readers", transport="shm", readers=("rm=a",)) as t:
        a = t.a
        src = await a.create_region(NBYTES, label="rm")
        await publish_bytes(a, "rm", 1, src.region_id, NBYTES)
        answers = set()
        async with aiohttp.ClientSession() as http:
            for version in ("1", "9", "latest"):
                for tail in ("", "/manifest"):
                    for accept in ("application/json", "application/msgpack"):
                        url = f"{t.served.url}/v1/sources/rm/versions/{version}{tail}"
                        h = {**headers("b"), "Accept": accept}
                        async with http.get(url, headers=h) as r:
                            body = await r.read()
                            answers.add((r.status, b"AccessDenied" in body))
        assert answers == {(403, True)}
        assert (await a.version("rm", 1)).state.value == "ready"
        assert (await a.manifest("rm", 1)).tensors[0].name == "w"
