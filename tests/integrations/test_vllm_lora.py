"""LoRA adapter refit into a serving vLLM engine (docs/vllm.md, "LoRA adapters").

One engine (a tiny Llama, ``enable_lora=True``, CPU) serves all these tests. A
trainer publishes a PEFT adapter as versions of a refitd model of its own; the
engine refits it with no disk, into a free slot, and then serves exactly what vLLM
serves with the same adapter loaded from disk in PEFT format (tokens and top
logprobs), after the first update and after a replay. An adapter update refused
before any byte moves leaves the adapter serving what it served.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.lora_ranks import TARGETS, fsdp_adapter_rank, peft_state
from support.vllm_world import cpu_llm, running, vllm_daemon
from vllm_models import LLAMA, write_model

from refitd.integrations.lora import LoraConfig, LoraPublisher, lora_update, save_peft

pytestmark = pytest.mark.timeout(600)

CONFIG = LoraConfig(r=8, lora_alpha=20, target_modules=TARGETS)  # scaling 2.5: B is rounded
ADAPTER, ADAPTER_ID, MODEL = "policy", 7, "policy-lora"


@dataclass
class World:
    root: Path
    url: str
    llm: Any
    runner: asyncio.Runner
    publisher: LoraPublisher
    disk_ids: Iterator[int]

    def publish(self, state: dict[str, torch.Tensor], version: int, config: LoraConfig) -> None:
        self.publisher.config = config
        self.runner.run(self.publisher.publish(state, version))

    def pull_ids(self) -> set[str]:
        """The pulls the engine's daemon reports (running and recently ended)."""
        from refitd.client.http import RefitClient

        async def ask() -> set[str]:
            async with RefitClient(self.url) as c:
                return {p.pull_id for p in await c.pulls()}

        return self.runner.run(ask())

    def next_version(self) -> int:
        return (self.publisher.shards.version or 0) + 1

    def refit(self, version: int, config: LoraConfig = CONFIG) -> dict[str, Any]:
        from refitd.integrations.vllm.lora import refit_adapter

        info = lora_update(ADAPTER, ADAPTER_ID, MODEL, version, config)
        [stats] = refit_adapter(self.llm, info)  # and the prefix cache reset
        return dict(stats)

    def from_disk(
        self, state: dict[str, torch.Tensor], tag: str, config: LoraConfig = CONFIG
    ) -> Any:
        """What vLLM serves with ``state`` loaded from disk in PEFT format (the adapter
        is removed after, so its slot is free again)."""
        from vllm.lora.request import LoRARequest

        path = save_peft(self.root / tag, state, config)
        request = LoRARequest(f"disk-{tag}", next(self.disk_ids), str(path))
        try:
            return served(self.llm, request)
        finally:
            self.llm.llm_engine.remove_lora(request.lora_int_id)


def served(llm: Any, lora: Any) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Greedy tokens and every step's top-3 logprobs for two prompts, in one batch of
    this adapter's requests alone (each comparison batches the same way)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in ([5, 17, 33, 99, 200], [7, 300, 42])]
    out = []
    for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False):
        c = o.outputs[0]
        steps = [sorted((int(t), float(lp.logprob)) for t, lp in s.items()) for s in c.logprobs]
        out.append((list(c.token_ids), steps))
    return out


def refitted() -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER, ADAPTER_ID, f"refitd:{MODEL}")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from refitd.integrations.connect import daemon_client

    with vllm_daemon(tmp_path_factory, "lora") as url:
        root = tmp_path_factory.mktemp("lora")
        write_model(root / "base", LLAMA, seed=1)
        llm = cpu_llm(
            root / "base",
            enable_lora=True,
            max_loras=3,  # the refitted adapter, its spare slot, one from disk
            max_lora_rank=16,
            weight_transfer_config={"backend": "refitd"},
        )
        with running(llm), asyncio.Runner() as runner:
            # the base model's refits too (the trainer engine's init info: kept as is)
            llm.init_weight_transfer_engine({"init_info": {"model": "base"}})
            client = daemon_client(url, "")
            publisher = LoraPublisher(client, MODEL, CONFIG)
            try:
                yield World(root, url, llm, runner, publisher, iter(range(100, 200)))
            finally:
                runner.run(publisher.close())
                runner.run(client.close())


def test_a_refitted_adapter_serves_what_vllm_serves_from_disk_after_an_update_and_a_replay(
    world: World,
) -> None:
    base = served(world.llm, None)
    v1, v2 = peft_state(1), peft_state(2)
    n = world.next_version()
    world.publish(v1, n, CONFIG)
    first = world.refit(n)
    assert first["version"] == n
    got = served(world.llm, refitted())
    assert got != base  # the adapter changes what is served
    assert got == world.from_disk(v1, f"v{n}")

    world.publish(v2, n + 1, CONFIG)
    second = world.refit(n + 1)
    assert second["replayed"] and second["old_slot"] == first["slot"] != second["slot"]
    got2 = served(world.llm, refitted())
    assert got2 != got
    assert got2 == world.from_disk(v2, f"v{n + 1}")
    assert served(world.llm, None) == base  # the base model serves as before

    # An fp32 adapter (a new layout: planned again) is cast to the engine's LoRA dtype
    # before vLLM scales it, at install as on disk.
    v3 = {k: t.float() * 1.5 for k, t in peft_state(3).items()}
    world.publish(v3, n + 2, CONFIG)
    third = world.refit(n + 2)
    assert not third["replayed"] and third["old_slot"] == second["slot"]
    assert served(world.llm, refitted()) == world.from_disk(v3, f"v{n + 2}")


def narrowed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with one A a column short of its layer's input features."""
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
    return {**state, key: state[key][:, :-1].contiguous()}


@pytest.mark.parametrize(
    ("state", "config", "why"),
    [
        (peft_state(3, r=32), LoraConfig(32, 64, TARGETS), "greater than max_lora_rank 16"),
        (peft_state(3, extra="model.norm"), CONFIG, "no LoRA layer for .*model.norm"),
        (peft_state(3, extra="lm_head"), CONFIG, "LogitsProcessorWithLoRA.* does not plan"),
        (narrowed(peft_state(3)), CONFIG, "fills 255 of the 256 input features"),
    ],
    ids=["rank-over-max", "unsupported-module", "layer-without-slots", "shape-mismatch"],
)
def test_an_adapter_update_refused_before_any_byte_moves_leaves_the_old_version_serving(
    world: World, state: dict[str, torch.Tensor], config: LoraConfig, why: str
) -> None:
    if lora_stats_or_none(world.llm) is None:
        world.publish(peft_state(1), world.next_version(), CONFIG)
        world.refit(world.publisher.shards.version or 0)
    before = served(world.llm, refitted())
    version = world.next_version()
    world.publish(state, version, config)
    pulls = world.pull_ids()
    with pytest.raises(Exception, match=why):
        world.refit(version, config)
    assert world.pull_ids() <= pulls  # no pull was submitted: no byte moved
    assert served(world.llm, refitted()) == before
    # and the next update lands as if nothing had been refused
    good = peft_state(4)
    world.publish(good, version + 1, CONFIG)
    world.refit(version + 1)
    assert world.pull_ids() - pulls, "an update that lands is a pull the daemon reports"
    assert served(world.llm, refitted()) == world.from_disk(good, f"v{version + 1}")


def lora_stats_or_none(llm: Any) -> dict[str, Any] | None:
    from refitd.integrations.vllm.worker import lora_stats as stats

    [only] = llm.collective_rpc(stats)
    return None if only is None else dict(only)


def test_with_no_free_slot_an_update_is_refused_and_every_adapter_serves_on_unchanged(
    world: World,
) -> None:
    from vllm.lora.request import LoRARequest

    if lora_stats_or_none(world.llm) is None:
        world.publish(peft_state(1), world.next_version(), CONFIG)
        world.refit(world.publisher.shards.version or 0)
    # Every other slot holds an adapter vLLM loaded from disk.
    from refitd.integrations.vllm.lora import adapter_slots

    [slots] = world.llm.collective_rpc(adapter_slots)
    others = [
        LoRARequest(
            f"other-{i}",
            next(world.disk_ids),
            str(save_peft(world.root / f"o{i}", peft_state(10 + i), CONFIG)),
        )
        for i in range(slots["slots"].count(None))
    ]
    before = {r.lora_name: served(world.llm, r) for r in [refitted(), *others]}
    version = world.next_version()
    world.publish(peft_state(5), version, CONFIG)
    with pytest.raises(Exception, match="no free LoRA slot"):
        world.refit(version)
    assert {r.lora_name: served(world.llm, r) for r in [refitted(), *others]} == before
    # One slot freed: the update lands, and the other adapters serve as they did.
    world.llm.llm_engine.remove_lora(others[0].lora_int_id)
    world.refit(version)
    assert served(world.llm, refitted()) == world.from_disk(peft_state(5), f"v{version}")
    for r in others[1:]:
        assert served(world.llm, r) == before[r.lora_name]
        world.llm.llm_engine.remove_lora(r.lora_int_id)


def test_a_base_refit_of_a_lora_engine_serves_what_vllm_reloads_and_adapters_refit_after_it(
    world: World,
) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    before = served(world.llm, None)
    state = write_model(world.root / "base2", LLAMA, seed=2)
    info = RefitdTrainerInitInfo(rank=0, model="base", url=world.url)
    trainer = RefitdTrainerEngine.trainer_init(
        info, client=LLMSyncClient(world.llm), source=TensorSource(state)
    )
    try:
        trainer.send_weights()
    finally:
        trainer.shutdown()
    after = served(world.llm, None)
    assert after != before
    world.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(world.root / "base2")})
    assert served(world.llm, None) == after  # vLLM's own reload of the same weights
    # vLLM drops every adapter after a base update; the next adapter update lands anew.
    version = world.next_version()
    world.publish(peft_state(6), version, CONFIG)
    stats = world.refit(version)
    assert stats["old_slot"] is None
    assert served(world.llm, refitted()) == world.from_disk(peft_state(6), f"v{version}")


def test_the_documented_lora_snippet_refits_an_adapter_that_serves_as_vllm_from_disk(
    world: World,
) -> None:
    from support.docs import python_blocks
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    (block,) = python_blocks("## LoRA adapters (`refitd.integrations.lora`)", "docs/vllm.md")
    adapter = {k: t for k, t in peft_state(7).items() if ".self_attn." in k}
    ns: dict[str, Any] = {
        "llm": world.llm,
        "adapter": adapter,
        "prompts": [TokensPrompt(prompt_token_ids=[5, 17, 33])],
        "params": SamplingParams(max_tokens=4, temperature=0, detokenize=False),
    }
    exec(block, ns)
    try:
        assert ns["stats"]["version"] == 1 and ns["served"][0].outputs[0].token_ids
        doc = LoRARequest("doc", 11, "refitd:doc-lora")
        assert served(world.llm, doc) == world.from_disk(adapter, "doc", ns["config"])
    finally:
        world.llm.llm_engine.remove_lora(11)  # its slot is free again for the other tests


def test_fsdp2_sharded_adapter_parameters_refit_the_engine_as_vllm_serves_them_from_disk(
    world: World,
) -> None:
    from vllm.lora.request import LoRARequest

    from refitd.integrations.vllm.worker import refit_lora

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=fsdp_adapter_rank, args=(r, port, world.url, CONFIG, 8, queue, done))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        assert sorted(queue.get(timeout=120) for _ in procs) == [0, 1]
        info = lora_update("fsdp", 12, "fsdp-lora", 1, CONFIG)
        [stats] = world.llm.collective_rpc(refit_lora, args=(info,))
        fsdp = LoRARequest("fsdp", 12, "refitd:fsdp-lora")
        assert served(world.llm, fsdp) == world.from_disk(peft_state(8), "fsdp")
        assert stats["bytes"] == sum(t.numel() * 2 for t in peft_state(8).values())
    finally:
        done.set()
        for p in procs:
            p.join(60)
        world.llm.llm_engine.remove_lora(12)  # its slot is free again for the other tests
    assert [p.exitcode for p in procs] == [0, 0]


def test_an_install_with_no_pull_of_that_version_is_refused_and_the_adapter_serves_on(
    world: World,
) -> None:
    from refitd.integrations.vllm.worker import refit_lora

    if lora_stats_or_none(world.llm) is None:
        world.publish(peft_state(1), world.next_version(), CONFIG)
        world.refit(world.publisher.shards.version or 0)
    before = served(world.llm, refitted())
    info = lora_update(ADAPTER, ADAPTER_ID, MODEL, 99, CONFIG)
    info["lora"]["step"] = "install"  # the second half of a TP > 1 refit, alone
    with pytest.raises(Exception, match="install of v99 refused on rank 0: this rank holds no"):
        world.llm.collective_rpc(refit_lora, args=(info,))
    assert served(world.llm, refitted()) == before
