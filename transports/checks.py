"""Contract checks every transport must pass: ``check_*(pair)`` helpers.

Each helper takes a `Pair` — a started puller transport, a peer connection to a
started source transport, a local region and a remote region (both regions' memory,
a `SharedSegment` or a device kind's `DeviceMemory`, so the check can see the
bytes) — and asserts one behaviour of `transports.interface.Peer.get`. The test suite runs every helper against every
registered transport over real loopback; a new transport adds itself to that list
and must pass unchanged. Byte counts are bytes; sizes used are chosen so the whole
set runs in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from refitd.errors import ProtocolError

from .batch import READ_DTYPE
from .interface import Peer, ReadRefused, Transport, create_transport
from .memory import DeviceMemory
from .segments import SharedSegment

__all__ = [
    "LOCAL",
    "REMOTE",
    "Pair",
    "check_concurrent_batches",
    "check_contiguous_batch",
    "check_input_forms",
    "check_refusal_reads_nothing",
    "check_scattered_batch",
    "check_sizes",
    "contents",
    "fill",
    "open_pair",
    "shuffled_batch",
]

LOCAL, REMOTE = 7, 11  # deliberately different ids: a swapped pair must fail


Memory = SharedSegment | DeviceMemory
"""A region's memory as a check sees it: host segment or device allocation."""


def contents(memory: Memory) -> npt.NDArray[np.uint8]:
    """The bytes of ``memory`` now (a view of a segment; a copy of device memory)."""
    if isinstance(memory, SharedSegment):
        return memory.numpy()
    return np.frombuffer(memory.read(0, memory.size), np.uint8)


def fill(memory: Memory, value: int | npt.NDArray[np.uint8]) -> None:
    """Set every byte of ``memory`` to ``value`` (a byte, or an array of its size)."""
    if isinstance(memory, SharedSegment):
        memory.numpy()[:] = value
        return
    data = np.full(memory.size, value, np.uint8) if isinstance(value, int) else value
    memory.write(0, data.tobytes())


@dataclass
class Pair:
    puller: Transport
    source: Transport
    peer: Peer
    local: Memory
    remote: Memory


def _segment(nbytes: int, label: str) -> Memory:
    return SharedSegment.create(nbytes, label)


@asynccontextmanager
async def open_pair(
    scheme: str,
    local_bytes: int,
    remote_bytes: int,
    secret: bytes = b"contract-secret-0123456789",
    *,
    local_memory: Callable[[int, str], Memory] = _segment,
    remote_memory: Callable[[int, str], Memory] = _segment,
    **options: Any,
) -> AsyncIterator[Pair]:
    """Two started transports of ``scheme`` (the puller built with ``options``);
    the remote region holds random bytes. ``local_memory``/``remote_memory`` make
    each region's memory (``(nbytes, label)``; default: a shared segment), so a
    device kind meets the same contract."""
    rng = np.random.default_rng(remote_bytes)
    local = local_memory(local_bytes, "dst")
    try:
        remote = remote_memory(remote_bytes, "src")
    except BaseException:
        local.close()
        raise
    try:
        fill(remote, rng.integers(0, 256, remote_bytes, dtype=np.uint8))
        async with (
            create_transport(scheme, secret=secret, **options) as puller,
            create_transport(scheme, secret=secret) as source,
        ):
            await puller.register(LOCAL, local)
            await source.register(REMOTE, remote)
            async with await puller.connect(source.advertise()) as peer:
                yield Pair(puller, source, peer, local, remote)
    finally:
        local.close()
        remote.close()


def shuffled_batch(
    pieces: int, piece: int, seed: int = 0, local_base: int = 0
) -> npt.NDArray[np.void]:
    """``pieces`` reads of ``piece`` bytes; destination i reads a shuffled source slot."""
    perm = np.random.default_rng(seed).permutation(pieces)
    b = np.zeros(pieces, READ_DTYPE)
    b["local_region"], b["remote_region"], b["nbytes"] = LOCAL, REMOTE, piece
    b["local_offset"] = local_base + np.arange(pieces, dtype=np.int64) * piece
    b["remote_offset"] = perm.astype(np.int64) * piece
    return b


def expect(pair: Pair, batch: npt.NDArray[np.void]) -> None:
    """Assert every read of ``batch`` landed byte-exact."""
    dst, src = contents(pair.local), contents(pair.remote)
    for r in batch:
        lo, ro, n = int(r["local_offset"]), int(r["remote_offset"]), int(r["nbytes"])
        assert np.array_equal(dst[lo : lo + n], src[ro : ro + n]), f"read {r} landed wrong bytes"


async def check_sizes(pair: Pair, sizes: tuple[int, ...] = (0, 1, 4096, 1 << 20, 64 << 20)) -> None:
    """One read of each size, at unaligned offsets where it fits, lands byte-exact."""
    for n in sizes:
        fill(pair.local, 0)
        lo = 3 if n + 3 <= pair.local.size else 0
        ro = 5 if n + 5 <= pair.remote.size else 0
        batch = np.array([(LOCAL, lo, REMOTE, ro, n)], READ_DTYPE)
        await pair.peer.get(batch)
        expect(pair, batch)
        got = contents(pair.local)
        assert not got[:lo].any(), f"a {n}-byte read wrote before its destination"
        assert not got[lo + n :].any(), f"a {n}-byte read wrote past its destination"


async def check_scattered_batch(pair: Pair, piece: int = 4096) -> None:
    """Shuffled pieces: each destination slot holds its own source slot."""
    pieces = min(pair.local.size, pair.remote.size) // piece
    batch = shuffled_batch(pieces, piece, seed=1)
    await pair.peer.get(batch)
    expect(pair, batch)


async def check_contiguous_batch(pair: Pair, piece: int = 4096) -> None:
    """Adjacent pieces (which a transport may merge) land as the plain copy would."""
    pieces = min(pair.local.size, pair.remote.size) // piece
    b = shuffled_batch(pieces, piece)
    b["remote_offset"] = b["local_offset"]
    await pair.peer.get(b[::-1].copy())  # order of reads must not matter
    assert np.array_equal(
        contents(pair.local)[: pieces * piece], contents(pair.remote)[: pieces * piece]
    )


async def check_concurrent_batches(pair: Pair, batches: int = 4, piece: int = 4096) -> None:
    """Batches into disjoint destinations, awaited together, all complete exactly."""
    per = min(pair.local.size, pair.remote.size) // piece // batches
    parts = [shuffled_batch(per, piece, seed=k, local_base=k * per * piece) for k in range(batches)]
    await asyncio.gather(*(pair.peer.get(p) for p in parts))
    for p in parts:
        expect(pair, p)


async def check_input_forms(pair: Pair) -> None:
    """READ_DTYPE arrays, int64 (n, 5) arrays and lists of tuples mean the same reads."""
    forms: list[npt.NDArray[np.void] | npt.NDArray[np.int64] | list[tuple[int, ...]]] = [
        np.array([(LOCAL, 0, REMOTE, 100, 64)], READ_DTYPE),
        np.array([[LOCAL, 64, REMOTE, 300, 64]], np.int64),
        [(LOCAL, 128, REMOTE, 500, 64)],
    ]
    for f in forms:
        await pair.peer.get(f)
    dst, src = contents(pair.local), contents(pair.remote)
    assert np.array_equal(dst[:64], src[100:164])
    assert np.array_equal(dst[64:128], src[300:364])
    assert np.array_equal(dst[128:192], src[500:564])


async def check_refusal_reads_nothing(
    pair: Pair, bad: tuple[int, int, int, int, int], match: str
) -> None:
    """A batch with one bad read (placed last) is refused naming it; no byte moves."""
    fill(pair.local, 0xA5)
    good = (LOCAL, 0, REMOTE, 0, 4096)
    batch = np.array([good, bad], READ_DTYPE)
    try:
        await pair.peer.get(batch)
    except ReadRefused as exc:
        assert exc.index == 1, f"refusal named read #{exc.index}, not the bad read #1"
        assert match in str(exc), f"refusal {exc} does not say {match!r}"
    except ProtocolError as exc:
        raise AssertionError(f"refused with {type(exc).__name__}, not ReadRefused: {exc}") from exc
    else:
        raise AssertionError(f"read {bad} was not refused")
    assert (contents(pair.local) == 0xA5).all(), "a refused batch wrote bytes"
