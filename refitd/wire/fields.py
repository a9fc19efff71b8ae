"""The field types every body of the wire is built of, and the limits of a body.

Every wire integer is bounded to int64; every free-text field is bounded in length.
Units: every ``*_offset``, ``nbytes`` and ``byte_offset`` is in **bytes**; every
``shape`` and tensor ``offset`` is in **elements** of the tensor's global shape.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Annotated

import msgspec

__all__ = [
    "API_PREFIX",
    "INT64_MAX",
    "MAX_MANIFEST_TENSORS",
    "MAX_PARTS",
    "MAX_RANK",
    "MAX_TENSOR_SHARDS",
    "MSGPACK",
    "DtypeName",
    "Int64",
    "Label",
    "Name",
    "NonNeg",
    "PartCount",
    "Positive",
    "ProcessTag",
    "Shape",
    "TensorName",
    "Url",
    "gc_paused",
]

API_PREFIX = "/v1"
MSGPACK = "application/msgpack"

# Every wire integer is bounded to int64: msgspec would otherwise accept any JSON
# integer (and msgpack up to 2**64 - 1), and an id, offset or size past int64 can
# neither be checked against numpy's int64 records nor encoded back in a reply.
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=INT64_MAX)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
#: a client process, as ``<pid>.<start time>`` (``transports.segments.owner_tag``), or ""
ProcessTag = Annotated[str, msgspec.Meta(max_length=48, pattern=r"^([0-9]{1,10}\.[0-9]{1,20})?$")]
#: free-text fields of a request (owner, label): bounded, may be empty
Label = Annotated[str, msgspec.Meta(max_length=256)]
#: a tensor's name in a manifest (module paths of real models stay far below this)
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
DtypeName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
#: the most publisher parts one version may expect (one per trainer rank)
MAX_PARTS = 65536
PartCount = Annotated[int, msgspec.Meta(gt=0, le=MAX_PARTS)]
Url = Annotated[str, msgspec.Meta(max_length=2048)]
#: the most dimensions a manifest's tensor may have (torch allows far fewer in practice)
MAX_RANK = 64
Shape = Annotated[tuple[Int64, ...], msgspec.Meta(max_length=MAX_RANK)]
#: the most shards one tensor may list in one manifest; a msgpack body past it is
#: refused from its array header, before any shard is decoded
MAX_TENSOR_SHARDS = 65536
#: the most tensors one manifest may list
MAX_MANIFEST_TENSORS = 1 << 20


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk decode or merge.

    A 100k-tensor manifest is ~500k small acyclic objects; with the default
    thresholds the collector runs thousands of passes over them while they are
    built, which costs more than the decoding itself.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
