"""A host's mirror budget (``refitd.daemon.mirror.space``): what making room frees.

A mirror that failed keeps an entry in the table of reads held on filling mirrors
(``FillingMirrors``), so a read held on it is refused with the mirror's error. When
its regions are freed, the entry must go with them, whichever path frees them: the
sweep after a version ends, or a new mirror making room in the budget.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from support.daemons import served

from refitd.daemon.app.node import Daemon
from refitd.daemon.mirror.chunks import Mirror
from refitd.daemon.mirror.hold import FillingMirrors
from refitd.daemon.mirror.leases import OWNER
from refitd.daemon.mirror.space import make_room, take_over
from refitd.errors import ConflictError
from refitd.wire import ManifestIn, RegionCreate, ShardEntry, TensorEntry, VersionState

pytestmark = pytest.mark.timeout(60)

NBYTES = 4096


async def test_making_room_frees_a_failed_mirror_and_forgets_the_reads_held_on_it() -> None:
    """A failed mirror holds the whole budget; a new mirror asks for room. Its
    region is deleted, the mirror leaves the book, and no read of its region is
    held or refused in its name any more."""
    async with served() as s:
        d = s.daemon
        region = await d.store.create_region(RegionCreate(NBYTES, label="mirror"))
        shard = ShardEntry((0,), (NBYTES,), region.region_id, 0)
        d.registry.publish(
            ManifestIn("m", 1, 0, 1, [TensorEntry("w", (NBYTES,), "uint8", [shard])])
        )
        failed = Mirror("http://source", "m", 1, regions={0: region}, nbytes=NBYTES)
        failed.error = "the source went away"
        d.registry.retire("m", 1)  # as a failed mirror's version is: no lease on it
        filling = FillingMirrors()
        filling.add(failed)
        one = (np.array([region.region_id]), np.zeros(1, np.int64), np.ones(1, np.int64))
        assert "went away" in (filling.wait(*one, timeout_s=0) or "")
        book = {("http://source", "m", 1): failed}

        new = Mirror("http://source", "m", 2)
        assert await make_room(d.registry, d.store, book, NBYTES, NBYTES, new, filling.remove)

        assert book == {}
        assert region.region_id not in {r.region_id for r in d.store.regions}
        assert not filling.pending(*one)
        assert filling.wait(*one, timeout_s=0) is None


async def _finished_mirror(d: Daemon, version: int, sizes: list[int]) -> Mirror:
    """A complete mirror of ``version`` of model ``m`` published over regions of
    ``sizes`` (source region ids 10, 11, ...)."""
    regions = {
        10 + i: await d.store.create_region(RegionCreate(n, owner=OWNER, label="mirror"))
        for i, n in enumerate(sizes)
    }
    shards = [ShardEntry((0,), (r.nbytes,), r.region_id, 0) for r in regions.values()]
    tensors = [TensorEntry(f"w{i}", (s.shape[0],), "uint8", [s]) for i, s in enumerate(shards)]
    d.registry.publish(ManifestIn("m", version, 0, 1, tensors))
    m = Mirror("http://source", "m", version, regions=regions, nbytes=sum(sizes))
    m.done = np.ones(1, dtype=bool)
    m.ready.set()
    return m


async def test_a_new_version_takes_over_the_regions_of_a_finished_unleased_mirror_of_its_model() -> (
    None
):
    """Version 2 asks for regions of the sizes version 1's mirror holds: it gets
    them (by source region id), version 1 is retired (no lease can be taken on it),
    it leaves the book and the table of held reads, and its bytes move to version 2."""
    async with served() as s:
        d = s.daemon
        old = await _finished_mirror(d, 1, [NBYTES, 2 * NBYTES])
        book = {("http://source", "m", 1): old}
        ids = {k: r.region_id for k, r in old.regions.items()}
        old.error = "its source went away"  # failed mirrors give their regions too
        filling = FillingMirrors()
        filling.add(old)
        one = (np.array([ids[10]]), np.zeros(1, np.int64), np.ones(1, np.int64))
        assert "went away" in (filling.wait(*one, timeout_s=0) or "")
        new = Mirror("http://source", "m", 2)

        taken = take_over(
            d.registry, d.store, book, new, {11: 2 * NBYTES, 10: NBYTES}, filling.remove
        )

        assert {k: r.region_id for k, r in taken.items()} == ids
        assert book == {} and old.regions == {} and old.nbytes == 0
        assert d.registry.version("m", 1).state is VersionState.RETIRED
        with pytest.raises(ConflictError):
            d.registry.acquire("m", 1, 30.0)
        assert filling.wait(*one, timeout_s=0) is None  # no read is refused in its name


@pytest.mark.parametrize(
    "why", ["leased", "pulled", "other sizes", "filling", "other model", "other source", "newer"]
)
async def test_a_mirror_still_read_or_unlike_the_new_version_keeps_its_regions(why: str) -> None:
    """No region is taken from a mirror whose version is leased, whose regions a
    running pull reads, whose sizes differ, that still fills, or that is another
    model's, another source's or a newer version's: the new version makes its own,
    and the old one stays as it was (readable, its version ready)."""
    async with served() as s:
        d = s.daemon
        old = await _finished_mirror(d, 1, [NBYTES])
        sizes = {10: NBYTES}
        new = Mirror("http://source", "m", 2)
        pins = contextlib.ExitStack()
        if why == "leased":
            d.registry.acquire("m", 1, 30.0)
        elif why == "pulled":
            pins.enter_context(d.store.using([old.regions[10].region_id]))
        elif why == "other sizes":
            sizes = {10: 2 * NBYTES}
        elif why == "filling":
            old.done = np.zeros(1, dtype=bool)
        elif why == "other model":
            new = Mirror("http://source", "n", 2)
        elif why == "other source":
            new = Mirror("http://elsewhere", "m", 2)
        else:
            new = Mirror("http://source", "m", 0)
        book = {("http://source", "m", 1): old}
        with pins:
            assert take_over(d.registry, d.store, book, new, sizes, lambda m: None) == {}
        assert book == {("http://source", "m", 1): old} and list(old.regions) == [10]
        assert d.registry.version("m", 1).state is VersionState.READY
