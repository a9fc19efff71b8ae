"""LoRA adapter refit in a serving vLLM engine, the worker's side: no disk, one slot at a time.

vLLM serves an adapter from *slots*: every LoRA layer holds stacked tensors
``lora_a_stacked[k]`` ``[max_loras, 1, max_lora_rank, in]`` and ``lora_b_stacked[k]``
``[max_loras, 1, out, max_lora_rank]`` (``k``: the sub-layer of a packed module, q/k/v
of ``qkv_proj``, gate/up of ``gate_up_proj``), and ``lora_index_to_id`` says which
adapter each slot holds. ``update_weights({"phase": "lora", ...})``
(:func:`refitd.integrations.lora.lora_update`) refits one adapter, a refitd model of
its own, as follows.

**Planned by capture.** A meta twin holds one slot of every LoRA layer's stacked
tensors. Its ``load_weights`` runs vLLM's own path from the manifest's placeholders:
``LoRAModel.from_lora_tensors`` (names, the weights mapper, the dtype cast), the
manager's ``_create_merged_loras_inplace`` (packing q/k/v and gate/up) and each
layer's own ``set_lora`` (TP slicing of A or B, placement in the slot). The planner
records which slice of which trainer tensor lands where. One step of that path is
arithmetic, which a pull cannot do: ``optimize()`` multiplies B by the module's
scaling (``alpha / r``, rsLoRA's ``alpha / sqrt(r)``, patterns included). The capture
takes each module's scaling from vLLM (``LoRALayerWeights.from_config``, per update,
as the update's configuration says) and sets it to 1 on the twin's copy, so the pull
moves B as published and the install multiplies it in the slot's dtype, as
``optimize()`` does (``lora_b *= scaling``), giving the same bits.

**Refused before any byte moves** (:class:`~refitd.integrations.lora.AdapterRefused`,
naming the adapter and why): an engine without ``enable_lora``; a configuration vLLM
refuses (``PEFTHelper.validate_legal``: a rank over ``max_lora_rank``, bias, DoRA...);
a target module vLLM has no LoRA layer for (the check of vLLM's own disk loader); a
tensor that lands in no slot; a slice that does not fill its slot's input or output
dimension (a shape mismatch); no free slot to land in.

**Atomic.** The pull lands in the adapter's own loader-format buffers (``direct``
mode: nothing serves from them). Only then is a *free* slot written (zeroed, the
captured regions copied, B scaled) and the adapter's id moved to it in
``lora_index_to_id``, then the slot it had freed. vLLM rebuilds its punica mapping
from that list at the next step. A failed or refused update leaves the old slot
serving. The adapter is registered and pinned in the manager (no disk path to reload
it from), so the LRU never evicts it.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.integrations.lora import PEFT_KEY, AdapterRefused
from refitd.integrations.vllm.prepared import place_parameter
from refitd.reshard.types import CaptureResult, UnsupportedReshard

__all__ = ["AdapterRefit", "LoraSlots", "adapter_slots", "refit_adapter", "refit_lora"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Region:
    """One captured write into a slot: the twin parameter, the source it comes from,
    and where in one slot (elements)."""

    param: str
    src: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _slot_layers(manager: Any) -> dict[str, Any]:
    """The manager's LoRA layers that hold slots (stacked A and B tensors)."""
    return {
        n: m
        for n, m in manager.modules.items()
        if isinstance(getattr(m, "lora_a_stacked", None), tuple)
        and isinstance(getattr(m, "lora_b_stacked", None), tuple)
    }


def slot_names(layers: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """Twin parameter name -> (layer, ``a`` or ``b``, sub-layer index)."""
    out: dict[str, tuple[str, str, int]] = {}
    for name, layer in layers.items():
        for ab in ("a", "b"):
            for k in range(len(getattr(layer, f"lora_{ab}_stacked"))):
                out[f"{name}.{ab}{k}"] = (name, ab, k)
    return out


class _SlotTwin(torch.nn.Module):
    """One slot of every LoRA layer, on meta; ``load_weights`` is vLLM's adapter path."""

    def __init__(self, manager: Any, helper: Any, lora_dtype: torch.dtype) -> None:
        super().__init__()
        self._manager = manager
        self._helper = helper
        self._dtype = lora_dtype
        self._layers = _slot_layers(manager)
        for pname, (layer, ab, k) in slot_names(self._layers).items():
            t = getattr(self._layers[layer], f"lora_{ab}_stacked")[k]
            meta = torch.empty((1, *t.shape[1:]), dtype=t.dtype, device="meta")
            place_parameter(self, pname, torch.nn.Parameter(meta, requires_grad=False))

    def load_weights(self, weights: Any) -> set[str]:
        from vllm.lora.lora_model import LoRAModel

        mgr = self._manager
        model = mgr.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lm = LoRAModel.from_lora_tensors(
            lora_model_id=1,
            tensors=dict(weights),
            peft_helper=self._helper,
            device="meta",
            dtype=self._dtype,
            model_vocab_size=mgr.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        for w in lm.loras.values():
            w.scaling = 1.0  # applied at install, in the slot (see the module docstring)
        mgr._create_merged_loras_inplace(lm)
        params = dict(self.named_parameters())
        for name, layer in self._layers.items():
            lora = mgr._get_lora_layer_weights(lm, name)
            if lora is None:
                continue
            view = copy.copy(layer)  # the live layer's set_lora, writing the twin's slot
            view.lora_a_stacked = tuple(
                params[f"{name}.a{k}"] for k in range(len(layer.lora_a_stacked))
            )
            view.lora_b_stacked = tuple(
                params[f"{name}.b{k}"] for k in range(len(layer.lora_b_stacked))
            )
            type(layer).set_lora(view, 0, lora.lora_a, lora.lora_b)
        return set()


@dataclass
class AdapterRefit:
    """One adapter's refit state on this worker: its receiver and captured regions."""

    name: str
    adapter_id: int
    model: str
    receiver: Any
    dest: torch.nn.Module
    regions: list[Region] = field(default_factory=list)
    scales: dict[str, float] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    helper: Any = None
    """vLLM's ``PEFTHelper`` of the update running (the twin's loader reads it)"""


def adapter_slots(worker: Any) -> dict[str, Any]:
    """``collective_rpc``: this worker's LoRA slots: which adapter id each holds."""
    manager = getattr(worker.model_runner.get_model(), "lora_manager", None)
    if manager is None:
        return {}
    return {"slots": list(manager.lora_index_to_id)}


def refit_adapter(llm: Any, info: dict[str, Any], *, reset_prefix_cache: bool = True) -> list[Any]:
    """Refit one adapter on every rank of the in-process ``llm`` (``info``:
    :func:`~refitd.integrations.lora.lora_update`); each rank's stats. At TP > 1 every
    rank pulls first, then every rank installs (a second call), so a pull that fails
    or is refused on any rank leaves every rank serving the old version. Then the
    prefix cache is reset (no request reuses blocks of the old version), unless
    ``reset_prefix_cache=False``."""
    ranks = int(llm.llm_engine.vllm_config.parallel_config.world_size)
    if ranks == 1:
        stats = llm.collective_rpc(refit_lora, args=(info,))
    else:
        steps = [{**info, "lora": {**info["lora"], "step": step}} for step in ("pull", "install")]
        llm.collective_rpc(refit_lora, args=(steps[0],))
        stats = llm.collective_rpc(refit_lora, args=(steps[1],))
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    return list(stats)


class LoraSlots:
    """The worker's adapter refits (one per adapter name), over the engine's manager."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        manager = getattr(model, "lora_manager", None)
        if manager is None:
            raise AdapterRefused(
                "LoRA refit refused: the engine serves no LoRA (start it with enable_lora=True)"
            )
        self.manager = manager
        self.vllm_config = vllm_config
        self.lora_config = vllm_config.lora_config
        self.adapters: dict[str, AdapterRefit] = {}
        self.last_stats: dict[str, Any] | None = None

    # ------------------------------------------------------------ checks

    def helper(self, name: str, config: dict[str, Any]) -> Any:
        """vLLM's ``PEFTHelper`` of ``config``, refused as vLLM's loader refuses it."""
        from vllm.lora.peft_helper import PEFTHelper

        text = self.vllm_config.model_config.hf_text_config
        try:
            helper = PEFTHelper.from_dict(
                {
                    **config,
                    "vllm_max_position_embeddings": getattr(text, "max_position_embeddings", None),
                }
            )
            helper.validate_legal(self.lora_config)
        except ValueError as exc:
            raise AdapterRefused(f"adapter {name!r} refused: {exc}") from exc
        return helper

    def expected_modules(self) -> set[str]:
        """The module names vLLM's disk loader accepts (``_load_adapter``'s set)."""
        mgr = self.manager
        out: set[str] = set()
        for module in mgr.supported_lora_modules:
            out.update(mgr.packed_modules_mapping.get(module, [module]))
        return out

    def check_manifest(self, name: str, manifest: list[tuple[str, Any, Any]]) -> None:
        """Refuse sources vLLM's loader would refuse: not a LoRA weight, or a module
        with no LoRA layer in this engine."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        from refitd.integrations.lora import check_peft_shapes

        # the whole adapter, as the ranks published it (FSDP2 shards included)
        check_peft_shapes(name, {src: tuple(shape) for src, _dtype, shape in manifest})
        expected = self.expected_modules()
        unexpected = []
        for src, _dtype, _shape in manifest:
            if PEFT_KEY.match(src) is None:
                raise AdapterRefused(f"adapter {name!r} refused: {src!r} is not a LoRA weight")
            module, _ = parse_fine_tuned_lora_name(src)
            # vLLM's disk loader's rule: an expert's module by its "experts.N.proj" suffix
            at = module.find(".experts")
            key = module[at + 1 :] if at >= 0 else module.rsplit(".", 1)[-1]
            if key not in expected:
                unexpected.append(module)
        if unexpected:
            raise AdapterRefused(
                f"adapter {name!r} refused: vLLM has no LoRA layer for {sorted(set(unexpected))} "
                f"(this engine's LoRA modules: {sorted(expected)})"
            )

    def regions(self, name: str, capture: CaptureResult, sources: list[str]) -> list[Region]:
        """The captured writes as slot regions; refused if a source lands nowhere, or
        a slice does not fill the slot's input (A) or output (B) dimension."""
        if capture.unsupported or capture.unattributed:
            reasons = "; ".join(f"{s}: {r}" for s, r in capture.unsupported_reasons.items())
            raise UnsupportedReshard(
                f"adapter {name!r} refused: {reasons or ''} {'; '.join(capture.unowned)}".strip()
            )
        layers = _slot_layers(self.manager)
        names = slot_names(layers)
        out: list[Region] = []
        for c in capture.copies:
            layer, ab, k = names[c.param_name]
            slot = getattr(layers[layer], f"lora_{ab}_stacked")[k]
            full = slot.shape[3] if ab == "a" else slot.shape[2]
            got = c.dest_shape[-1] if ab == "a" else c.dest_shape[-2]
            if got != full:
                raise AdapterRefused(
                    f"adapter {name!r} refused: {c.src_name!r} fills {got} of the "
                    f"{full} {'input' if ab == 'a' else 'output'} features of {layer}'s slot"
                )
            out.append(Region(c.param_name, c.src_name, c.dest_offset, c.dest_shape, c.dest_stride))
        landed = {r.src for r in out}
        lost = [s for s in sources if s not in landed]
        other = {n: type(m).__name__ for n, m in self.manager.modules.items() if n not in layers}
        held = sorted(
            {other[n] for s in lost for n in other if s.startswith(f"base_model.model.{n}.")}
        )
        if held:  # vLLM has a LoRA layer for them, of a kind with no lora_a/b_stacked slots
            raise AdapterRefused(
                f"adapter {name!r} refused: {lost[:3]} ({len(lost)} tensors) are for vLLM's "
                f"{held} LoRA layers, whose slots refitd does not plan yet"
            )
        if lost:
            raise AdapterRefused(
                f"adapter {name!r} refused: {lost[:3]} ({len(lost)} tensors) land in no LoRA slot"
            )
        return out

    def scales(self, helper: Any, sources: list[str]) -> dict[str, float]:
        """Each B source's scaling, as vLLM computes it for the module."""
        from vllm.lora.lora_weights import LoRALayerWeights
        from vllm.lora.utils import parse_fine_tuned_lora_name

        out = {}
        for src in sources:
            module, is_a = parse_fine_tuned_lora_name(src)
            if not is_a:
                out[src] = float(LoRALayerWeights.from_config(module, helper, module).scaling)
        return out

    # ------------------------------------------------------------ one adapter

    def adapter(self, info: dict[str, Any], local: Any, source: Any, ttl: float) -> AdapterRefit:
        """The refit state of ``info["name"]`` (made on its first update)."""
        from refitd.client.receiver import DaemonReceiver
        from refitd.reshard.geometry import capture_geometry

        name, adapter_id, model = str(info["name"]), int(info["id"]), str(info["model"])
        have = self.adapters.get(name)
        if have is not None:
            if (have.adapter_id, have.model) != (adapter_id, model):
                raise AdapterRefused(
                    f"adapter {name!r} refused: it is id {have.adapter_id} of {have.model!r} "
                    f"here, not id {adapter_id} of {model!r}"
                )
            return have
        taken = {a.adapter_id for a in self.adapters.values()}
        held = self.manager.list_adapters().get(adapter_id)
        # an id this worker registered for the same adapter before a re-init is its own
        if adapter_id in taken or (held is not None and getattr(held, "refitd", None) != name):
            raise AdapterRefused(f"adapter {name!r} refused: id {adapter_id} is already in use")
        layers = _slot_layers(self.manager)
        dest = torch.nn.Module()
        for pname, (layer, ab, k) in slot_names(layers).items():
            t = getattr(layers[layer], f"lora_{ab}_stacked")[k]
            if not t.is_contiguous():  # the install copies regions at the twin's strides
                raise AdapterRefused(
                    f"adapter {name!r} refused: {layer}'s lora_{ab}_stacked[{k}] is not contiguous"
                )
            buf = torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device)
            place_parameter(dest, pname, torch.nn.Parameter(buf, requires_grad=False))
        state = AdapterRefit(name, adapter_id, model, None, dest)

        def twin() -> torch.nn.Module:
            return _SlotTwin(self.manager, state.helper, self.lora_config.lora_dtype)

        def capture(tw: torch.nn.Module, manifest: list[Any]) -> CaptureResult:
            self.check_manifest(name, manifest)
            result = capture_geometry(tw, manifest)
            state.regions = self.regions(name, result, [m[0] for m in manifest])
            return result

        state.receiver = DaemonReceiver(
            local=local,
            source=source,
            model=model,
            engine=dest,
            twin=twin,
            capture=capture,
            mode="direct",  # nothing serves from these buffers: the slot is written after
            lease_ttl_s=ttl,
            # the slot's padding past the rank: zeroed at install, as vLLM's reset_lora
            allow_unwritten=list(slot_names(layers)),
        )
        self.adapters[name] = state
        return state

    async def refit(
        self, info: dict[str, Any], version: int | None, local: Any, source: Any, ttl: float
    ) -> dict[str, Any]:
        """Pull ``version`` of the adapter into its buffers (checked, planned or
        replayed); the slot is not touched yet (:meth:`install`)."""
        t0 = time.perf_counter()
        state = self.adapter(info, local, source, ttl)
        self.free_slot(state, version)  # refused now, before any byte moves, if none
        helper = self.helper(state.name, dict(info["config"]))
        state.helper = helper
        stats = await state.receiver.refit(version)
        sources = sorted({r.src for r in state.regions})
        state.scales = self.scales(helper, sources)
        return {"name": state.name, "stats": stats, "t0": t0}

    def free_slot(self, state: AdapterRefit, version: int | None) -> int:
        """A slot no adapter holds, where the adapter's next version lands."""
        slots: list[int | None] = self.manager.lora_index_to_id
        free = next((i for i, a in enumerate(slots) if a is None), None)
        if free is None:
            raise AdapterRefused(
                f"adapter {state.name!r} refused: no free LoRA slot to land "
                f"{'the newest version' if version is None else f'v{version}'} in "
                f"(max_loras={len(slots)}, holding adapter ids {slots}): each refitted "
                "adapter needs a spare slot to switch through"
            )
        return free

    def install(self, name: str, version: int) -> dict[str, Any]:
        """Write the pulled version into a free slot, then move the adapter's id to it
        (the atomic switch: the old slot serves until the id moves)."""
        from vllm.lora.lora_model import LoRAModel

        t0 = time.perf_counter()
        state = self.adapters[name]
        mgr = self.manager
        slots: list[int | None] = mgr.lora_index_to_id
        old = slots.index(state.adapter_id) if state.adapter_id in slots else None
        free = self.free_slot(state, version)
        layers = _slot_layers(mgr)
        params = dict(state.dest.named_parameters())
        names = slot_names(layers)
        covered: dict[str, int] = {}
        for r in state.regions:
            covered[r.param] = covered.get(r.param, 0) + _numel(r.shape)
        with torch.no_grad():
            for pname, (layer, ab, k) in names.items():
                slot = getattr(layers[layer], f"lora_{ab}_stacked")[k][free]
                if covered.get(pname, 0) != slot.numel():  # captured writes never overlap
                    slot.zero_()  # the padding past the rank, as vLLM's reset_lora leaves it
            for r in state.regions:
                layer, ab, k = names[r.param]
                slot = getattr(layers[layer], f"lora_{ab}_stacked")[k][free : free + 1]
                into = slot.as_strided(r.shape, r.stride, slot.storage_offset() + r.offset)
                pulled = params[r.param].as_strided(r.shape, r.stride, r.offset)
                scale = state.scales.get(r.src, 1.0)
                if ab == "b" and scale != 1:
                    # vLLM's optimize(): lora_b *= scaling, in the LoRA dtype (the same
                    # product as the in-place multiply, written once)
                    torch.mul(pulled, scale, out=into)
                else:
                    into.copy_(pulled)
        # The switch: the new slot is whole before the id moves to it.
        if state.adapter_id not in mgr._registered_adapters:
            rank = max(
                (int(r.shape[-2]) for r in state.regions if names[r.param][1] == "a"), default=1
            )
            held = LoRAModel(state.adapter_id, rank, {})
            held.refitd = name  # whose it is (a re-init keeps it)
            mgr._registered_adapters[state.adapter_id] = held
            mgr._registered_adapters.pin(state.adapter_id)
        slots[free] = state.adapter_id
        if old is not None:
            slots[old] = None
        else:
            mgr._active_adapters[state.adapter_id] = None
            mgr._active_adapters.pin(state.adapter_id)
        state.versions.append(version)
        return {"slot": free, "old_slot": old, "install_s": time.perf_counter() - t0}


def refit_lora(worker: Any, update_info: dict[str, Any]) -> dict[str, Any]:
    """``llm.collective_rpc(refit_lora, args=(lora_update(...),))``: refit one LoRA
    adapter on this worker; its stats. Outside vLLM's weight-update session, whose
    ``finish_weight_update`` drops every adapter. (Also importable from
    :mod:`refitd.integrations.vllm.worker`, whose engine it drives.)"""
    engine = getattr(worker, "weight_transfer_engine", None)
    refit = getattr(engine, "_lora_refit", None)
    if engine is None or refit is None:
        raise RuntimeError("refitd: the engine's weight-transfer backend is not refitd")
    refit(engine.parse_update_info(update_info))
    stats: dict[str, Any] = engine.last_lora
    assert stats is not None
    return stats
