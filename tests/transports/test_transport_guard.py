"""The guarded native copy: a bus error inside it is an error of that copy.

A shared segment's owner may shrink its file under our mapping at any moment; a copy
through the cut pages then faults (SIGBUS). Inside the guarded copy and gather that
fault becomes :class:`~transports.local.CopyFault` (a ``PullFailed`` naming the
region at the transport's edge); outside them a bus error still ends the process as
it did, so the guard hides no other fault.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports.interface import PullFailed
from transports.local import CopyFault, copy_addresses, copy_batch_guarded, pack_strided
from transports.segments import SHM_DIR, SharedSegment
from transports.shm import ShmTransport

SECRET = b"guard-secret-0123456789abc"
ROOT = Path(__file__).resolve().parents[2]


def _shrink(seg: SharedSegment, nbytes: int) -> None:
    os.truncate(SHM_DIR / seg.name, nbytes)


def _addr(a: np.ndarray, at: int = 0) -> np.ndarray:
    return np.array([a.ctypes.data + at], dtype=np.int64)


@pytest.mark.parametrize("threads", [1, 4])
async def test_a_copy_from_a_shrunk_segment_is_a_copy_fault_not_a_bus_error(threads: int) -> None:
    with (
        SharedSegment.create(8 << 20, "src") as src,
        SharedSegment.create(8 << 20, "dst") as dst,
    ):
        _shrink(src, 4096)
        with (
            pytest.raises(CopyFault, match=r"bus error .*source") as err,
            ThreadPoolExecutor(threads) as pool,
        ):
            await copy_addresses(
                _addr(dst.numpy()),
                _addr(src.numpy()),
                np.array([8 << 20], dtype=np.int64),
                threads=threads,
                pool=pool,
            )
        assert err.value.side == "source"
        # The thread that faulted copies again, byte-exact, from memory that is there.
        np.copyto(dst.numpy()[:4096], 7)
        good = np.arange(4096, dtype=np.uint16).astype(np.uint8)
        src.numpy()[:4096] = good
        await copy_addresses(
            _addr(dst.numpy()),
            _addr(src.numpy()),
            np.array([4096], dtype=np.int64),
            threads=1,
            pool=None,
        )
        assert np.array_equal(dst.numpy()[:4096], good)


def test_scattered_pieces_copy_up_to_the_first_past_a_cut_and_that_one_is_named() -> None:
    # The guarded loop asks for the next piece's lines before copying the current
    # one: a hint at a cut page must not fault, and the fault must name the piece
    # that touched it, with every piece before it copied.
    piece, pieces, kept = 4096, 64, 16
    with (
        SharedSegment.create(piece * pieces, "src") as src,
        SharedSegment.create(piece * pieces, "dst") as dst,
    ):
        order = np.random.default_rng(3).permutation(kept)
        # Shuffled pieces inside the kept head, then the one past the cut, then more.
        rows = np.concatenate([order, [kept + 5], np.arange(kept, kept + 3)])
        want = np.random.default_rng(4).integers(0, 255, piece * kept, dtype=np.uint8)
        src.numpy()[: piece * kept] = want
        dst.numpy()[:] = 0
        _shrink(src, piece * kept)
        d = (dst.address + np.arange(len(rows)) * piece).astype(np.int64)
        s = (src.address + rows * piece).astype(np.int64)
        with pytest.raises(CopyFault, match="source") as err:
            copy_batch_guarded(d, s, np.full(len(rows), piece, dtype=np.int64))
        assert err.value.src == src.address + (kept + 5) * piece
        assert err.value.dst == dst.address + kept * piece
        got = dst.numpy()[: piece * kept].reshape(kept, piece)
        assert np.array_equal(got, want.reshape(kept, piece)[order])


async def test_a_read_into_a_shrunk_destination_fails_with_its_suspect_ranges() -> None:
    with (
        SharedSegment.create(1 << 20, "src") as src,
        SharedSegment.create(1 << 20, "dst") as dst,
    ):
        async with ShmTransport(secret=SECRET) as t:
            await t.register(1, src)
            await t.register(2, dst)
            _shrink(dst, 8192)
            with pytest.raises(PullFailed, match="destination region 2 faulted") as err:
                await t.loopback().get([(2, 0, 1, 0, 1 << 20)])
            assert [(r.region, r.offset, r.nbytes) for r in err.value.suspect] == [(2, 0, 1 << 20)]


def test_a_gather_from_a_shrunk_segment_is_a_copy_fault() -> None:
    with SharedSegment.create(1 << 20, "src") as src:
        out = bytearray(4096)
        _shrink(src, 4096)
        with pytest.raises(CopyFault, match="source"):
            # 512 rows of 8 bytes, one per 2 KiB: row 2 on is past the cut.
            pack_strided(src.numpy().data, 0, (512, 1), (256, 1), 8, memoryview(out), 0)


@settings(max_examples=60, deadline=None)
@given(
    dims=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    gaps=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    itemsize=st.sampled_from([1, 2, 3, 4, 8, 16]),
    offset=st.integers(0, 7),
)
def test_the_guarded_gather_packs_exactly_what_numpy_packs(
    dims: list[int], gaps: list[int], itemsize: int, offset: int
) -> None:
    # Row-major strides (elements) with gaps: the innermost may be > 1 (a column).
    strides = [0] * len(dims)
    step = 1 + gaps[-1]
    for d in reversed(range(len(dims))):
        strides[d] = step
        step *= dims[d] + gaps[d]
    span = offset + itemsize * (1 + sum((n - 1) * s for n, s in zip(dims, strides, strict=True)))
    src = np.random.default_rng(span).integers(0, 256, span, dtype=np.uint8)
    want = np.lib.stride_tricks.as_strided(
        src[offset:].view(np.uint8),
        shape=(*dims, itemsize),
        strides=(*(s * itemsize for s in strides), 1),
    ).copy()
    out = bytearray(want.nbytes + 5)
    n = pack_strided(
        memoryview(src), offset, tuple(dims), tuple(strides), itemsize, memoryview(out), 5
    )
    assert n == want.nbytes
    assert bytes(out[5:]) == want.tobytes()


def test_a_bus_error_outside_a_guarded_copy_still_ends_the_process() -> None:
    """The guard is installed, then a plain numpy read meets a shrunk page: the
    process dies of SIGBUS as it would without the guard (nothing swallowed)."""
    code = textwrap.dedent(
        """
        import os, numpy as np
        from transports.local import copy_addresses  # loads the guarded helper
        from transports.native import copy_lib
        from transports.segments import SHM_DIR, SharedSegment
        copy_lib().rfx_guard_install()
        seg = SharedSegment.create(1 << 20, "victim")
        os.truncate(SHM_DIR / seg.name, 4096)
        seg.unlink()
        print(int(seg.numpy()[1 << 19]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert done.returncode == -7, (done.returncode, done.stderr[-2000:])


def test_a_new_segment_has_every_byte_backed_when_it_is_made() -> None:
    """Reserved at creation: tmpfs holds the whole size in blocks before anything is
    written, so a later write cannot meet a filesystem that has run out."""
    size = (3 << 20) + 4096
    with SharedSegment.create(size, "reserved") as seg:
        assert os.stat(SHM_DIR / seg.name).st_blocks * 512 >= size
