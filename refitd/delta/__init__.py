"""Delta refit, the pure part: what changed between two versions, where each changed
unit of a planned pull lands, how the engine applies it, and writes that can be
undone. No I/O, no ``await``; the daemon (:mod:`refitd.daemon.delta.source`) and
the receiver (:mod:`refitd.client.deltarefit`) call it. The mechanism: ``docs/delta.md``.

- :mod:`~refitd.delta.diff`: bytewise comparison of two blocks in chunks, and the
  lane digest (position-keyed sums of 64-bit words, updated in O(changed));
- :mod:`~refitd.delta.digest`: the engine's digest of its own memory, kept up to date
  by every refit's writes;
- :mod:`~refitd.delta.compare`: the source's comparison of a version with its base,
  grouped by bytes;
- :mod:`~refitd.delta.native`: the per-change stages in native code
  (``transports.native._delta``);
- :mod:`~refitd.delta.stream`: the byte stream a pull's reads make (rows, then each
  pack spec in its packed order), the changed units inside it, their compact
  positions (page counts + 16-bit offsets) and the staged payload's layout;
- :mod:`~refitd.delta.apply`: the engine's apply: each changed unit of a chunk written
  where a full refit would have landed it (the engine's memory, a scattered block,
  a full read's staged tensor), every write undoable;
- :mod:`~refitd.delta.undo`: unit writes that keep what they overwrote, rolled back
  in reverse order.
"""
