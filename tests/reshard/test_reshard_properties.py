"""Property: for any shard layout and any allow-listed op chain, plan + reference
transport reconstructs exactly what eager torch's loader would have written.

Chains are generated op by op and each op is checked with eager torch on the
current shape before it is kept, so every chain is one a real loader could run.
Destinations are strided views (permuted, with gaps) inside a larger parameter,
whose untouched elements must stay zero.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from refitd.reshard.compile import compile_plan, dest_layout_of, execute_bound
from refitd.reshard.geometry import capture_geometry
from refitd.reshard.reads import InMemoryReadExecutor
from refitd.reshard.replay import replay_ops
from refitd.reshard.transfer_plan import plan_transfer
from refitd.reshard.types import CaptureResult, OpSpec

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _op(name: str, *args: Any, **kwargs: Any) -> OpSpec:
    return (name, args, tuple(sorted(kwargs.items())))


def _factorizations(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            out.append((a, n // a))
    return out


@st.composite
def op_step(draw: st.DrawFn, shape: tuple[int, ...]) -> list[OpSpec]:
    """One loader step on a tensor of ``shape`` (possibly two ops: multi-output + pick)."""
    nd = len(shape)
    kinds = ["contiguous", "unsqueeze", "reshape_merge", "reshape_split"]
    if nd:
        kinds += ["narrow", "select", "getitem", "chunk", "split", "unbind", "squeeze", "flatten"]
    if nd >= 2:
        kinds += ["transpose", "permute", "t"] if nd == 2 else ["transpose", "permute"]
    kind = draw(st.sampled_from(kinds))
    dim = draw(st.integers(-nd, nd - 1)) if nd else 0
    size = shape[dim] if nd else 1
    if kind == "contiguous":
        return [_op("contiguous")]
    if kind == "unsqueeze":
        return [_op("unsqueeze", draw(st.integers(-nd - 1, nd)))]
    if kind == "narrow":
        start = draw(st.integers(0, size))
        return [_op("narrow", dim, start, draw(st.integers(0, size - start)))]
    if kind == "select":
        if size == 0:
            return [_op("contiguous")]
        return [_op("select", dim, draw(st.integers(-size, size - 1)))]
    if kind == "getitem":
        index: list[Any] = []
        for n in shape:
            choice = draw(st.sampled_from(["all", "slice", "int"]))
            if choice == "int" and n:
                index.append(draw(st.integers(-n, n - 1)))
            elif choice == "slice":
                start = draw(st.integers(-n - 1, n) | st.none())
                stop = draw(st.integers(-n - 1, n) | st.none())
                index.append(slice(start, stop, draw(st.integers(1, 3))))
            else:
                index.append(slice(None))
        return [_op("__getitem__", tuple(index))]
    if kind in ("chunk", "split", "unbind"):
        if kind == "unbind":
            pieces = size
            op = _op("unbind", dim)
        elif kind == "chunk":
            k = draw(st.integers(1, 4))
            op = _op("chunk", k, dim)
            pieces = len(torch.empty(shape, device="meta").chunk(k, dim))
        else:
            k = draw(st.integers(1, max(size, 1)))
            op = _op("split", k, dim)
            pieces = len(torch.empty(shape, device="meta").split(k, dim))
        if pieces == 0:
            return [_op("contiguous")]
        return [op, _op("__getitem__", draw(st.integers(0, pieces - 1)))]
    if kind == "squeeze":
        return [_op("squeeze", dim)] if draw(st.booleans()) else [_op("squeeze")]
    if kind == "flatten":
        return [_op("flatten", draw(st.integers(0, nd - 1)), draw(st.integers(0, nd - 1)))]
    if kind == "transpose":
        return [_op("transpose", dim, draw(st.integers(-nd, nd - 1)))]
    if kind == "t":
        return [_op("t")]
    if kind == "permute":
        return [_op("permute", *draw(st.permutations(range(nd))))]
    numel = math.prod(shape)
    if kind == "reshape_merge" or not numel:
        name = draw(st.sampled_from(["reshape", "view"]))
        return [_op(name, -1)] if nd else [_op(name, 1)]
    # Split one dim into factors, or unflatten it.
    if nd and shape[dim] > 1:
        parts = draw(st.sampled_from(_factorizations(shape[dim])))
        if draw(st.booleans()):
            return [_op("unflatten", dim, parts)]
        new = list(shape[: dim % nd]) + list(parts) + list(shape[dim % nd + 1 :])
        return [_op(draw(st.sampled_from(["reshape", "view"])), *new)]
    return [_op("reshape", *shape)]


@st.composite
def chains(draw: st.DrawFn, full: torch.Tensor) -> tuple[OpSpec, ...]:
    chain: list[OpSpec] = []
    value = full
    for _ in range(draw(st.integers(0, 5))):
        step = draw(op_step(tuple(value.shape)))
        try:
            nxt = replay_ops(value, tuple(step))
        except (RuntimeError, IndexError, ValueError, TypeError):
            continue  # eager torch refuses it, so no loader could do it
        chain.extend(step)
        value = nxt
    return tuple(chain)


@st.composite
def layouts(
    draw: st.DrawFn, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes covering ``shape``: one shard, blocks along a dim, or a 2-D grid,
    with uneven cuts, optionally every box duplicated as a replica, and optionally
    one more box overlapping the others in part."""
    nd = len(shape)
    dims = draw(st.sampled_from(["one", "blocks", "grid"])) if nd else "one"
    chosen = (
        []
        if dims == "one"
        else draw(
            st.lists(
                st.integers(0, nd - 1), min_size=1, max_size=2 if dims == "grid" else 1, unique=True
            )
        )
    )
    cuts: dict[int, list[int]] = {}
    for d in chosen:
        inner = draw(st.lists(st.integers(0, shape[d]), max_size=3))
        cuts[d] = sorted({0, shape[d], *inner})
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((0,) * nd, tuple(shape))]
    for d, c in cuts.items():
        new = []
        for off, sh in boxes:
            for a, b in itertools.pairwise(c):
                o, s = list(off), list(sh)
                o[d], s[d] = a, b - a
                new.append((tuple(o), tuple(s)))
        boxes = new
    if draw(st.booleans()):
        boxes = boxes + draw(st.permutations(boxes))
    if draw(st.booleans()):
        # A partial replica: any sub-box, overlapping others only in part.
        lo = [draw(st.integers(0, n - 1)) for n in shape]
        hi = [draw(st.integers(a + 1, n)) for a, n in zip(lo, shape, strict=True)]
        boxes.insert(
            draw(st.integers(0, len(boxes))),
            (tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True))),
        )
    return boxes


def _dest_view(
    param: torch.Tensor, shape: tuple[int, ...], perm: list[int], pads: list[int], lead: int
) -> torch.Tensor:
    """A strided view of ``shape`` inside the flat ``param``: dims permuted by
    ``perm``, each padded by ``pads``, starting ``lead`` elements in."""
    nd = len(shape)
    container = [shape[p] + pads[i] for i, p in enumerate(perm)]
    holder = param[lead:].view(container) if container else param[lead : lead + 1].view(())
    view = holder
    for i, p in enumerate(perm):
        view = view.narrow(i, 0, shape[p])
    return view.permute(*[perm.index(d) for d in range(nd)]) if nd else view


@st.composite
def worlds(draw: st.DrawFn, kit: Any) -> dict[str, Any]:
    """A distinct-valued source, a valid chain, a shard layout and a destination."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4), label="shape"))
    dtype = draw(st.sampled_from([torch.float32, torch.int16, torch.bfloat16]), label="dtype")
    full = (
        kit.distinct(shape, torch.int16).view(torch.bfloat16)
        if dtype == torch.bfloat16
        else kit.distinct(shape, dtype)
    )
    chain = draw(chains(full), label="chain")
    result = tuple(replay_ops(full, chain).shape)
    nd = len(result)
    perm = draw(st.permutations(range(nd)), label="perm")
    pads = draw(st.lists(st.integers(0, 2), min_size=nd, max_size=nd), label="pads")
    lead = draw(st.integers(0, 3), label="lead")
    numel = math.prod(result[p] + pads[i] for i, p in enumerate(perm)) + lead
    return {
        "full": full,
        "chain": chain,
        "dest": (result, list(perm), pads, lead),
        "numel": numel,
        "boxes": draw(layouts(shape), label="boxes"),
        "packed": draw(st.booleans(), label="packed"),
        "budget": draw(st.sampled_from([1, 2, 64]), label="budget"),
        "pack_specs": draw(st.booleans(), label="pack_specs"),
        # Cheap descriptors and packs steer small cases into every option.
        "costs": draw(st.sampled_from([(16384, 16384), (1, 0), (0, 0)]), label="costs"),
    }


def _plan_and_check(kit: Any, w: dict[str, Any], cap: CaptureResult, truth: torch.Tensor) -> None:
    pub = kit.Published()
    sessions = [f"s{i % 3}" for i in range(len(w["boxes"]))] if w["packed"] else None
    pub.add("src", w["full"], w["boxes"], packed=w["packed"], sessions=sessions)
    plan = plan_transfer(
        cap,
        pub.sources,
        w["budget"],
        pack_specs=w["pack_specs"],
        descriptor_cost_bytes=w["costs"][0],
        pack_cost_bytes=w["costs"][1],
    )
    assert plan.fallback == []
    for kind, n in plan.choices.items():
        if n:
            event(f"copy planned as {kind}")
    param = torch.zeros(w["numel"], dtype=w["full"].dtype)
    kit.reconstruct(plan, {"p": param})
    assert param.view(torch.uint8).numpy().tobytes() == truth.view(torch.uint8).numpy().tobytes()
    # The compiled form of the same plan moves the same bytes.
    replayed = torch.zeros_like(param)
    dest = dest_layout_of({"p": replayed})
    bound = compile_plan(plan, pub.sources, dest).bind(
        pub.sources, lambda _: replayed.data_ptr(), dest
    )
    execute_bound(bound, lambda _: replayed.data_ptr(), InMemoryReadExecutor())
    assert replayed.view(torch.uint8).numpy().tobytes() == truth.view(torch.uint8).numpy().tobytes()
    # Accounting: the chosen plan never reads fewer bytes than the exact plan needs.
    assert plan.bytes_planned() >= plan.exact_bytes
    assert plan.exact_bytes == math.prod(w["dest"][0]) * w["full"].element_size()


@SETTINGS
@given(data=st.data())
def test_any_allow_listed_chain_reconstructs_bit_for_bit(kit: Any, data: st.DataObject) -> None:
    w = data.draw(worlds(kit))
    truth = torch.zeros(w["numel"], dtype=w["full"].dtype)
    dest = _dest_view(truth, *w["dest"])
    copy = kit.copy_record("src", w["chain"], "p", dest, w["full"].dtype)
    kit.eager(w["full"], copy, truth)
    event(f"chain of {len(w['chain'])} ops")
    _plan_and_check(kit, w, CaptureResult(copies=[copy]), truth)


class _Loader(torch.nn.Module):
    """One flat parameter whose loader applies a chain and copies into a strided view."""

    def __init__(self, w: dict[str, Any]) -> None:
        super().__init__()
        self.w = w
        self.p = torch.nn.Parameter(
            torch.zeros(w["numel"], dtype=w["full"].dtype), requires_grad=False
        )
        self.p.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        _dest_view(param.data, *self.w["dest"]).copy_(replay_ops(loaded, self.w["chain"]))

    def load_weights(self, weights: Any) -> None:
        for _, loaded in weights:
            self.p.weight_loader(self.p, loaded)  # type: ignore[operator]


@settings(SETTINGS, max_examples=100)
@given(data=st.data())
def test_chains_captured_through_lazy_weights_reconstruct_bit_for_bit(
    kit: Any, data: st.DataObject
) -> None:
    w = data.draw(worlds(kit))
    engine = _Loader(w)
    engine.load_weights([("src", w["full"])])  # the engine's loader on the full tensor
    with torch.device("meta"):
        twin = _Loader(w)
    cap = capture_geometry(twin, [("src", w["full"].dtype, tuple(w["full"].shape))])
    assert cap.unsupported == [] and cap.unattributed == 0 and len(cap.copies) == 1
    _plan_and_check(kit, w, cap, engine.p.detach())
