"""The ``shm`` transport refuses, before mapping anything, a peer it cannot prove is
on this host reading these very files."""

from __future__ import annotations

import os

import msgspec
import pytest

from refitd.errors import TransportError
from transports.core import create_transport
from transports.shm import SHM_DIR, SharedSegment

SECRET = b"samehost-secret-0123456789"


async def test_a_record_from_another_kernel_boot_is_refused_at_connect() -> None:
    with SharedSegment.create(4096, "src") as src:
        async with (
            create_transport("shm", secret=SECRET) as puller,
            create_transport("shm", secret=SECRET) as source,
        ):
            await source.register(1, src)
            info = source.advertise()
            other = msgspec.structs.replace(
                info, address=b"00000000-another-boot:" + info.address.split(b":")[1]
            ).signed(SECRET)
            with pytest.raises(TransportError, match="another kernel"):
                await puller.connect(other)


async def test_a_segment_name_that_now_maps_another_file_is_refused_at_connect() -> None:
    with SharedSegment.create(4096, "src") as src:
        async with (
            create_transport("shm", secret=SECRET) as puller,
            create_transport("shm", secret=SECRET) as source,
        ):
            await source.register(1, src)
            info = source.advertise()
            # Same name, another file (what a separate /dev/shm would show).
            os.unlink(SHM_DIR / src.name)
            fd = os.open(SHM_DIR / src.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
            try:
                with pytest.raises(TransportError, match="another file"):
                    await puller.connect(info)
            finally:
                os.unlink(SHM_DIR / src.name)
