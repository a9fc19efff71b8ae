"""Delta refit, the pure part: what changed between two versions, where each changed
unit of a planned pull lands, and writes that can be undone. No I/O, no ``await``;
the daemon (:mod:`refitd.daemon.deltas`) and the receiver
(:mod:`refitd.client.deltarefit`) call it. The mechanism: ``docs/delta.md``.

- :mod:`~refitd.delta.diff`: bytewise comparison of two blocks in chunks, and the
  lane digest (position-keyed sums of 64-bit words, updated in O(changed));
- :mod:`~refitd.delta.stream`: the byte stream a pull's reads make (rows, then each
  pack spec in its packed order), the changed units inside it, their compact
  positions (page counts + 16-bit offsets) and the staged payload's layout;
- :mod:`~refitd.delta.undo`: unit writes that keep what they overwrote, rolled back
  in reverse order.
"""
