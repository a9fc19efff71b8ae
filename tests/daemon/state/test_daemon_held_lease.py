"""The one lease keeper (:func:`refitd.client.leases.held_lease`): acquire, renew while
the block runs, release when it ends, whichever way it ends. Against a real daemon."""

from __future__ import annotations

import pytest
from support.daemons import served
from support.toy import publish_tensor

from refitd.client.leases import held_lease
from refitd.errors import ConflictError, NotFoundError

pytestmark = pytest.mark.timeout(60)


async def test_a_held_lease_is_renewed_in_the_block_and_released_after_it() -> None:
    async with served(transport="shm") as s:
        region = await s.client.create_region(64, label="w")
        await publish_tensor(s.client, "m", 1, region.region_id, 64)
        acquiring = s.client.acquire_lease("m", 1, 0.3, manifest=True)
        async with held_lease(s.client, acquiring) as kept:
            assert kept.granted.records is not None and kept.granted.manifest is not None
            await kept.wait(2)  # renewed twice: it outlived its 0.3 s TTL
            lease_id = kept.granted.lease_id
            await s.client.check_lease(lease_id, "m", 1)
        with pytest.raises(ConflictError):
            await s.client.check_lease(lease_id, "m", 1)
        with pytest.raises(NotFoundError):
            await s.client.release_lease(lease_id)


async def test_a_held_lease_is_released_when_its_block_fails_and_a_gone_one_is_let_be() -> None:
    async with served(transport="shm") as s:
        region = await s.client.create_region(64, label="w")
        await publish_tensor(s.client, "m", 1, region.region_id, 64)
        with pytest.raises(RuntimeError, match="the block failed"):
            async with held_lease(s.client, s.client.acquire_lease("m", 1, 30.0)) as kept:
                lease_id = kept.granted.lease_id
                raise RuntimeError("the block failed")
        with pytest.raises(ConflictError):
            await s.client.check_lease(lease_id, "m", 1)
        # released inside the block already: leaving it is no error
        async with held_lease(s.client, s.client.acquire_lease("m", 1, 30.0)) as kept:
            await s.client.release_lease(kept.granted.lease_id)
