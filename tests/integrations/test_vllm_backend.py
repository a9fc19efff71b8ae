"""refitd as vLLM's weight-transfer backend, end to end on a real vLLM engine (CPU).

One ``LLM`` (a tiny dense Llama written by the test, random weights, no hub) serves
the whole module, with ``weight_transfer_config={"backend": "refitd"}``; a real
``refitd serve`` daemon sits between it and the trainers. The trainers are real:
two gloo ranks under FSDP2 ``fully_shard`` publishing their local shards, or one
rank publishing whole tensors. Truth is the engine's own loaders reading the
trainer's weights from disk, and a fresh ``LLM`` loaded from them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.vllm_world import fresh_serving, running, vllm_daemon
from vllm_models import (
    LLAMA,
    greedy,
    live_params,
    loader_format_mismatches,
    readme_blocks,
    run_fsdp_trainer,
    same_tensors,
    write_model,
)

pytestmark = pytest.mark.timeout(600)


@dataclass
class World:
    root: Path
    url: str
    llm: Any
    truth: tuple[dict[str, torch.Tensor], list[list[int]]]
    """What a fresh ``LLM`` of :data:`TRUTH_SEED`'s weights served: parameters, tokens."""


TRUTH_SEED = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with vllm_daemon(tmp_path_factory, "vllm") as url:
        root = tmp_path_factory.mktemp("models")
        # The truth first: one in-process engine at a time (vLLM's parallel state is
        # per process), so the fresh load runs before the refitted engine starts.
        write_model(root / "truth", LLAMA, seed=TRUTH_SEED)
        truth = fresh_serving(
            root / "truth", lambda fresh: (fresh.collective_rpc(live_params)[0], greedy(fresh))
        )
        write_model(root / "engine", LLAMA, seed=1)
        # The engine is started by the README's own snippet.
        engine_block, _ = readme_blocks("## vLLM backend (`refitd.integrations.vllm`)")
        ns: dict[str, Any] = {"model_dir": str(root / "engine")}
        exec(engine_block, ns)
        with running(ns.pop("llm")) as llm:
            yield World(root, url, llm, truth)


def stats(llm: Any) -> dict[str, Any]:
    from refitd.integrations.vllm.worker import refit_stats

    [only] = llm.collective_rpc(refit_stats)
    return dict(only)


def mismatches(llm: Any, checkpoint: Path) -> list[str]:
    [only] = llm.collective_rpc(
        loader_format_mismatches, args=(str(checkpoint / "model.safetensors"),)
    )
    return list(only)


def test_an_fsdp2_trainer_refits_the_engine_exactly_and_the_next_update_replays_the_plan(
    world: World,
) -> None:
    seen: list[tuple[int, str, dict[str, Any]]] = []
    served: list[list[list[int]]] = []

    def on_event(message: Any) -> Any:
        _, version, checkpoint, _timing = message
        seen.append((version, checkpoint, stats(world.llm)))
        assert mismatches(world.llm, Path(checkpoint)) == [], f"v{version}"
        served.append(greedy(world.llm))
        if len(seen) == 1:
            seen[0][2]["live"] = world.llm.collective_rpc(live_params)[0]
        return ("ok", None)

    job = {
        "config": LLAMA,
        "seeds": [TRUTH_SEED, 3],
        "model": "llama",
        "url": world.url,
        "out": str(world.root / "fsdp"),
    }
    assert run_fsdp_trainer(job, on_event, world.llm) == [0, 0]
    (v1, ck1, s1), (v2, _, s2) = seen
    assert (s1["version"], s1["replayed"], s1["plans"]) == (v1, False, 1)
    assert (s2["version"], s2["replayed"], s2["plans"]) == (v2, True, 1)  # no planning
    assert s1["bytes"] == s2["bytes"] > 0 and served[0] != served[1]

    # The trainer's first checkpoint holds the weights the fixture's truth was loaded from.
    assert same_tensors(Path(ck1), world.root / "truth")
    truth, truth_tokens = world.truth
    live = s1["live"]
    assert sorted(live) == sorted(truth)
    assert [n for n in truth if not torch.equal(live[n], truth[n])] == []
    assert served[0] == truth_tokens


def test_a_new_trainer_layout_replans_and_still_refits_exactly(world: World) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    state = write_model(world.root / "single", LLAMA, seed=5)
    before = stats(world.llm)["plans"] if stats_or_none(world.llm) else 0
    info = RefitdTrainerInitInfo(rank=0, model="llama", url=world.url)
    trainer = RefitdTrainerEngine.trainer_init(
        info, client=LLMSyncClient(world.llm), source=TensorSource(state)
    )
    try:
        trainer.send_weights()
    finally:
        trainer.shutdown()
    after = stats(world.llm)
    assert after["plans"] == before + 1 and not after["replayed"], (before, after)
    assert mismatches(world.llm, world.root / "single") == []


def last_version(llm: Any) -> int | None:
    """The version the engine's last refit installed (None: none yet)."""
    return stats(llm)["version"] if stats_or_none(llm) else None


def stats_or_none(llm: Any) -> bool:
    from refitd.integrations.vllm.worker import refit_stats

    return llm.collective_rpc(refit_stats)[0] is not None


def test_a_manifest_missing_a_weight_is_refused_before_any_byte_moves(world: World) -> None:
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    serving = greedy(world.llm)
    state = write_model(world.root / "partial", LLAMA, seed=6)
    dropped = "model.layers.1.mlp.down_proj.weight"
    source = TensorSource(state, name_map=lambda n: None if n == dropped else n)
    info = RefitdTrainerInitInfo(rank=0, model="llama", url=world.url)
    trainer = RefitdTrainerEngine.trainer_init(info, client=LLMSyncClient(world.llm), source=source)
    try:
        with pytest.raises(
            Exception, match=r"unwritten.*model\.layers\.1\.mlp\.down_proj\.weight \(all"
        ):
            trainer.send_weights()
    finally:
        trainer.shutdown()
    assert greedy(world.llm) == serving


def test_a_trainer_rank_killed_mid_update_leaves_the_engine_serving_its_previous_weights(
    world: World,
) -> None:
    serving = greedy(world.llm)
    version = last_version(world.llm)  # None: this worker's first test (xdist loadscope)
    outcomes: list[str] = []

    def on_event(message: Any) -> Any:
        outcomes.append(message[1])
        return ("ok", None)

    job = {
        "config": LLAMA,
        "seeds": [7],
        "model": "llama",
        "url": world.url,
        "out": str(world.root / "killed"),
        "die_before": 0,
    }
    codes = run_fsdp_trainer(job, on_event, world.llm)
    assert codes[1] == 9
    [outcome] = outcomes
    assert outcome.startswith("engine update_weights failed"), outcome
    assert greedy(world.llm) == serving and last_version(world.llm) == version
    # The engine is not wedged: the next complete version refits.
    world.llm.start_weight_update()
    world.llm.finish_weight_update()


def test_the_refitd_backend_is_registered_through_vllms_plugin_entry_point() -> None:
    code = (
        "import vllm.plugins as p; p.load_general_plugins(); "
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F, "
        "WeightTransferTrainerFactory as T; assert 'refitd' in F._registry and 'refitd' in T._registry"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_readme_vllm_snippets_refit_a_running_engine(world: World) -> None:
    _engine_block, trainer_block = readme_blocks("## vLLM backend (`refitd.integrations.vllm`)")
    weights = write_model(world.root / "readme", LLAMA, seed=8)
    exec(trainer_block, {"llm": world.llm, "weights": weights})
    assert stats(world.llm)["version"] >= 1
    assert mismatches(world.llm, world.root / "readme") == []


def test_megatron_style_column_blocks_from_two_ranks_refit_the_engine_exactly(world: World) -> None:
    from refitd.integrations.sources import MegatronSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    state = write_model(world.root / "megatron", LLAMA, seed=9)

    def blocks(rank: int) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """Rank ``rank`` of 2 holds the right or left half of every matrix's columns
        (strided against the checkpoint's rows) and every vector whole."""
        out = []
        for name, t in state.items():
            if t.dim() == 1:
                out.append((name, t.clone(), (0,), tuple(t.shape)))
                continue
            half = t.shape[1] // 2
            out.append(
                (
                    name,
                    t[:, rank * half : (rank + 1) * half].clone(),
                    (0, rank * half),
                    tuple(t.shape),
                )
            )
        return out

    client = LLMSyncClient(world.llm)
    ranks = [
        RefitdTrainerEngine.trainer_init(
            RefitdTrainerInitInfo(rank=r, model="megatron", world_size=2, url=world.url),
            client=client,
            source=MegatronSource(blocks(r)),
        )
        for r in (1, 0)  # rank 0, the sender, drives the engine once both parts are in
    ]
    try:
        ranks[0].publish()
        ranks[1].send_weights()
    finally:
        for r in ranks:
            r.shutdown()
    after = stats(world.llm)
    assert after["version"] == 1 and not after["replayed"]
    assert mismatches(world.llm, world.root / "megatron") == []
