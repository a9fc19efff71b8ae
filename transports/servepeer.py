"""A peer in its own process: one region, filled with a known pattern, served until EOF.

    REFITD_TRANSPORT_SECRET=<hex> python -m transports.servepeer --scheme ucx --size BYTES

Prints the hex of its signed `PeerInfo`, then the pid that holds the served memory,
then serves until its stdin
closes (or it is killed: the fault tests kill it mid-pull). Used by the transport
fault tests and `refitd bench transport` as the far side of a loopback pull. The
secret travels in the environment, never on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import numpy as np
import numpy.typing as npt

from .interface import create_transport
from .segments import SharedSegment

SECRET_ENV = "REFITD_TRANSPORT_SECRET"
REGION_ID = 1


def pattern(size: int, seed: int) -> npt.NDArray[np.uint8]:
    """The bytes a peer started with ``seed`` serves: reproducible anywhere, cheap to make."""
    words = (
        np.arange((size + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    ) ^ np.uint64(seed)
    return words.view(np.uint8)[:size]


async def serve(scheme: str, size: int, seed: int, secret: bytes) -> None:
    with SharedSegment.create(size, "peer") as seg:
        seg.numpy()[:] = pattern(size, seed)
        async with create_transport(scheme, secret=secret, peer_id=f"peer-{os.getpid()}") as t:
            await t.register(REGION_ID, seg)
            # Line 1: the signed record. Line 2: the pid whose memory a cma read
            # touches (the data-plane child for ucx), for the benchmark's ceiling row.
            sys.stdout.write(t.advertise().encode().hex() + "\n")
            sys.stdout.write(f"{getattr(t, 'pid', None) or os.getpid()}\n")
            sys.stdout.flush()
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scheme", default="ucx")
    p.add_argument("--size", type=int, required=True, help="region size in bytes")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    secret = bytes.fromhex(os.environ[SECRET_ENV])
    asyncio.run(serve(args.scheme, args.size, args.seed, secret))
    return 0


if __name__ == "__main__":
    sys.exit(main())
