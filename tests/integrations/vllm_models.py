"""Tiny vLLM-servable models written by the tests: config, random weights, no hub.

Weights come from the Hugging Face model class itself (random init under a seed),
so names and shapes are the checkpoint's own; they are saved as safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from support.docs import python_blocks
from support.vllm_world import stop_engine, vllm_env

from refitd.bench.vllm import LLM_CPU_KWARGS, greedy, llama_config, start_daemon

__all__ = [
    "GPT_OSS",
    "LLAMA",
    "MINIMAX_M2",
    "QWEN3_MOE",
    "greedy",
    "hf_model",
    "live_params",
    "llm_kwargs",
    "loader_format_mismatches",
    "poison_weights",
    "readme_blocks",
    "run_fsdp_trainer",
    "same_tensors",
    "save_model",
    "start_daemon",
    "stop_engine",
    "vllm_env",
    "write_model",
]

LLAMA = llama_config()

QWEN3_MOE = {
    **LLAMA,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


QWEN2 = {
    **LLAMA,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",  # q, k and v projections carry a bias
    "use_sliding_window": False,
}

PHI3 = {
    **LLAMA,
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",  # the checkpoint fuses qkv_proj and gate_up_proj
    "original_max_position_embeddings": 256,
    "sliding_window": None,
    "pad_token_id": 0,
}

MIXTRAL = {
    **LLAMA,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "intermediate_size": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}

QWEN2_MOE = {
    **QWEN2,
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,  # a shared expert behind a sigmoid gate
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
}

QWEN3_TIED = {
    **LLAMA,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",  # per-head q/k norms
    "tie_word_embeddings": True,
}

GEMMA2 = {
    **LLAMA,
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",  # tied; (1 + w) norms, logit soft-caps, sliding window
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 64,
    "sliding_window": 4,  # shorter than the prompts and their 8 tokens: it matters
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}

GEMMA3 = {
    **LLAMA,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",  # tied; q/k norms, local and global layers
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 64,
    "sliding_window": 4,  # shorter than the prompts and their 8 tokens: it matters
    "sliding_window_pattern": 2,
    "rope_local_base_freq": 10000.0,
}

GRANITE = {
    **LLAMA,
    "architectures": ["GraniteForCausalLM"],
    "model_type": "granite",  # tied; embedding, residual, attention and logit multipliers
    "tie_word_embeddings": True,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.015625,
    "logits_scaling": 8.0,
}

GRANITE_MOE = {
    **GRANITE,
    "architectures": ["GraniteMoeForCausalLM"],
    "model_type": "granitemoe",  # experts as fused input_linear / output_linear stacks
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 128,
}

OLMOE = {
    **LLAMA,
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",  # q/k norms over all heads, 8 experts
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 128,
    "norm_topk_prob": False,
}

DEEPSEEK_V2 = {
    **LLAMA,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",  # MLA: latent KV (kv_lora_rank) and a decoupled rope part
    "q_lora_rank": None,
    "kv_lora_rank": 512,  # + qk_rope_head_dim = 576: the one head size the CPU MLA kernel has
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "rope_scaling": None,
}

DEEPSEEK_V3 = {
    **DEEPSEEK_V2,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "q_lora_rank": 128,  # the query compressed too: q_a_proj, q_a_layernorm, q_b_proj
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",  # routing bias e_score_correction_bias: fp32 in vLLM
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_scaling": {  # YaRN, as DeepSeek-V3 ships it (the softmax scale follows mscale)
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}

KIMI_K2 = {
    **DEEPSEEK_V3,  # Kimi-K2 is a DeepSeek-V3 architecture with many more experts
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
}


GPT_OSS = {
    **LLAMA,
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",  # bf16 experts: interleaved gate/up with biases, sinks
    "intermediate_size": 64,  # gate_up [E, H, 2I] = [4, 256, 128]: no square to confuse
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 4,  # shorter than the prompts and their 8 tokens: it matters
    "layer_types": ["sliding_attention", "full_attention"],  # alternating
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 2.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
        "rope_theta": 150000.0,
    },
}

MINIMAX_M2 = {
    **LLAMA,
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",  # its fp32 routing bias is loaded with .to(float32)
    "intermediate_size": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "use_routing_bias": True,
    # MiniMax-M2 ships sigmoid routing, which vLLM's CPU router refuses outside grouped
    # top-k (cpu_router.py: `assert self.scoring_func == "softmax"`); softmax routing
    # serves on CPU. The bias is still loaded, refitted and compared bit for bit.
    "scoring_func": "softmax",
    "rotary_dim": 32,  # partial rotary: half of each head
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
}


def hf_model(config: dict[str, Any], seed: int) -> torch.nn.Module:
    """The Hugging Face model for ``config`` with random bf16 weights from ``seed``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"}
    )
    cfg.architectures = config["architectures"]
    torch.manual_seed(seed)
    cls = getattr(transformers, config["architectures"][0])
    model = cls(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # spread values so a wrong byte changes tokens
            p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                b.copy_(torch.randn_like(b) * 0.5)
    return model.eval()


EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "minimax_m2": ("block_sparse_moe", "w1", "w3", "w2"),
}
"""Families whose checkpoints (as on the hub, and as vLLM's loaders read them) hold
one tensor per expert: the MoE block's name and the gate, up and down names."""


def per_expert(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with Hugging Face's stacked expert tensors (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) written one per expert, under
    the names of ``EXPERT_NAMES`` (other families: ``state`` unchanged)."""
    if config["model_type"] == "granitemoe":  # the hub's fused stacks, renamed only
        return {
            k.replace("experts.gate_up_proj", "input_linear.weight").replace(
                "experts.down_proj", "output_linear.weight"
            ): t
            for k, t in state.items()
        }
    names = EXPERT_NAMES.get(config["model_type"])
    if names is None:
        return state
    block, gate, up, down = names
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        prefix, _, rest = key.partition(".mlp.")
        if not rest:
            out[key] = t
        elif rest == "experts.gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{gate}.weight"] = t[e, :half].clone()
                out[f"{prefix}.{block}.experts.{e}.{up}.weight"] = t[e, half:].clone()
        elif rest == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{down}.weight"] = t[e].clone()
        else:
            out[f"{prefix}.{block}.{rest}"] = t
    return out


def save_model(path: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``state`` into ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two checkpoint folders hold the same tensors, bit for bit, under the
    same names (the truth a test loaded is the checkpoint a trainer wrote)."""
    from safetensors.torch import load_file

    ta, tb = (load_file(str(p / "model.safetensors")) for p in (a, b))
    return sorted(ta) == sorted(tb) and all(
        ta[n].dtype == tb[n].dtype
        and torch.equal(ta[n].reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8))
        for n in ta
    )


def write_model(path: Path, config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in hf_model(config, seed).state_dict().items()}
    save_model(path, config, state)
    return state


def llm_kwargs() -> dict[str, Any]:
    return dict(LLM_CPU_KWARGS)


def loader_format_mismatches(worker: Any, checkpoint: str) -> list[str]:
    """Run in a vLLM worker (``llm.collective_rpc``): the refit destinations (loader
    format) that differ, bit for bit, from a model built afresh there whose own
    ``load_weights`` read ``checkpoint`` (a safetensors file). Empty: all equal."""
    from safetensors.torch import load_file

    engine = worker.weight_transfer_engine
    with torch.device("cpu"):
        truth = engine._twin()
    truth.load_weights(load_file(checkpoint).items())
    want = dict(truth.named_parameters())
    got = engine.receiver._params
    return [n for n, p in got.items() if not torch.equal(p.data, want[n].data)]


# ---------------------------------------------------------------- the trainer side


class PipeSyncClient:
    """A ``VLLMWeightSyncClient`` that forwards each call over a pipe to the process
    holding the ``LLM`` (:func:`serve_trainer` answers there)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _call(self, method: str, *args: Any) -> None:
        self.conn.send(("call", method, args))
        status, detail = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {method} failed: {detail}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def serve_trainer(
    conn: Any, client: Any, on_event: Any, procs: list[Any], timeout_s: float = 240
) -> None:
    """In the engine's process: run ``client`` methods the trainer asks for over
    ``conn`` and hand its other messages to ``on_event(message) -> reply``, until
    the trainer says ``done`` or every trainer process has exited."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not conn.poll(0.05):
            if all(not p.is_alive() for p in procs):
                return
            continue
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "call":
            _, method, args = message
            try:
                getattr(client, method)(*args)
                conn.send(("ok", None))
            except Exception as exc:
                conn.send(("error", str(exc)))
        elif message[0] == "done":
            return
        else:
            conn.send(on_event(message))
    raise TimeoutError("trainer did not finish")


def fsdp_trainer(rank: int, world: int, port: int, job: dict[str, Any], conn: Any) -> None:
    """One FSDP2 trainer rank (``torch.multiprocessing``, gloo on CPU).

    For each seed in ``job["seeds"]`` the weights are drawn anew (the same on every
    rank), saved whole by rank 0 as the truth, sharded with ``fully_shard``, and
    published through the refitd trainer engine; rank 0 drives the engine through
    the pipe. ``job["die_before"]``: rank 1 exits abruptly instead of publishing
    that round, and rank 0 asks the engine for the half-published version anyway.
    ``job["quant"]`` (``"int8"``, ...): the ranks publish through a quantizing source
    and rank 0 saves the quantized checkpoint as the truth.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from refitd.integrations.sources import FSDPSource
    from refitd.integrations.vllm.trainer import RefitdTrainerEngine, RefitdTrainerInitInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = hf_model(job["config"], job["seeds"][0])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    client = PipeSyncClient(conn) if rank == 0 else None
    info = RefitdTrainerInitInfo(
        rank=rank,
        model=job["model"],
        world_size=world,
        url=job["url"],
        ready_timeout_s=30,
        adopt=True,  # FSDP2's shard storage moves into the published memory once
    )
    source: Any = FSDPSource(model)
    if job.get("quant"):  # publish the engine's quantized format from bf16 shards
        from refitd.integrations.quant import QuantizingSource, quantization_config

        source = QuantizingSource(source, quantization_config(job["quant"]))
    engine = RefitdTrainerEngine.trainer_init(info, client=client, source=source)
    for i, seed in enumerate(job["seeds"]):
        fresh = hf_model(job["config"], seed).state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():  # write each rank's own rows
                p.to_local().copy_(fresh[name][_rows(p)])
        if rank == 0 and job.get("quant"):
            from refitd.integrations.quant import quantization_config, save_quantized_model

            kind = quantization_config(job["quant"])
            save_quantized_model(Path(job["out"]) / f"v{i}", job["config"], fresh, kind)
        elif rank == 0:
            save_model(Path(job["out"]) / f"v{i}", job["config"], fresh)
        if job.get("die_before") == i:
            if rank == 1:
                os._exit(9)
            version = engine.publish()
            try:  # the sender races ahead without waiting for every part
                client.start_weight_update()  # type: ignore[union-attr]
                client.update_weights({"version": version})  # type: ignore[union-attr]
                outcome = "updated"
            except RuntimeError as exc:
                outcome = str(exc)
            conn.send(("refused", outcome))
            conn.recv()
            break
        engine.send_weights()
        if rank == 0:
            conn.send(("sent", engine.version, str(Path(job["out"]) / f"v{i}"), engine.last))
            conn.recv()
        dist.barrier()
    if rank == 0:
        conn.send(("done",))
    engine.shutdown()
    if job.get("die_before") is None:
        dist.destroy_process_group()


def _rows(p: Any) -> Any:
    """The index of this rank's ``Shard(0)`` rows of ``p`` in the full tensor."""
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-p.shape[0] // world)
    start = min(rank * chunk, p.shape[0])
    return slice(start, start + p.to_local().shape[0])


# ---------------------------------------------------------------- the engine side


def live_params(worker: Any) -> dict[str, torch.Tensor]:
    """Run in a vLLM worker: every parameter of the serving model, as it computes with."""
    return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}


def run_fsdp_trainer(job: dict[str, Any], on_event: Any, llm: Any) -> list[Any]:
    """Run :func:`fsdp_trainer` on 2 gloo ranks against ``llm``; returns exit codes."""
    import socket

    import torch.multiprocessing as mp

    from refitd.integrations.vllm.trainer import LLMSyncClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=fsdp_trainer, args=(r, 2, port, job, child if r == 0 else None))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        serve_trainer(parent, LLMSyncClient(llm), on_event, procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return [p.exitcode for p in procs]


def readme_blocks(heading: str, page: str = "README.md") -> list[str]:
    """The ```python blocks of the section titled ``heading`` of ``page`` (README.md or
    a page of docs/), in order."""
    return python_blocks(heading, page)


# ---------------------------------------------------------------- what an engine serves


def greedy_logprobs(llm: Any) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """What ``llm`` serves for two fixed prompts: the greedy tokens, and at every
    step the top-3 logprobs (token, logprob), exactly as the engine computed them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in ([5, 17, 33, 99, 200], [7, 300, 42])]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, detokenize=False)
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        steps = [
            sorted((int(t), float(lp.logprob)) for t, lp in step.items()) for step in c.logprobs
        ]
        out.append((list(c.token_ids), steps))
    return out


def poison_weights(worker: Any) -> int:
    """Run in a vLLM worker: overwrite every parameter with noise (integers with ones),
    so that what it serves after a refit comes from the refit's bytes alone: a
    parameter the refit leaves unwritten, or writes from the wrong place, stays
    noise. Returns how many it overwrote."""
    g = torch.Generator().manual_seed(1234)
    n = 0
    model = worker.model_runner.get_model()
    with torch.no_grad():
        for p in model.parameters():
            if not p.numel():
                continue
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
            else:
                p.fill_(1)
            n += 1
    return n


def param_digests(worker: Any) -> dict[str, str]:
    """Run in a vLLM worker: a digest of every parameter the model computes with,
    under every name it has (a tied ``lm_head`` included)."""
    import hashlib

    out = {}
    model = worker.model_runner.get_model()
    for name, p in model.named_parameters(remove_duplicate=False):
        t = p.detach().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = f"{t.dtype}{tuple(t.shape)}" + hashlib.blake2b(raw, digest_size=16).hexdigest()
    return out
