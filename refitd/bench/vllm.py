"""``refitd bench vllm``: refit a vLLM engine through refitd vs reloading it from disk.

One ``LLM`` (a Llama written here: config and random bf16 weights, no hub) runs
with ``weight_transfer_config={"backend": "refitd"}`` next to a real ``refitd
serve`` daemon. For each update the trainer (this process, one rank) draws new
weights into its tensors, then the engine is brought to them twice, side by side:

- **refit**: the refitd trainer engine publishes the tensors (adopted into shared
  memory once, so no copy) and drives ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update``; the worker pulls, installs and
  runs vLLM's post-load processing;
- **reload**: the baseline a CPU user has: the trainer saves safetensors and the
  engine reloads them from disk with vLLM's own ``reload_weights``.

``verified`` is 1 when, after every update, the parameters the engine serves after
the refit are bit-identical to those after the reload of the same weights, and
greedy generation gives the same tokens. The first refit plans; later ones replay
the compiled plan. The model's size is a preset (default ``600mb``: 608 MB of bf16;
``--tiny``: the tests' 2.8 MiB Llama, for CI). The last line has ``refit_s``,
``reload_s`` (medians over the updates after the first), ``speedup``, and the same net
of vLLM's own post-load processing, which a fresh load pays too: ``net_speedup`` =
(``reload_s`` - ``process_s``) / (``refit_s`` - ``process_s``) and ``weights_gbps`` =
bytes moved / (``refit_s`` - ``process_s``). Then where the refit time goes (medians
too; they add up to ``refit_s``): the trainer's ``publish_s`` and ``ready_s``,
``handshake_s`` for vLLM's three calls beyond the worker's own refit (the lease's
release among them), the worker's ``manifest_s`` (the lease and the manifest),
``plan_s``, ``pull_s``, ``install_s`` (staging: the copy from scratch into the
parameters; swap: carrying unpulled bytes over and the swap itself), ``process_s``
(vLLM's post-load processing) and ``other_s`` (the trainer's own calls around
them), and ``bytes_moved`` per rank; ``wire_ratio`` (bytes pulled per refit over the
model's bf16 bytes) and ``verified``.

``--quant int8``: the engine serves a compressed-tensors W8A8 checkpoint; the trainer
keeps bf16 weights and publishes through
:class:`~refitd.integrations.quant.QuantizingSource` (int8 weights and their scales
on the wire); the reload saves the quantized checkpoint the same quantizer writes and
runs on a second engine of its own (vLLM's reload of a quantized CPU engine served
other tokens than a fresh load here, and would spoil the refitted engine).
``verified`` then compares the refitted engine, after the first and the last update,
with a fresh ``LLM`` loaded from that update's quantized checkpoint (digests and
greedy tokens); ``reload_exact`` says the same of vLLM's reload.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "LLM_CPU_KWARGS",
    "add_arguments",
    "beside_a_daemon",
    "greedy",
    "llama_config",
    "offline",
    "run",
    "served_digest",
    "start_daemon",
]

LLM_CPU_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "max_model_len": 128,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,  # else the CPU backend sizes KV cache in GiB
}
"""``LLM(...)`` settings for a tiny model on CPU (token ids in, token ids out)."""


PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (256, 2, 512),  # 2.8 MiB: the tests' Llama, for CI
    "600mb": (2048, 8, 512),  # 580 MiB (608 MB): a model whose bytes dominate the refit
}
"""Size presets: name -> (hidden size, decoder layers, vocabulary) of the Llama."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model size (default 600mb: hidden 2048, 8 layers, 608 MB bf16; "
        "with --quant: hidden 512, 4 layers)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the tests' 2.8 MiB Llama (--preset tiny), for CI"
    )
    parser.add_argument("--hidden", type=int, help="hidden size (overrides the preset)")
    parser.add_argument("--layers", type=int, help="decoder layers (overrides the preset)")
    parser.add_argument("--vocab", type=int, help="vocabulary (overrides the preset)")
    parser.add_argument("--updates", type=int, default=4, help="updates to time (default 4)")
    parser.add_argument(
        "--mode",
        choices=("swap", "staging", "direct"),
        default="swap",
        help="the worker's refit mode (default swap: pulls land once in a second copy of the "
        "destinations, swapped in when whole; staging: pulls land in scratch, copied in "
        "after; both install nothing on a failed pull; direct: pulls land in the "
        "destinations, a failed one leaves them half written)",
    )
    parser.add_argument(
        "--quant",
        choices=["int8"],
        default=None,
        help="serve a W8A8 INT8 checkpoint, refitted from bf16 through the quantizing source",
    )


def model_size(args: argparse.Namespace) -> tuple[int, int, int]:
    """(hidden, layers, vocab) from the preset (``--tiny`` wins; ``--quant`` without
    one: hidden 512, 4 layers, so the int8 layers outweigh the bf16 embeddings and
    head), then the overrides."""
    preset = "tiny" if args.tiny else args.preset
    hidden, layers, vocab = (
        (512, 4, 512) if preset is None and args.quant else PRESETS[preset or "600mb"]
    )
    return (args.hidden or hidden, args.layers or layers, args.vocab or vocab)


def llama_config(hidden: int = 256, layers: int = 2, vocab: int = 512) -> dict[str, Any]:
    """A Llama ``config.json`` (head_dim 64: the CPU attention backend needs it)."""
    heads = max(hidden // 64, 1)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 2, 1),
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Llama."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return out | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def _draw(state: dict[str, Any], seed: int) -> None:
    """New weights, written into the trainer's tensors in place."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)


def served_digest(worker: Any) -> dict[str, str]:
    """Run in a vLLM worker: a digest of every parameter the model computes with."""
    out = {}
    for name, p in worker.model_runner.get_model().named_parameters():
        t = p.detach().contiguous()
        raw = t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""
        out[name] = f"{t.dtype}{tuple(t.shape)}" + hashlib.blake2b(raw, digest_size=16).hexdigest()
    return out


def greedy(llm: Any) -> list[list[int]]:
    """Greedy tokens for two fixed prompts (token ids)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in ([5, 17, 33, 99, 200], [7, 300, 42])]
    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def offline(root: Path) -> None:
    """The environment every vLLM bench runs in: offline (no hub, no usage stats), its
    compile cache under ``root``, and the serialization ``collective_rpc`` of our
    functions needs."""
    os.environ.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(root / "cache"),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )


def beside_a_daemon(root: Path, bench: Callable[[str], int]) -> int:
    """``bench(url)`` with a :func:`start_daemon` beside it (``REFITD_URL`` its URL),
    stopped after, whatever ``bench`` did."""
    daemon, url = start_daemon(root)
    try:
        os.environ["REFITD_URL"] = url
        return bench(url)
    finally:
        gc.collect()
        daemon.terminate()
        daemon.wait(30)


def start_daemon(root: Path, *settings: str) -> tuple[subprocess.Popen[str], str]:
    """A real ``refitd serve`` on 127.0.0.1:0 (secret file under ``root``; ``settings``
    more ``--set`` overrides, e.g. ``"pulls.deltas=true"``): the process and its URL."""
    from refitd.client.spawn import serve_command

    secret = root / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    argv = serve_command("--port", "0", "--secret-file", str(secret), "--grace", "2")
    proc = subprocess.Popen(
        [*argv, *(a for kv in ("logging.level=warning", *settings) for a in ("--set", kv))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["url"]


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="refitd-bench-vllm-") as tmp:
        root = Path(tmp)
        offline(root)
        cfg = llama_config(*model_size(args))
        state = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in _shapes(cfg).items()}
        engine_dir, disk = root / "engine", root / "trainer"
        quant = _Quant(args.quant, cfg) if args.quant else None
        for d in (engine_dir, disk):
            d.mkdir()
            (d / "config.json").write_text(json.dumps(quant.config if quant else cfg))
        _draw(state, 0)
        save_file(
            quant.checkpoint(state) if quant else state, str(engine_dir / "model.safetensors")
        )
        nbytes = sum(t.numel() * t.element_size() for t in state.values())

        return beside_a_daemon(
            root, lambda url: _bench(args, cfg, state, engine_dir, disk, nbytes, url, quant)
        )


def _bench(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    state: dict[str, Any],
    engine_dir: Path,
    disk: Path,
    nbytes: int,
    url: str,
    quant: _Quant | None = None,
) -> int:
    from safetensors.torch import save_file
    from vllm import LLM

    from refitd.integrations.sources import TensorSource
    from refitd.integrations.vllm.trainer import (
        LLMSyncClient,
        RefitdTrainerEngine,
        RefitdTrainerInitInfo,
    )
    from refitd.integrations.vllm.worker import refit_stats

    print(
        f"refitd bench vllm: Llama hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
        f"layers, vocab {cfg['vocab_size']}: {nbytes / 2**20:.1f} MiB bf16"
        f"{f', served as {quant.kind}' if quant else ''}; vLLM TP1 on CPU; "
        f"{args.updates} updates, each through refitd and by reload from disk",
        flush=True,
    )
    llm = LLM(model=str(engine_dir), weight_transfer_config={"backend": "refitd"}, **LLM_CPU_KWARGS)
    info = RefitdTrainerInitInfo(
        rank=0, model="bench", url=url, adopt=True, worker={"mode": args.mode}
    )
    source: Any = TensorSource(state)
    if quant:
        source = quant.source(source)
    trainer = RefitdTrainerEngine.trainer_init(info, client=LLMSyncClient(llm), source=source)
    # --quant: vLLM's reload of a quantized CPU engine leaves state a fresh load does
    # not have (measured: different tokens), so it runs on an engine of its own and
    # cannot spoil the refitted one.
    reloader = LLM(model=str(engine_dir), **LLM_CPU_KWARGS) if quant else llm
    refit: list[float] = []
    reload: list[float] = []
    parts: list[dict[str, float]] = []
    verified = True
    served: dict[int, tuple[Any, Any]] = {}  # --quant: update -> (after refit, after reload)
    try:
        for update in range(1, args.updates + 1):
            _draw(state, update)
            t0 = time.perf_counter()
            trainer.send_weights()
            refit.append(time.perf_counter() - t0)
            [stats] = llm.collective_rpc(refit_stats)
            after_refit = (llm.collective_rpc(served_digest)[0], greedy(llm))

            t0 = time.perf_counter()
            if quant:  # each update's checkpoint is kept: a fresh load of it is the truth
                disk = quant.directory(disk, update)
            save_file(quant.checkpoint(state) if quant else state, str(disk / "model.safetensors"))
            reloader.collective_rpc("reload_weights", kwargs={"weights_path": str(disk)})
            reload.append(time.perf_counter() - t0)
            after_reload = (reloader.collective_rpc(served_digest)[0], greedy(reloader))
            same = after_refit == after_reload
            if quant:
                served[update] = (after_refit, after_reload)
            else:
                verified &= same
            if not same:
                print(f"  differ: {_differing(after_refit, after_reload)}", flush=True)
            last = trainer.last
            parts.append(
                {
                    "publish_s": last["publish_s"],
                    "ready_s": last["ready_s"],
                    # vLLM's three calls (start, update, finish) beyond the worker's refit
                    "handshake_s": last["engine_s"] - stats["total_s"],
                    "manifest_s": stats["manifest_s"],
                    "plan_s": stats["plan_s"],
                    "pull_s": stats["pull_s"],
                    "install_s": stats["install_s"],
                    "process_s": stats["process_s"],
                    "other_s": refit[-1] - last["publish_s"] - last["ready_s"] - last["engine_s"],
                    "bytes_moved": stats["bytes"],
                }
            )
            print(
                f"update {update}: refit {refit[-1] * 1e3:7.1f} ms "
                f"({'replayed' if stats['replayed'] else 'planned'}; trainer publish "
                f"{last['publish_s'] * 1e3:.1f} + wait READY {last['ready_s'] * 1e3:.1f} + "
                f"engine handshake {last['engine_s'] * 1e3:.1f} ms, of which the worker's "
                f"refit {stats['total_s'] * 1e3:.1f}: pull {stats['pull_s'] * 1e3:.1f}, "
                f"process {stats['process_s'] * 1e3:.1f})  reload {reload[-1] * 1e3:7.1f} ms  "
                f"same weights and tokens: {same}",
                flush=True,
            )
    finally:
        trainer.shutdown()
        del llm, reloader
        gc.collect()
    extra = ""
    if quant:
        verified, reload_exact = _against_fresh_loads(disk, served, [1, args.updates])
        extra = f" reload_exact={int(reload_exact)}"
    warm_refit = statistics.median(refit[1:] or refit)
    warm_reload = statistics.median(reload[1:] or reload)
    warm = parts[1:] or parts
    breakdown = " ".join(
        f"{k}={int(statistics.median(p[k] for p in warm))}"
        if k == "bytes_moved"
        else f"{k}={statistics.median(p[k] for p in warm):.4f}"
        for k in warm[0]
    )
    process = statistics.median(p["process_s"] for p in warm)
    moved = statistics.median(p["bytes_moved"] for p in warm)
    print(
        f"mode={args.mode} refit_s={warm_refit:.4f} reload_s={warm_reload:.4f} "
        f"speedup={warm_reload / warm_refit:.2f} "
        f"net_speedup={(warm_reload - process) / (warm_refit - process):.2f} "
        f"weights_gbps={moved / (warm_refit - process) / 1e9:.2f} first_refit_s={refit[0]:.4f} "
        f"{breakdown} bytes={nbytes} wire_ratio={stats['bytes'] / nbytes:.3f}{extra} "
        f"verified={int(verified)}"
    )
    return 0 if verified else 1


def _against_fresh_loads(
    disk: Path, served: dict[int, tuple[Any, Any]], updates: list[int]
) -> tuple[bool, bool]:
    """``--quant``: for ``updates``, what a fresh ``LLM`` loaded from that update's
    quantized checkpoint serves against the engine after the refit and after vLLM's
    reload. Returns (every refit equal, every reload equal)."""
    from vllm import LLM

    refits_ok = reloads_ok = True
    for update in sorted(set(updates)):
        fresh = LLM(
            model=str(disk.parent / f"{disk.name.rstrip('0123456789')}{update}"), **LLM_CPU_KWARGS
        )
        truth = (fresh.collective_rpc(served_digest)[0], greedy(fresh))
        del fresh
        gc.collect()
        after_refit, after_reload = served[update]
        refits_ok &= after_refit == truth
        reloads_ok &= after_reload == truth
        print(
            f"update {update} against a fresh load of its quantized checkpoint: refit "
            f"{'equal' if after_refit == truth else _differing(after_refit, truth)}, reload "
            f"{'equal' if after_reload == truth else _differing(after_reload, truth)}",
            flush=True,
        )
    return refits_ok, reloads_ok


def _differing(a: tuple[dict[str, str], Any], b: tuple[dict[str, str], Any]) -> list[str]:
    """What differs between two (digests, tokens) states: parameter names, ``tokens``."""
    names = sorted(n for n in set(a[0]) | set(b[0]) if a[0].get(n) != b[0].get(n))
    return names[:6] + (["tokens"] if a[1] != b[1] else [])


class _Quant:
    """``--quant``: the engine's quantized config and checkpoint, the trainer's source."""

    def __init__(self, kind: str, cfg: dict[str, Any]) -> None:
        from refitd.integrations.quant import (
            checkpoint_modules,
            config_dict,
            quantization_config,
        )

        self.kind = kind
        self.qc = quantization_config(kind)
        self.modules = checkpoint_modules(cfg)
        self.config = {**cfg, "quantization_config": config_dict(self.qc)}

    def directory(self, disk: Path, update: int) -> Path:
        """The directory of ``update``'s quantized checkpoint (config written)."""
        out = disk.parent / f"{disk.name.rstrip('0123456789')}{update}"
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config))
        return out

    def checkpoint(self, state: dict[str, Any]) -> dict[str, Any]:
        from refitd.integrations.quant import quantized_state_dict

        return quantized_state_dict(state, self.qc, self.modules)

    def source(self, source: Any) -> Any:
        from refitd.integrations.quant import QuantizingSource

        return QuantizingSource(source, self.qc, self.modules)
