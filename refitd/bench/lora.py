"""``refitd bench lora``: refit a LoRA adapter in a serving vLLM engine, vs a full refit and vs disk.

One ``LLM`` (the ``bench vllm`` Llama: config and random bf16 weights written here,
default preset 608 MB; ``--tiny`` the tests' 2.8 MiB one) runs with
``enable_lora=True`` and ``weight_transfer_config={"backend": "refitd"}`` next to a
real ``refitd serve`` daemon. In one run:

- **full refit**: ``--full`` (3) updates of the base model through the refitd trainer
  engine (adopted tensors, swap mode), as ``bench vllm`` times them: the median of
  those after the first (which plans). They run first: vLLM drops every adapter after
  a base-weight update;
- **adapter refit**: ``--updates`` K (5, at least 5) new versions of a rank ``--rank``
  (16) PEFT adapter on every linear layer (q, k, v, o, gate, up, down), each
  published by :class:`~refitd.integrations.lora.LoraPublisher` and refitted by
  ``refit_adapter`` (``collective_rpc(refit_lora)``; at TP > 1 a pull, then an
  install); one more before them plans. Timed from the
  publish to the refitted adapter serving (the prefix cache reset included);
- **disk**: the same adapter saved in PEFT format (``save_peft``) and loaded by vLLM
  (``add_lora`` of a ``LoRARequest`` with its path), each update.

``verified`` is 1 when, after every adapter update, the refitted adapter serves the
same greedy tokens and top-3 logprobs as vLLM serving the adapter it loaded from disk.
The last line has ``lora_refit_s`` (median), ``full_refit_s`` (median),
``lora_time_ratio`` (``lora_refit_s`` ÷ ``full_refit_s``), ``disk_s`` (median) and
``disk_ratio`` (``lora_refit_s`` ÷ ``disk_s``), ``first_lora_refit_s`` (the planned
one), ``lora_pull_s`` and ``lora_install_s`` (the worker's, medians),
``adapter_bytes`` and ``verified``. ``--tp 2``: a worker process per rank, each
pulling only its part of the adapter (the slowest rank's times are shown).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from refitd.bench.vllm import PRESETS

    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="base model size (default 600mb)"
    )
    parser.add_argument("--tiny", action="store_true", help="the tests' 2.8 MiB Llama, for CI")
    parser.add_argument("--hidden", type=int, help="hidden size (overrides the preset)")
    parser.add_argument("--layers", type=int, help="decoder layers (overrides the preset)")
    parser.add_argument("--vocab", type=int, help="vocabulary (overrides the preset)")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank (default 16)")
    parser.add_argument(
        "--updates", type=int, default=5, help="adapter updates timed, K >= 5 (default 5)"
    )
    parser.add_argument(
        "--full", type=int, default=3, help="full refits of the base model (default 3)"
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks, a worker process each (default 1)"
    )


def _adapter(cfg: dict[str, Any], rank: int, seed: int) -> dict[str, Any]:
    """A PEFT adapter of rank ``rank`` on every linear layer of the Llama ``cfg``, bf16."""
    import torch

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    dims = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in dims.items():
            p = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{p}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * 0.1).bfloat16()
            out[f"{p}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.1).bfloat16()
    return out


def _served(llm: Any, lora: Any) -> list[Any]:
    """Greedy tokens and every step's top-3 logprobs for two prompts, one at a time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    out = []
    for ids in ([5, 17, 33, 99, 200], [7, 300, 42]):
        [o] = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], params, lora_request=lora, use_tqdm=False
        )
        c = o.outputs[0]
        steps = [sorted((int(t), float(lp.logprob)) for t, lp in s.items()) for s in c.logprobs]
        out.append((list(c.token_ids), steps))
    return out


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    from refitd.bench.vllm import (
        _draw,
        _shapes,
        beside_a_daemon,
        llama_config,
        model_size,
        offline,
    )

    if args.updates < 5:
        raise SystemExit("refitd bench lora: --updates must be at least 5")
    args.quant = None  # model_size reads it
    with tempfile.TemporaryDirectory(prefix="refitd-bench-lora-") as tmp:
        root = Path(tmp)
        offline(root)
        cfg = llama_config(*model_size(args))
        state = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in _shapes(cfg).items()}
        engine_dir = root / "engine"
        engine_dir.mkdir()
        (engine_dir / "config.json").write_text(json.dumps(cfg))
        _draw(state, 0)
        save_file(state, str(engine_dir / "model.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return beside_a_daemon(
            root, lambda url: _bench(args, cfg, state, engine_dir, root, nbytes, url)
        )


def _bench(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    state: dict[str, Any],
    engine_dir: Path,
    root: Path,
    nbytes: int,
    url: str,
) -> int:
    import torch
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from refitd.bench.inflight import engine_kwargs
    from refitd.bench.vllm import _draw
    from refitd.integrations.connect import daemon_client
    from refitd.integrations.lora import LoraConfig, LoraPublisher, lora_update, save_peft
    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.lora import refit_adapter
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )

    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
    abytes = sum(t.numel() * t.element_size() for t in _adapter(cfg, args.rank, 0).values())
    print(
        f"refitd bench lora: Llama hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
        f"layers: {nbytes / 2**20:.1f} MiB bf16; a rank {args.rank} adapter on every linear "
        f"layer: {abytes / 2**20:.2f} MiB; vLLM TP{args.tp} on CPU; {args.full} full refits, then "
        f"{args.updates} adapter updates through refitd and through disk",
        flush=True,
    )
    llm = LLM(
        model=str(engine_dir),
        weight_transfer_config={"backend": "refitd"},
        enable_lora=True,
        max_loras=3,  # the refitted adapter, its spare slot, the disk-loaded one
        max_lora_rank=args.rank,
        **engine_kwargs(args.tp),
    )
    info = RefitdTrainerInitInfo(rank=0, model="bench", url=url, adopt=True)
    trainer = RefitdTrainerEngine.trainer_init(
        info, client=LLMSyncClient(llm), source=TensorSource(state)
    )
    runner = asyncio.Runner()
    client = daemon_client(url, "")
    # adopt: the trainer's adapter tensors move into the published memory once, and
    # each round's new values are written there (as training would), so a round
    # publishes with no copy; each version is retired once the engine has it.
    publisher = LoraPublisher(client, "bench-lora", config, adopt=True)
    adapter = _adapter(cfg, args.rank, 0)
    full: list[float] = []
    lora: list[float] = []
    disk: list[float] = []
    parts: list[dict[str, Any]] = []
    verified = True
    try:
        for update in range(1, args.full + 1):
            _draw(state, update)
            t0 = time.perf_counter()
            trainer.send_weights()
            full.append(time.perf_counter() - t0)
            print(f"full refit {update}: {full[-1] * 1e3:8.1f} ms", flush=True)
        refitted = LoRARequest("bench", 1, "refitd:bench-lora")
        for update in range(args.updates + 1):
            with torch.no_grad():
                for name, t in _adapter(cfg, args.rank, 1 + update).items():
                    adapter[name].copy_(t)
            t0 = time.perf_counter()
            runner.run(publisher.publish(adapter, update + 1))
            t1 = time.perf_counter()
            update_info = lora_update("bench", 1, "bench-lora", update + 1, config)
            ranks = refit_adapter(llm, update_info, reset_prefix_cache=False)
            stats = max(ranks, key=lambda r: r["total_s"])  # the slowest rank's
            t2 = time.perf_counter()
            llm.reset_prefix_cache()
            runner.run(publisher.shards.retire())  # no reader left: training may write it
            lora.append(time.perf_counter() - t0)
            parts.append(
                {
                    **stats,
                    "publish_s": t1 - t0,
                    "rpc_s": t2 - t1,
                    "reset_s": lora[-1] - (t2 - t0),  # the prefix cache's, and the retire
                }
            )
            stats = parts[-1]

            t0 = time.perf_counter()
            path = save_peft(root / f"adapter{update}", adapter, config)
            request = LoRARequest(f"disk{update}", 1000 + update, str(path))
            llm.llm_engine.add_lora(request)
            disk.append(time.perf_counter() - t0)
            same = _served(llm, refitted) == _served(llm, request)
            llm.llm_engine.remove_lora(request.lora_int_id)
            verified &= same
            print(
                f"adapter update {update}: refit {lora[-1] * 1e3:7.2f} ms "
                f"({'replayed' if stats['replayed'] else 'planned'}; publish "
                f"{stats['publish_s'] * 1e3:.2f}, rpc {stats['rpc_s'] * 1e3:.2f} (worker "
                f"{stats['total_s'] * 1e3:.2f}: pull {stats['pull_s'] * 1e3:.2f}, install "
                f"{stats['install_s'] * 1e3:.2f}), reset and retire {stats['reset_s'] * 1e3:.2f} ms, "
                f"slot {stats['old_slot']} -> {stats['slot']}, {stats['bytes']} bytes a rank)  disk {disk[-1] * 1e3:7.2f} ms  "
                f"same tokens and logprobs as from disk: {same}",
                flush=True,
            )
    finally:
        runner.run(publisher.close())
        runner.run(client.close())
        runner.close()
        trainer.shutdown()
        del llm
        gc.collect()
    lora_s = statistics.median(lora[1:])
    full_s = statistics.median(full[1:] or full)
    disk_s = statistics.median(disk[1:])
    pull_s = statistics.median(p["pull_s"] for p in parts[1:])
    install_s = statistics.median(p["install_s"] for p in parts[1:])
    print(
        f"lora_refit_s={lora_s:.4f} full_refit_s={full_s:.4f} "
        f"lora_time_ratio={lora_s / full_s:.4f} disk_s={disk_s:.4f} "
        f"disk_ratio={lora_s / disk_s:.4f} first_lora_refit_s={lora[0]:.4f} "
        f"lora_pull_s={pull_s:.4f} lora_install_s={install_s:.4f} adapter_bytes={abytes} "
        f"model_bytes={nbytes} verified={int(verified)}"
    )
    return 0 if verified else 1
