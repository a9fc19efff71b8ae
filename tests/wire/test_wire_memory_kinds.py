"""A memory kind is spelled once, from the wire to the transports (issue 50).

A region's ``kind`` on the wire, the ``kind`` of the memory a transport registers and
routes copies by, and the label of the region metrics are one
:class:`~refitd.memory_kinds.MemoryKind`. The wire once spelled the kinds ``shm`` (the
name of a transport) and ``cuda_ipc``; those spellings are refused on decode, by value
and field, like any unknown kind: one spelling, never two that mean the same memory.
"""

from __future__ import annotations

import typing

import msgspec
import pytest

import transports.cuda
from refitd import wire
from refitd.memory_kinds import MemoryKind
from refitd.wire import RegionAttach, RegionCreate, RegionInfo
from transports.memory import CopyEngine, DeviceMemory, is_host
from transports.segments import SharedSegment

REGION_STRUCTS = [RegionCreate, RegionAttach, RegionInfo]


@pytest.mark.parametrize("struct", REGION_STRUCTS, ids=lambda s: s.__name__)
def test_a_regions_kind_on_the_wire_is_the_memory_kind_the_transports_compare(
    struct: type[msgspec.Struct],
) -> None:
    assert typing.get_type_hints(struct)["kind"] is MemoryKind
    assert wire.MemoryKind is MemoryKind


def _ours(base: type) -> list[type]:
    """Every subclass of ``base`` the transports package defines (a test's own device
    kinds, `support.devices`, are left out: they never cross the wire)."""
    found, stack = [], list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("transports.") and "kind" in vars(cls):
            found.append(cls)
    return found


def test_every_memory_kind_is_made_by_a_transports_module_and_every_one_made_is_a_kind() -> None:
    # The memory the transports make regions of: host segments and each device kind's
    # module (`transports.cuda` is the one; imported here, it loads no CUDA library).
    made = {SharedSegment.kind} | {cls.kind for cls in _ours(DeviceMemory)}
    engines = {cls.kind for cls in _ours(CopyEngine)}
    assert transports.cuda.CudaIpcMemory.kind is MemoryKind.CUDA
    assert made == set(MemoryKind), made
    assert engines == set(MemoryKind) - {MemoryKind.HOST}, engines


def test_a_segment_is_host_memory_whose_identity_leads_with_its_kind() -> None:
    with SharedSegment.create(4096, "kinds") as seg:
        assert seg.kind is MemoryKind.HOST and is_host(seg)
        assert seg.identity[0] is MemoryKind.HOST


@pytest.mark.parametrize("kind", list(MemoryKind))
def test_a_regions_kind_travels_as_its_memory_kinds_value_and_back(kind: MemoryKind) -> None:
    info = RegionInfo(3, kind, "seg", 64, 7)
    for encode, decode in (
        (msgspec.json.encode, msgspec.json.decode),
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
    ):
        raw = encode(info)
        assert decode(raw)["kind"] == kind.value
        assert decode(raw, type=RegionInfo).kind is kind


def test_a_region_is_host_memory_unless_a_request_says_otherwise() -> None:
    assert RegionCreate(64).kind is MemoryKind.HOST
    assert RegionAttach("seg", 64).kind is MemoryKind.HOST


@pytest.mark.parametrize("old", ["shm", "cuda_ipc"])
@pytest.mark.parametrize("struct", REGION_STRUCTS, ids=lambda s: s.__name__)
def test_an_old_spelling_of_a_memory_kind_is_refused_by_value_and_field(
    struct: type[msgspec.Struct], old: str
) -> None:
    body = {"region_id": 1, "handle": "seg", "nbytes": 64, "incarnation": 7, "kind": old}
    fields = {f.name for f in msgspec.structs.fields(struct)}
    body = {k: v for k, v in body.items() if k in fields}
    for encode, decode in (
        (msgspec.json.encode, msgspec.json.decode),
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
    ):
        with pytest.raises(msgspec.ValidationError, match=rf"'{old}'.*\$\.kind"):
            decode(encode(body), type=struct)
