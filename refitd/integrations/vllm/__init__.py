"""refitd as a vLLM weight-transfer backend, named ``refitd``.

vLLM loads :func:`register` in every process through the ``vllm.general_plugins``
entry point (declared in refitd's package metadata), so
``LLM(..., weight_transfer_config={"backend": "refitd"})`` and
``vllm serve --weight-transfer-config '{"backend": "refitd"}'`` find it; nothing in
vLLM is patched. The worker engine is
:class:`~refitd.integrations.vllm.worker.RefitdWeightTransferEngine`, the trainer
engine :class:`~refitd.integrations.vllm.trainer.RefitdTrainerEngine`; both are
imported only when vLLM first asks for them.

Modules:

- `worker`: the worker side: a ``WeightTransferEngine`` refitting through the daemon
- `destinations`: the worker's destinations in the loader format: in place, or buffers
- `trainer`: the trainer side: publish local shards, drive vLLM's handshake
- `postload`: vLLM's post-load processing, re-run after a refit
- `prefetching`: in-flight refit, the worker side: prefetch while serving, swap all or none
- `prepared`: post-load processing run ahead of the swap, into new storage
- `inflight`: in-flight refit, the trainer side: the driver, for ``AsyncLLM`` and ``vllm serve``
- `lora`: LoRA adapter refit, the worker side: planned by capture, landed in a free slot
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "refitd"


def register() -> None:
    """Register the ``refitd`` worker and trainer engines with vLLM's factories
    (idempotent: vLLM may load plugins more than once per process)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "refitd.integrations.vllm.worker", "RefitdWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "refitd.integrations.vllm.trainer", "RefitdTrainerEngine"
        )
