"""A model whose attention vLLM derives from its weights at load (MLA) is refused.

A module of its own: its engine must not share a test process with another
in-process engine (vLLM's parallel state is one per process), which a family's
module-scoped engine in ``test_vllm_families`` would be while that module runs.
"""

from __future__ import annotations

import gc

import pytest
from test_vllm_families import Family, checkpoint_state
from vllm_models import DEEPSEEK_V2, llm_kwargs, save_model, stop_engine

pytestmark = pytest.mark.timeout(600)

MLA = Family("deepseek-v2-mla", DEEPSEEK_V2)


def test_an_mla_model_is_refused_before_any_byte_moves_naming_its_attention_layer(
    vllm_daemon_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """MLA derives ``W_UK``/``W_UV`` from ``kv_b_proj`` when vLLM loads it. Re-deriving
    them after a refit served other tokens than a fresh load in about half the runs
    here, so the backend refuses such a model when the transfer engine starts, naming
    the layer, before any update is asked for."""
    from vllm import LLM

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    root = tmp_path_factory.mktemp(MLA.name)
    b = checkpoint_state(MLA, 12, retie=True)
    save_model(root / "b", MLA.config, b)
    llm = LLM(model=str(root / "b"), weight_transfer_config={"backend": "refitd"}, **llm_kwargs())
    try:
        info = RefitdTrainerInitInfo(rank=0, model=MLA.name, url=vllm_daemon_url)
        a = checkpoint_state(MLA, 11, retie=False)
        with pytest.raises(Exception, match=r"attention layer '[\w.]*mla_attn'") as err:
            RefitdTrainerEngine.trainer_init(
                info, client=LLMSyncClient(llm), source=TensorSource(a)
            )
        assert "refused before any byte moves" in str(err.value)
    finally:
        stop_engine(llm)
        del llm
        gc.collect()
