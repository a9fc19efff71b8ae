"""``engine_exact``: Hugging Face models refitted through the daemon serve what fresh ones do.

For each family (a Llama, and a Qwen3-MoE built from its config; tiny, seeded), on a
device (``cuda`` in ``refitd bench gpu``; ``cpu`` in the CPU suite, where the same
code runs):

1. the trainer's weights are published as a TP2 layout (every tensor split in two
   along dim 0 where it splits evenly, one publisher part per half);
2. an engine model of the same family with other weights is refitted through the
   daemon by :class:`~refitd.client.receiver.DaemonReceiver` (staging mode), its
   parameters staying on the device;
3. it must serve the same greedy tokens and bit-equal logits as a fresh model given
   the same weights, after the first update and again after a second version whose
   compiled plan is replayed.

Needs transformers (the GPU image lacks it: its wheels travel in the device pack).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from refitd.client.http import RefitClient

__all__ = ["FAMILIES", "HFEngine", "engine_exact", "tiny_model"]

VOCAB = 128
FAMILIES = ("llama", "qwen3_moe")


def tiny_model(family: str) -> Callable[[], torch.nn.Module]:
    """A builder of a tiny model of ``family`` (untied embeddings, eager experts)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    configs: Any = tf  # transformers' config kwargs are not all typed
    if family == "llama":
        cfg: Any = configs.LlamaConfig(**common, intermediate_size=128)
        cls: Any = tf.LlamaForCausalLM
    else:
        cfg = configs.Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            experts_implementation="eager",
        )
        cls = tf.Qwen3MoeForCausalLM
    return lambda: cls(cfg).eval()


class HFEngine(torch.nn.Module):
    """A Hugging Face model with the engine face a receiver captures: ``load_weights``
    of checkpoint tensors by the model's own parameter names, each one copied whole
    through the parameter's loader (the default one: a whole-tensor copy)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from refitd.testing.engines import default_weight_loader

        params = dict(self.hf.named_parameters())
        seen = set()
        for name, loaded in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, loaded)
            seen.add(name)
        return seen


def _tp2(part: int, state: dict[str, torch.Tensor]) -> Iterator[tuple[Any, ...]]:
    """Part ``part``'s blocks of a TP2 layout: dim-0 halves, or whole on part 0."""
    for name, t in state.items():
        if t.dim() and t.shape[0] % 2 == 0:
            h = t.shape[0] // 2
            yield name, t[part * h : (part + 1) * h], (part * h,) + (0,) * (t.dim() - 1), t.shape
        elif part == 0:
            yield name, t, (0,) * t.dim(), t.shape


def _same(engine: Any, fresh: Any, device: torch.device) -> bool:
    """Bit-equal logits and equal greedy tokens of two models on the same inputs."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g).to(device)
    with torch.no_grad():
        a = engine(ids).logits
        b = fresh(ids).logits
        if not torch.equal(a, b):
            return False
        kw: dict[str, Any] = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        return bool(torch.equal(engine.generate(ids, **kw), fresh.generate(ids, **kw)))


async def engine_exact(
    client: RefitClient, device: torch.device, log: Callable[[str], None] = print
) -> bool | None:
    """Whether every family's refitted engine serves exactly what a fresh model with
    the same weights serves, on ``device``, after an update and after a replayed one
    (None where transformers is missing: nothing measured)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    import functools

    from refitd.client.receiver import DaemonReceiver
    from refitd.integrations.sources import MegatronSource, ShardPublisher
    from refitd.reshard.geometry import capture_geometry
    from refitd.testing.engines import default_weight_loader

    def capture(twin: torch.nn.Module, manifest: list[Any]) -> Any:
        return capture_geometry(twin, manifest, default_weight_loader)

    ok = True
    for family in FAMILIES:
        build = tiny_model(family)
        torch.manual_seed(0)
        trainer = build().to(device)
        torch.manual_seed(1)
        served = build().to(device)  # other weights until refitted
        model = f"hf-{family}"
        receiver = DaemonReceiver(
            local=client,
            source=client,
            model=model,
            engine=HFEngine(served),
            twin=functools.partial(lambda b: HFEngine(b()), build),
            capture=capture,
        )
        pubs = [ShardPublisher(client, model, part, 2) for part in range(2)]
        try:
            for version in (1, 2):
                if version == 2:
                    with torch.no_grad():
                        for p in trainer.parameters():
                            p.mul_(1.0625)  # a new version, every tensor changed
                state = {k: v.detach() for k, v in trainer.named_parameters()}
                for part, pub in enumerate(pubs):
                    await pub.publish(MegatronSource(list(_tp2(part, state))), version)
                stats = await receiver.refit(version)
                fresh = build().to(device)
                fresh.load_state_dict(state, strict=False)  # buffers: its own, as built
                same = _same(served, fresh, device)
                on_device = all(p.device == device for p in served.parameters())
                good = same and on_device and (version == 1 or stats.replayed)
                log(
                    f"engine_exact {family} v{version}: "
                    f"{'replayed' if stats.replayed else 'planned'}, same tokens and logits="
                    f"{same}, parameters on {device}={on_device}"
                )
                ok &= good
        finally:
            await receiver.close()
            for pub in pubs:
                await pub.close()
    return ok
