"""A host's mirror budget (``refitd.daemon.mirrorspace``): what making room frees.

A mirror that failed keeps an entry in the table of reads held on filling mirrors
(``FillingMirrors``), so a read held on it is refused with the mirror's error. When
its regions are freed, the entry must go with them, whichever path frees them: the
sweep after a version ends, or a new mirror making room in the budget.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.daemons import served

from refitd.daemon.mirror import Mirror
from refitd.daemon.mirrorhold import FillingMirrors
from refitd.daemon.mirrorspace import make_room
from refitd.wire import ManifestIn, RegionCreate, ShardEntry, TensorEntry

pytestmark = pytest.mark.timeout(60)

NBYTES = 4096


async def test_making_room_frees_a_failed_mirror_and_forgets_the_reads_held_on_it() -> None:
    """A failed mirror holds the whole budget; a new mirror asks for room. Its
    region is deleted, the mirror leaves the book, and no read of its region is
    held or refused in its name any more."""
    async with served() as s:
        d = s.daemon
        region = await d.create_region(RegionCreate(NBYTES, label="mirror"))
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
        assert await make_room(d, book, NBYTES, NBYTES, new, filling.remove)

        assert book == {}
        assert region.region_id not in {r.region_id for r in d.store.regions}
        assert not filling.pending(*one)
        assert filling.wait(*one, timeout_s=0) is None
