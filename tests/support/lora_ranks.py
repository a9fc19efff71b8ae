"""Trainer-side helpers of the LoRA tests: a PEFT adapter of the tests' Llama, and an
FSDP2 trainer rank publishing one (spawned: this module imports little, so a rank
starts quickly)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

from refitd.bench.vllm import llama_config
from refitd.integrations.lora import LoraConfig, LoraPublisher, peft_names

__all__ = ["LLAMA", "TARGETS", "fsdp_adapter_rank", "peft_state"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

LLAMA = llama_config()
"""The tests' Llama (``tests/integrations/vllm_models.LLAMA``): the adapter's shapes."""


def peft_state(seed: int, r: int = 8, extra: str = "") -> dict[str, torch.Tensor]:
    """A PEFT adapter of the tests' Llama: every linear layer, rank ``r``, bf16."""
    h, inter = LLAMA["hidden_size"], LLAMA["intermediate_size"]
    kv = LLAMA["num_key_value_heads"] * LLAMA["head_dim"]
    dims = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LLAMA["num_hidden_layers"]):
        for module, (n_in, n_out) in dims.items():
            p = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{p}.lora_A.weight"] = (torch.randn(r, n_in, generator=g) * 0.2).bfloat16()
            out[f"{p}.lora_B.weight"] = (torch.randn(n_out, r, generator=g) * 0.2).bfloat16()
    if extra:
        out[f"base_model.model.{extra}.lora_A.weight"] = torch.zeros(r, h).bfloat16()
        out[f"base_model.model.{extra}.lora_B.weight"] = torch.zeros(h, r).bfloat16()
    return out


def fsdp_adapter_rank(
    rank: int, port: int, url: str, config: LoraConfig, seed: int, queue: Any, done: Any
) -> None:
    """One of two gloo trainer ranks: the adapter of ``seed`` as a PEFT model's
    parameters (``...lora_A.default.weight``), sharded by FSDP2, each rank publishing
    its own rows; it stays up until the engine has refitted (``done``)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from refitd.integrations.connect import daemon_client
    from refitd.integrations.sources import FSDPSource

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = torch.nn.Module()
    for key, t in peft_state(seed).items():
        path = key.removeprefix("base_model.model.").removesuffix(".weight") + ".default"
        mod = model
        for part in path.split("."):
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]  # type: ignore[assignment]
        mod.register_parameter("weight", torch.nn.Parameter(t.clone()))
    fully_shard(model)

    async def publish() -> None:
        client = daemon_client(url, "")
        publisher = LoraPublisher(client, "fsdp-lora", config, rank=rank, world_size=2)
        await publisher.publish(FSDPSource(model, name_map=peft_names()), 1)
        queue.put(rank)
        await asyncio.to_thread(done.wait, 120)
        await publisher.close()
        await client.close()

    asyncio.run(publish())
    dist.destroy_process_group()
