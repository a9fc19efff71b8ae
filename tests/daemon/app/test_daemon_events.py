"""The daemon's version events (:mod:`refitd.daemon.state.events`): what a listener,
added as the app is built, hears of publishes, drains and retires, on a real daemon
served on loopback and driven over real HTTP; and the two listeners the app adds, the
delta book and the cluster registry's records, in their order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from support.daemons import Served, served
from support.tenants import until

from refitd.daemon.app.handlers import DAEMON
from refitd.daemon.app.membership import Membership
from refitd.daemon.delta.source import DeltaBook
from refitd.daemon.state.events import VersionListener
from refitd.errors import ConflictError, NotFoundError, ProtocolError
from refitd.wire import ManifestIn, ShardEntry, TensorEntry, VersionInfo, VersionState

pytestmark = pytest.mark.timeout(60)

NBYTES = 64

Heard = tuple[str, str, int] | tuple[str, str, int, VersionState]


class Recorder(VersionListener):
    """Every event it hears, in order."""

    def __init__(self) -> None:
        self.heard: list[Heard] = []

    async def published(self, info: VersionInfo) -> None:
        self.heard.append(("published", info.model, info.version, info.state))

    def draining(self, model: str, version: int) -> None:
        self.heard.append(("draining", model, version))

    async def retired(self, model: str, version: int) -> None:
        self.heard.append(("retired", model, version))


@contextlib.asynccontextmanager
async def listened() -> AsyncIterator[tuple[Served, Recorder, int]]:
    """A daemon served with a :class:`Recorder` among its version listeners (added as
    its app is built, after the app's own), and a region of :data:`NBYTES` to publish."""
    recorder = Recorder()
    hooks = [lambda app: app[DAEMON].events.listen(recorder)]
    async with served(setup=hooks, transport="shm", node_id="events") as s:
        region = await s.client.create_region(NBYTES)
        yield s, recorder, region.region_id


def part(
    region: int, version: int, part: int = 0, parts: int = 1, nbytes: int = NBYTES
) -> ManifestIn:
    shard = ShardEntry((0,), (nbytes,), region, 0)
    return ManifestIn("m", version, part, parts, [TensorEntry("w", (nbytes,), "uint8", [shard])])


async def test_a_listener_hears_each_published_part_once_in_order_with_its_versions_state() -> None:
    async with listened() as (s, recorder, region):
        await s.client.publish(part(region, 1, 0, 2))
        await s.client.publish(part(region, 1, 1, 2))
        await s.client.publish(part(region, 2))
        assert recorder.heard == [
            ("published", "m", 1, VersionState.PENDING),
            ("published", "m", 1, VersionState.READY),
            ("published", "m", 2, VersionState.READY),
        ]


async def test_a_refused_publish_is_heard_by_no_listener() -> None:
    async with listened() as (s, recorder, region):
        # Refused before the registry takes it (a shard past its region's end) ...
        with pytest.raises(ProtocolError):
            await s.client.publish(part(region, 1, nbytes=NBYTES + 1))
        assert recorder.heard == []
        await s.client.publish(part(region, 1))
        # ... and by the registry (a READY version never changes).
        with pytest.raises(ConflictError):
            await s.client.publish(part(region, 1))
        assert recorder.heard == [("published", "m", 1, VersionState.READY)]


async def test_a_retiring_drain_is_heard_draining_then_retired_once_and_a_plain_drain_draining_only() -> (
    None
):
    async with listened() as (s, recorder, region):
        await s.client.publish(part(region, 1))
        await s.client.publish(part(region, 2))
        recorder.heard.clear()
        info = await s.client.wait_drain("m", 1, timeout_s=5, retire=True)
        assert info.state is VersionState.RETIRED
        await s.client.wait_drain("m", 2, timeout_s=5)
        assert recorder.heard == [("draining", "m", 1), ("retired", "m", 1), ("draining", "m", 2)]


async def test_a_retiring_drain_that_times_out_is_still_heard_retired_and_leaves_the_cluster() -> (
    None
):
    """The version stays leased past the drain's timeout (409): it was retired as the
    drain began all the same, so the listeners hear it, and the cluster registry's
    records of this daemon no longer list it."""
    async with listened() as (s, recorder, region):
        await s.client.publish(part(region, 1))
        assert (await s.client.cluster_version("m", 1)).holders
        await s.client.acquire_lease("m", 1)
        with pytest.raises(ConflictError, match="still holds 1 lease"):
            await s.client.wait_drain("m", 1, timeout_s=0.05, retire=True)
        assert recorder.heard[1:] == [("draining", "m", 1), ("retired", "m", 1)]
        with pytest.raises(NotFoundError):
            await s.client.cluster_version("m", 1)
        with pytest.raises(ConflictError):
            await s.client.acquire_lease("m", 1)  # retired: no new lease


async def test_a_drain_of_an_unknown_version_is_heard_by_no_listener() -> None:
    async with listened() as (s, recorder, _):
        with pytest.raises(NotFoundError):
            await s.client.wait_drain("m", 9, timeout_s=1, retire=True)
        assert recorder.heard == []


async def test_a_retiring_drain_whose_client_left_is_still_heard_retired() -> None:
    """The drain waits on a lease; its client drops the connection. The version was
    retired before the drain's first await, and once the daemon ends the wait (its
    client gone) the listeners hear ``retired``, as a drain that ended by itself."""
    async with listened() as (s, recorder, region):
        await s.client.publish(part(region, 1))
        await s.client.acquire_lease("m", 1)
        url = f"{s.url}/v1/sources/m/versions/1/drain?timeout=60&retire=1"
        async with aiohttp.ClientSession() as http:
            drain = asyncio.ensure_future(http.post(url))
            await until(lambda: ("draining", "m", 1) in recorder.heard)
            assert s.daemon.registry.version("m", 1).state is VersionState.RETIRED
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
        await until(lambda: ("retired", "m", 1) in recorder.heard)
        assert recorder.heard[1:] == [("draining", "m", 1), ("retired", "m", 1)]


async def test_the_app_tells_the_delta_book_before_the_cluster_registry() -> None:
    """A version that became READY is held as the next one's base before the
    registry is told of it (and before a listener that fails could stop the telling)."""
    async with listened() as (s, _, _):
        kinds = [type(listener) for listener in s.daemon.events.listeners]
        assert kinds == [DeltaBook, Membership, Recorder]
