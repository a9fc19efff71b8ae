"""`refitd bench offload` runs end to end on a small model and prints its keys."""

from __future__ import annotations

import sys

import pytest
import torch

from refitd.cli import main

pytestmark = pytest.mark.timeout(300)

SMALL = ["--layers", "3", "--experts", "8", "--top-k", "2", "--hidden", "32"]
SMALL += ["--moe-intermediate", "16", "--tokens", "12", "--warmup", "4", "--device", "cpu"]


def test_the_offload_bench_prints_every_mode_and_ends_in_its_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["bench", "offload", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    for label in ("all resident", "offload 50 %", "offload 25 %", "on demand, no cache"):
        assert label in out
    last = out.strip().splitlines()[-1]
    pairs = dict(pair.split("=", 1) for pair in last.split())
    for key in (
        "offload_tps_ratio_50",
        "naive_tps_ratio_50",
        "offload_tps_ratio_25",
        "hit_rate_50",
        "hit_rate_25",
        "copied_mb_per_token_50",
        "copy_hidden_50",
    ):
        assert key in pairs, last
        assert float(pairs[key]) >= 0.0
    assert pairs["exact"] == "1"  # every mode's logits equal all resident's
    assert pairs["device"] == "cpu"
    assert 0.0 < float(pairs["hit_rate_50"]) <= 1.0
    assert float(pairs["copied_mb_per_token_50"]) > 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the bench runs on it")
def test_the_offload_bench_on_a_gpu_that_is_not_there_exits_2_naming_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "offload", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_the_offload_bench_without_transformers_exits_2_naming_the_extra_that_brings_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain install has no transformers: an import of it then fails as here.
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["bench", "offload", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "pip install 'refitd[offload]'" in err
    assert "Traceback" not in err
