"""The one install (:mod:`refitd.client.install`): host and GPU memory land a pull
through the same code, so every case runs on each device this machine has (the CPU
always; a GPU where one is present).

A full read's replay is checked against the reshard planner's own write through a
pointer (:func:`refitd.reshard.slice_plan.write_through_pointer`, the reference the
host install used), the rest against the bytes placed by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from refitd.client.install import Scatter, install, replay_full_reads
from refitd.reshard.slice_plan import write_through_pointer
from refitd.reshard.transfer_plan import FullRead
from refitd.reshard.types import RecordedCopy

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    ),
]


@dataclass
class Comp:
    """What an install reads of a compiled pull."""

    install: list[tuple[int, int]] = field(default_factory=list)
    scatter: list[Scatter] = field(default_factory=list)
    full_reads: list[tuple[int, FullRead]] = field(default_factory=list)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _staged(source: torch.Tensor, scratch: torch.Tensor, at: int) -> None:
    raw = source.contiguous().view(torch.uint8).reshape(-1)
    scratch[at : at + raw.numel()].copy_(raw.to(scratch.device))


COPIES = {
    # the same dtype, through a transpose and a narrow, into a strided destination
    "same_dtype": (
        torch.float32,
        (4, 6),
        torch.float32,
        RecordedCopy(
            "w", (("t", (), ()), ("narrow", (0, 1, 4), ())), "p", 1, (4, 4), (6, 1), torch.float32
        ),
    ),
    # the loader's copy_ converts bf16 into its float32 parameter
    "converted_by_copy": (
        torch.bfloat16,
        (4, 6),
        torch.float32,
        RecordedCopy("w", (), "p", 0, (4, 6), (6, 1), torch.float32),
    ),
    # the loader casts bf16 to float32 first: the copy_ then moves float32 bits
    "widened_by_a_cast": (
        torch.bfloat16,
        (4, 6),
        torch.float32,
        RecordedCopy("w", (), "p", 0, (4, 6), (6, 1), torch.float32, (torch.float32,)),
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(COPIES))
def test_a_full_read_is_replayed_bit_for_bit_as_the_planners_write_through_a_pointer(
    device: str, case: str
) -> None:
    src_dtype, shape, param_dtype, copy = COPIES[case]
    source = (torch.arange(24, dtype=torch.float32).reshape(shape) * 1.37 - 9).to(src_dtype)
    fr = FullRead("w", shape, src_dtype, src_dtype.itemsize, [], [copy])
    scratch = torch.zeros(64 + fr.staging_nbytes, dtype=torch.uint8, device=device)
    _staged(source, scratch, 64)
    param = torch.full((4, 6), -1.0, dtype=param_dtype, device=device)

    replay_full_reads([(64, fr)], {"p": param}, scratch)

    want = torch.full((4, 6), -1.0, dtype=param_dtype)
    from refitd.reshard.replay import replay_ops

    write_through_pointer(want.data_ptr(), copy, replay_ops(source, copy.op_chain))
    assert _bits(param) == _bits(want)


@pytest.mark.parametrize("device", DEVICES)
def test_staged_ranges_scattered_blocks_and_full_reads_land_where_each_belongs(
    device: str,
) -> None:
    # The engine region: a (4, 4) float32 at 0, an (8,) bf16 at 64, a (2, 3) float32 at 128.
    engine = torch.zeros(192, dtype=torch.uint8, device=device)
    a = engine[0:64].view(torch.float32).view(4, 4)
    b = engine[64:80].view(torch.bfloat16)
    c = engine[128:152].view(torch.float32).view(2, 3)
    params = {"a": a, "b": b, "c": c}
    # Scratch: the engine's image, a packed block for ``a`` (lands transposed), and
    # a bf16 (3, 2) source staged whole for ``c`` (replayed transposed, converted).
    scratch = torch.zeros(320, dtype=torch.uint8, device=device)
    b_new = torch.arange(8, dtype=torch.bfloat16) / 3
    _staged(b_new, scratch, 64)
    block = torch.arange(16, dtype=torch.float32).reshape(4, 4) + 0.5
    _staged(block, scratch, 192)
    source = (torch.arange(6, dtype=torch.float32).reshape(3, 2) / 7).to(torch.bfloat16)
    _staged(source, scratch, 256)
    copy = RecordedCopy("s", (("t", (), ()),), "c", 0, (2, 3), (3, 1), torch.float32)
    comp = Comp(
        install=[(64, 16)],
        scatter=[(192, torch.float32, (4, 4), (1, 4), "a", 0)],
        full_reads=[(256, FullRead("s", (3, 2), torch.bfloat16, 2, [], [copy]))],
    )

    install(comp, params, engine, scratch)

    assert _bits(b) == _bits(b_new)
    assert _bits(a) == _bits(block.t())
    assert _bits(c) == _bits(source.t().to(torch.float32))
    assert _bits(engine[80:128]) == bytes(48)  # nothing staged there: left as it was


@pytest.mark.parametrize("device", DEVICES)
def test_an_install_without_scratch_lands_nothing_and_raises_nothing(device: str) -> None:
    engine = torch.arange(64, dtype=torch.uint8, device=device)
    install(Comp(), {}, engine, None)
    assert engine.tolist() == list(range(64))
