"""The conditions a bench measures under, so its ratios compare like with like.

- :func:`faults` reads a process's page-fault counters: a version whose pull faults
  pages in (a mapping touched for the first time) runs at the kernel's fault rate,
  not memory speed, and a reader of the bench sees that next to its ratio;
- :func:`cpu_waited_us` reads the kernel's CPU pressure: the share of a pull's wall
  time during which some task of the host waited for a core. Near 0 on a quiet
  host (beyond the bench's own threads); near 1 when neighbours load it, and then
  a ratio measures the neighbours as much as refitd;
- :class:`SegmentMemcpy` is the memcpy baseline on the same kind of memory a refit
  copies: two shared-memory segments (tmpfs, the page size the host gives
  ``/dev/shm``), backed and mapped once, copied by the same native loop a pull ends
  in, on as many threads as the daemon's copier uses. An anonymous numpy buffer
  gets transparent huge pages where a tmpfs segment may not, so a baseline on it
  measures another page size than the refit's; a one-thread baseline against a
  copy on two threads measures whether the second core happened to be free.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np
import numpy.typing as npt

__all__ = ["Faults", "SegmentMemcpy", "cpu_waited_us", "faults"]


@dataclass(frozen=True)
class Faults:
    """Page faults of one process: ``minor`` (the page was in memory, only the
    mapping was missing) and ``major`` (the page had to be read in)."""

    minor: int = 0
    major: int = 0

    def __sub__(self, other: Faults) -> Faults:
        return Faults(self.minor - other.minor, self.major - other.major)

    def __add__(self, other: Faults) -> Faults:
        return Faults(self.minor + other.minor, self.major + other.major)


def faults(pid: int | None = None) -> Faults:
    """The page faults process ``pid`` (this one when None) has taken so far, all its
    threads together (``/proc/<pid>/stat`` fields 10 and 12); zeros when it is gone."""
    try:
        text = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
    except OSError:
        return Faults()
    # Field 2 (the command) may hold spaces: split after its closing parenthesis.
    rest = text.rsplit(")", 1)[1].split()
    return Faults(int(rest[7]), int(rest[9]))


def cpu_waited_us() -> int | None:
    """Microseconds, since boot, during which at least one runnable task of this host
    waited for a CPU (``/proc/pressure/cpu``, "some" total); None where the kernel
    does not report pressure."""
    try:
        text = Path("/proc/pressure/cpu").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            return int(line.rsplit("total=", 1)[1])
    return None


class SegmentMemcpy:
    """A memcpy on ``threads`` threads between two shared segments of ``nbytes`` (≥ 1)
    bytes, created (every page backed and mapped) once and reused: :meth:`gbps`
    copies ``total`` bytes, the whole segment at a time (each thread its own
    contiguous share), and returns GB/s (10^9 bytes/s). Page faults during the copy
    are counted in :attr:`faults_taken` (0 expected: the pages were mapped at
    creation)."""

    def __init__(self, nbytes: int = 256 << 20, threads: int = 1) -> None:
        from transports.native import copy_lib
        from transports.segments import SharedSegment

        self.nbytes = nbytes
        self.threads = max(1, min(threads, nbytes))
        self._src = SharedSegment.create(nbytes, "bench-memcpy-src")
        try:
            self._dst = SharedSegment.create(nbytes, "bench-memcpy-dst")
        except BaseException:
            self._src.close()
            raise
        self._src.numpy()[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        self._lib = copy_lib()
        cuts = np.linspace(0, nbytes, self.threads + 1).astype(np.int64)
        # one (dst, src, nbytes) triple of one-element arrays per thread's share
        self._args = [
            [
                np.array([x], dtype=np.int64)
                for x in (self._dst.address + a, self._src.address + a, b - a)
            ]
            for a, b in itertools.pairwise(cuts.tolist())
        ]
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bench-memcpy")
        self.faults_taken = Faults()

    def _copy(self, share: list[npt.NDArray[np.int64]], reps: int) -> None:
        d, s, n = (ctypes.c_void_p(a.ctypes.data) for a in share)
        for _ in range(reps):
            self._lib.rfx_copy_batch(1, d, s, n)

    def gbps(self, total: int) -> float:
        reps = max(1, -(-total // self.nbytes))
        before = faults()
        t = time.perf_counter()
        for done in [self._pool.submit(self._copy, share, reps) for share in self._args]:
            done.result()
        seconds = time.perf_counter() - t
        self.faults_taken = self.faults_taken + (faults() - before)
        return reps * self.nbytes / seconds / 1e9

    def close(self) -> None:
        self._pool.shutdown()
        self._src.close()
        self._dst.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
