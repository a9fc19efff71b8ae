"""The engine's digest of its own memory, kept up to date by every refit's writes and
checked a block window at a time.

The memory is cut into at most :data:`BLOCKS` blocks (a multiple of ``8 * LANES``
bytes each, so a block's lanes line up with the memory's), and each block has its
own lane digest (:func:`~refitd.delta.diff.lanes_of`); the blocks' lanes add up to
the lane digest of the whole memory.

A refit that writes the memory updates the digest from what each write found and
left (:meth:`EngineDigest.update`: O(changed), one ``bincount``, no re-read). The
difference between the digest and the memory is therefore invariant under refit
writes: memory written outside a refit stays a mismatch until a check reads its
block, whatever deltas are applied on top of it (each delta's update uses the
value it actually read).

A check (:meth:`EngineDigest.differs`) reads a window of blocks. Checking
``ceil(blocks / N)`` blocks before each delta, the window moving on each time,
reads every block once per N deltas: memory written outside a refit is found by
the N-th delta after the write at the latest, at ``1/N`` of a full read's cost per
delta. The digest is a sum, not a hash: a write that leaves every lane's sum
unchanged modulo 2**64 (two words of one lane swapped) is not seen.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from refitd.delta.diff import LANES, lanes_of

__all__ = ["BLOCKS", "EngineDigest"]

BLOCKS = 64
"""Blocks at most: the digest costs ``BLOCKS * LANES * 8`` bytes (256 KiB) at most."""

_ALIGN = 8 * LANES
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class EngineDigest:
    """Per-block lane digests of one memory of ``nbytes`` bytes (see the module)."""

    def __init__(self, lanes: npt.NDArray[np.uint64], block: int, nbytes: int) -> None:
        self.lanes = lanes  # (blocks, LANES)
        self.block = block
        self.nbytes = nbytes
        self.cursor = 0  # the next block a windowed check reads first

    @classmethod
    def of(cls, mem: U8) -> EngineDigest:
        """The digest of ``mem`` as it is now (one read of it)."""
        n = len(mem)
        # A power of two, so a delta's update keys its units by shifts, not divisions.
        block = _ALIGN
        while block * BLOCKS < n:
            block *= 2
        count = -(-n // block) if n else 0
        lanes = np.zeros((max(count, 1), LANES), dtype=np.uint64)
        for b in range(count):
            lanes[b] = lanes_of(mem[b * block : (b + 1) * block])
        return cls(lanes, block, n)

    @property
    def blocks(self) -> int:
        return len(self.lanes)

    def copy(self) -> EngineDigest:
        out = EngineDigest(self.lanes.copy(), self.block, self.nbytes)
        out.cursor = self.cursor
        return out

    def whole(self) -> npt.NDArray[np.uint64]:
        """The lane digest of the whole memory (equal to ``lanes_of(mem)``)."""
        out: npt.NDArray[np.uint64] = np.add.reduce(self.lanes, axis=0, dtype=np.uint64)
        return out

    def differs(self, mem: U8, every: int = 1) -> int | None:
        """Read the next window of ``ceil(blocks / every)`` blocks (all of them for
        ``every`` 1) and move the window on; the first block whose bytes no longer
        have its digest, or None."""
        if len(mem) != self.nbytes:
            return 0
        count = -(-self.blocks // max(every, 1))
        found = None
        for i in range(count):
            b = (self.cursor + i) % self.blocks
            lo = b * self.block
            if found is None and not np.array_equal(
                lanes_of(mem[lo : lo + self.block]), self.lanes[b]
            ):
                found = b
        self.cursor = (self.cursor + count) % self.blocks
        return found

    def update(
        self,
        offsets: I64,
        old: npt.NDArray[np.unsignedinteger],
        new: npt.NDArray[np.unsignedinteger],
    ) -> None:
        """The units at byte ``offsets`` (unit-aligned, none twice) changed from ``old``
        to ``new`` (one unsigned dtype, ``unit`` bytes each): update the digest.

        One ``bincount`` keyed by (block, position in its 4 KiB): a word changes by
        ``(new - old) << shift``, and a sum of shifted differences is the shifted sum
        (modulo 2**64). The float64 sums are exact: differences under 2**16 in
        magnitude, split into 16-bit limbs for units of 4 and 8 bytes."""
        if not len(offsets):
            return
        unit = old.dtype.itemsize
        per = _ALIGN // unit
        # (block, unit in its 4 KiB) by shifts: block, 4 KiB and unit are powers of two.
        key = offsets >> (self.block.bit_length() - 1)
        key <<= per.bit_length() - 1
        key |= (offsets & (_ALIGN - 1)) >> (unit.bit_length() - 1)
        bins = self.blocks * per
        if unit <= 2:
            d = (new.astype(np.int64) - old.astype(np.int64)).astype(np.float64)
            s = np.bincount(key, weights=d, minlength=bins)  # float weights: its fast path
            total = np.rint(s).astype(np.int64).view(np.uint64)
        else:
            if unit == 4:
                w = (new.astype(np.int64) - old.astype(np.int64)).view(np.uint64)
            else:
                w = new.astype(np.uint64) - old.astype(np.uint64)  # modulo 2**64
            total = np.zeros(bins, dtype=np.uint64)
            for j in range(4):
                limb = ((w >> np.uint64(16 * j)) & np.uint64(0xFFFF)).astype(np.float64)
                s = np.rint(np.bincount(key, weights=limb, minlength=bins)).astype(np.uint64)
                total += s << np.uint64(16 * j)
        words = 8 // unit
        shifts = (np.arange(words, dtype=np.uint64) * np.uint64(8 * unit))[None, None, :]
        by_word = total.reshape(self.blocks, LANES, words) << shifts
        self.lanes += np.add.reduce(by_word, axis=2, dtype=np.uint64)

    def update_units(
        self,
        idx: I64,
        old: npt.NDArray[np.unsignedinteger],
        new: npt.NDArray[np.unsignedinteger],
    ) -> None:
        """:meth:`update` for the units at unit indices ``idx`` (none twice), natively:
        one pass over the changes (:func:`refitd.delta.native.digest_update`), the
        same lanes as :meth:`update`, which is its reference."""
        from refitd.delta.native import digest_update

        digest_update(self.lanes, self.block, idx, old, new)

    def rewrite(self, lo: int, before: U8, after: U8) -> None:
        """The bytes at ``[lo, lo + len(after))`` changed from ``before`` to ``after``
        (a whole span rewritten): update each block it touches."""
        end = lo + len(after)
        at = lo
        while at < end:
            b = at // self.block
            hi = min(end, (b + 1) * self.block)
            shift = ((at - b * self.block) // 8) % LANES
            # Unaligned spans: the word grid is the memory's, so pad to it.
            pad = at % 8
            a = np.zeros(pad + (hi - at), dtype=np.uint8)
            c = np.zeros_like(a)
            a[pad:] = before[at - lo : hi - lo]
            c[pad:] = after[at - lo : hi - lo]
            self.lanes[b] += np.roll(lanes_of(c) - lanes_of(a), shift)
            at = hi
