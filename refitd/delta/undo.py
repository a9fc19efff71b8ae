"""Writes of units that keep what they overwrote, so a delta that fails after its
first write is rolled back to the bytes it found (no engine serves a mix)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["UndoLog"]


@dataclass
class _Write:
    target: npt.NDArray[np.generic]
    index: npt.NDArray[np.int64]
    old: npt.NDArray[np.generic]


@dataclass
class UndoLog:
    """Every write of one delta, in order; :meth:`rollback` restores them in reverse."""

    writes: list[_Write] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes the record holds: what the writes overwrote, and their indices."""
        return sum(w.old.nbytes + w.index.nbytes for w in self.writes)

    def write(
        self,
        target: npt.NDArray[np.generic],
        index: npt.NDArray[np.int64],
        values: npt.NDArray[np.generic],
        old: npt.NDArray[np.generic] | None = None,
    ) -> npt.NDArray[np.generic]:
        """``target[index] = values``, the old values recorded first (and returned);
        ``old``: ``target[index]`` as the caller already read it."""
        if old is None:
            old = target[index]
        self.writes.append(_Write(target, index, old))
        target[index] = values
        return old

    def record(
        self,
        target: npt.NDArray[np.generic],
        index: npt.NDArray[np.int64],
        old: npt.NDArray[np.generic],
    ) -> None:
        """Record that ``target[index]`` held ``old`` before a write the caller makes
        next (a native scatter)."""
        self.writes.append(_Write(target, index, old))

    def keep(self, target: npt.NDArray[np.generic]) -> None:
        """Record the whole of ``target`` (1-D) before something rewrites it."""
        index = np.arange(len(target), dtype=np.int64)
        self.writes.append(_Write(target, index, target.copy()))

    def rollback(self) -> None:
        """Put back every overwritten value, last write first."""
        for w in reversed(self.writes):
            w.target[w.index] = w.old
        self.writes.clear()
