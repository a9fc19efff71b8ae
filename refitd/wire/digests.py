"""A version's chunk digests, as its source daemon computed them.

A host mirror may read a chunk from any holder of it (the source, or another host's
mirror). A holder can send wrong bytes (a memory fault, a bug): the mirror then checks
each chunk it read from a holder that is not the source against the source's digest
of that chunk, asks another holder for the chunks that do not match, and drops the
holder. The source answers ``GET /v1/mirrors/{model}/{version}/digests?lease=`` with a
:class:`ChunkDigests` under a live lease on that version there.

The chunks are those :func:`refitd.daemon.mirror.chunks.cut_chunks` cuts from the whole
scope of the version at the source (every byte range its shards occupy), with
:func:`refitd.daemon.mirror.chunks.chunk_bytes` of the scope's bytes: the cut every mirror of
the version makes, so digest ``i`` is the one of the mirror's chunk ``i``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from refitd.wire.fields import NonNeg

__all__ = ["DIGEST_ALGORITHM", "DIGEST_BYTES", "ChunkDigests"]

DIGEST_BYTES = 16
"""Bytes of one chunk's digest: the first 16 bytes of its BLAKE3 output (128 bits: a
holder would need a second preimage, about 2**128 work, to pass a chunk it forged)."""

DIGEST_ALGORITHM = "blake3-128"
"""How each digest is made: BLAKE3 of the chunk's bytes, unkeyed, its output cut to
:data:`DIGEST_BYTES`."""


class ChunkDigests(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The digest of every chunk of a version, in chunk order (``cut_chunks``: region,
    then offset): ``digests`` is ``chunks`` digests of :data:`DIGEST_BYTES` bytes
    each, concatenated. ``chunk_bytes`` is the size the version was cut at (the last
    chunk of each byte range may be shorter) and ``nbytes`` the bytes of all chunks:
    a reader checks both against its own cut before trusting any digest."""

    chunk_bytes: NonNeg
    chunks: NonNeg
    nbytes: NonNeg
    digests: bytes
    algorithm: Literal["blake3-128"] = "blake3-128"

    def digest(self, index: int) -> bytes:
        """The digest of chunk ``index``."""
        return self.digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
